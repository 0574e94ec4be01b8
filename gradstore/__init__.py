"""gradstore: a gradient-store database for training data attribution.

>>> import gradstore
>>> store = gradstore.open("runs/store")   # creates the store if it does not exist
"""

import os
import sys

os.environ.setdefault("LANCE_LOG", "error")  # Lance logs a warning for every table it creates

from gradstore.answers import evaluate, selection
from gradstore.answers.attribution import ScoreMatrix
from gradstore.capture import online
from gradstore.core import GradientBlock, GradientWriter, StoreCore, WriterConfig
from gradstore.core.engine import LocalEngine, RayEngine
from gradstore.errors import (
    CaptureUsageError,
    GradstoreError,
    GradstoreWarning,
    IndexMismatchError,
    InvalidArgumentError,
    InvalidFilterError,
    InvalidNameError,
    MissingCurvatureError,
    MissingIdsError,
    MissingReplayError,
    NonFiniteGradientError,
    NonFiniteScoresError,
    NotAStoreError,
    ProjectionMismatchError,
    RecomputationError,
    ReplayMismatchWarning,
    SchemaMismatchError,
    SQLError,
    StaleCurvatureWarning,
    StaleIndexWarning,
    StoreCorruptError,
    StorePermissionError,
    UnknownIndexError,
    UnknownRunError,
    UnmodelledOptimizerWarning,
    UnscaledRowsWarning,
    UnstableRecursionError,
    UnstableStepWarning,
    WriterClosedError,
)
from gradstore.methods import ScoreOptions, queries
from gradstore.methods.extension import register_method
from gradstore.methods.queries import QueryBatch
from gradstore.preconditioning import fitting, scoring
from gradstore.store import GradStore
from gradstore.store import open_store as open
from gradstore.store_api import StoreAPI
from indexers import FewerResultsWarning
from ingest import CaptureConfig
from ingest.losses import sample_labels

# The import paths these modules had before the stage packages (2026-12) stay the same modules:
# ``from gradstore.online import select_online`` keeps working.
for _moved in (evaluate, selection, online, queries):
    sys.modules[f"{__name__}.{_moved.__name__.rsplit('.', 1)[1]}"] = _moved
# And those the method families moved below search (issue 37): ``from gradstore.methods.fitting import FitCache``.
for _moved in (fitting, scoring):
    sys.modules[f"{__name__}.methods.{_moved.__name__.rsplit('.', 1)[1]}"] = _moved


def connect(uri: str, token: str | None = None, **kwargs):
    """A client of a ``gradstore serve`` server at ``uri`` (``grpc://host:port``) with bearer ``token``: the read
    side of the store API (:class:`~gradstore.store_api.StoreAPI`: ``attribute``, ``sql``, ``self_influence``,
    ``select``, ``runs``, ``info``) over Arrow Flight (see docs/serve.md)."""
    from gradstore.serve.client import RemoteStore  # when called: a local store never loads pyarrow.flight

    return RemoteStore(uri, token, **kwargs)


__all__ = [
    "CaptureConfig",
    "CaptureUsageError",
    "FewerResultsWarning",
    "GradStore",
    "GradientBlock",
    "GradientWriter",
    "GradstoreError",
    "GradstoreWarning",
    "IndexMismatchError",
    "InvalidArgumentError",
    "InvalidFilterError",
    "InvalidNameError",
    "LocalEngine",
    "MissingCurvatureError",
    "MissingIdsError",
    "MissingReplayError",
    "NonFiniteGradientError",
    "NonFiniteScoresError",
    "NotAStoreError",
    "ProjectionMismatchError",
    "QueryBatch",
    "RayEngine",
    "RecomputationError",
    "SQLError",
    "SchemaMismatchError",
    "ScoreMatrix",
    "ScoreOptions",
    "StoreAPI",
    "StoreCore",
    "StoreCorruptError",
    "StorePermissionError",
    "UnknownIndexError",
    "UnknownRunError",
    "UnstableRecursionError",
    "ReplayMismatchWarning",
    "UnscaledRowsWarning",
    "StaleCurvatureWarning",
    "StaleIndexWarning",
    "UnmodelledOptimizerWarning",
    "UnstableStepWarning",
    "WriterClosedError",
    "WriterConfig",
    "connect",
    "sample_labels",
    "open",
    "register_method",
]
__version__ = "0.1.0"
