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
    CaptureUsageError,
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
from ingest.losses import sample_labels


def connect(uri: str, token: str | None = None, **kwargs):
    """A client of a ``gradstore serve`` server at ``uri`` (``grpc://host:port``) with bearer ``token``: the read
    side of the store API (``attribute``, ``sql``, ``self_influence``, ``select``, ``runs``, ``info``) over Arrow
    Flight (see docs/serve.md)."""
    import importlib  # at call time: the server's package sits above every layer the package root serves

    return importlib.import_module("gradstore.serve.client").connect(uri, token, **kwargs)


__all__ = [
    "CaptureUsageError",
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
    "connect",
    "sample_labels",
    "open",
]
__version__ = "0.1.0"
