"""gradstore: a gradient-store database for training data attribution.

>>> import gradstore
>>> store = gradstore.open("runs/store")   # creates the store if it does not exist
"""

import os

os.environ.setdefault("LANCE_LOG", "error")  # Lance logs a warning for every table it creates

from gradstore.attribution import ScoreMatrix
from gradstore.core import GradientBlock, GradientWriter, StoreCore, WriterConfig
from gradstore.engine import LocalEngine, RayEngine
from gradstore.errors import (
    GradstoreError,
    IndexMismatchError,
    InvalidArgumentError,
    InvalidFilterError,
    InvalidNameError,
    MissingCurvatureError,
    MissingIdsError,
    NonFiniteGradientError,
    NotAStoreError,
    ProjectionMismatchError,
    RecomputationError,
    SchemaMismatchError,
    SQLError,
    StoreCorruptError,
    StorePermissionError,
    UnknownIndexError,
    UnknownRunError,
    WriterClosedError,
)
from gradstore.queries import QueryBatch
from gradstore.store import GradStore
from gradstore.store import open_store as open
from indexers import FewerResultsWarning

__all__ = [
    "FewerResultsWarning",
    "GradStore",
    "GradientBlock",
    "GradientWriter",
    "GradstoreError",
    "IndexMismatchError",
    "InvalidArgumentError",
    "InvalidFilterError",
    "InvalidNameError",
    "LocalEngine",
    "MissingCurvatureError",
    "MissingIdsError",
    "NonFiniteGradientError",
    "NotAStoreError",
    "ProjectionMismatchError",
    "QueryBatch",
    "RayEngine",
    "RecomputationError",
    "SQLError",
    "SchemaMismatchError",
    "ScoreMatrix",
    "StoreCore",
    "StoreCorruptError",
    "StorePermissionError",
    "UnknownIndexError",
    "UnknownRunError",
    "WriterClosedError",
    "WriterConfig",
    "open",
]
__version__ = "0.1.0"
