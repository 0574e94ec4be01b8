"""The store's core: tables, runs, checkpoints, gradient I/O, side files and SQL.

Imports nothing of ``gradstore`` above this package (but :mod:`gradstore.errors`); the layers above
(fitting and scoring, capture, the ``GradStore`` facade, CLI and integrations) build on it.
"""

from gradstore.core.database import GradientBlock, StoreCore, as_core, connect, one_snapshot
from gradstore.core.filters import check_filter, gradient_filter, sql_in, sql_literal
from gradstore.core.sidefiles import SideFiles
from gradstore.core.writer import GradientWriter, WriterConfig

__all__ = [
    "GradientBlock",
    "GradientWriter",
    "SideFiles",
    "StoreCore",
    "WriterConfig",
    "as_core",
    "check_filter",
    "connect",
    "gradient_filter",
    "one_snapshot",
    "sql_in",
    "sql_literal",
]
