"""gradstore: a gradient-store database for training data attribution.

>>> import gradstore
>>> store = gradstore.open("runs/store")   # creates the store if it does not exist
"""

import os

os.environ.setdefault("LANCE_LOG", "error")  # Lance logs a warning for every table it creates

from gradstore.errors import (
    GradstoreError,
    MissingIdsError,
    NonFiniteGradientError,
    NotAStoreError,
    SchemaMismatchError,
    SQLError,
    StoreCorruptError,
    UnknownRunError,
    WriterClosedError,
)
from gradstore.queries import QueryBatch
from gradstore.store import GradientBlock, GradStore
from gradstore.store import open_store as open
from gradstore.writer import GradientWriter, WriterConfig

__all__ = [
    "GradStore", "GradientBlock", "GradientWriter", "GradstoreError", "MissingIdsError", "NonFiniteGradientError",
    "NotAStoreError", "QueryBatch", "SQLError", "SchemaMismatchError", "StoreCorruptError", "UnknownRunError",
    "WriterClosedError", "WriterConfig", "open",
]
__version__ = "0.1.0"
