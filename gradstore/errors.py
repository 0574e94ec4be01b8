"""The error family of gradstore: everything it raises on purpose is a :class:`GradstoreError`.

Errors of the lower layers (``ingest``, ``indexers``) that reach a store user are re-raised at the
boundary as the gradstore subclass of the same name below, which is also an instance of the original
class (``except ingest.ProjectionMismatchError`` keeps working) and chains it as ``__cause__``.
"""

from __future__ import annotations

import indexers
import ingest


class GradstoreError(Exception):
    """Base class of every error gradstore raises on purpose."""


class _Readable:
    """``KeyError`` quotes its message; errors that are also ``KeyError``s keep it readable."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(GradstoreError, ValueError):
    """An argument has a value gradstore cannot use (unknown method, k < 1, empty selection, bad budget)."""


class InvalidNameError(InvalidArgumentError):
    """A run, index or checkpoint name that cannot be used (empty, or one that would become a path)."""


class InvalidFilterError(InvalidArgumentError):
    """A ``where`` filter that is not one self-contained boolean expression."""


class NotAStoreError(GradstoreError, FileNotFoundError):
    """The path exists but is not a gradstore store (or does not exist and creation was not allowed)."""


class StoreCorruptError(GradstoreError):
    """A store table or side file exists but cannot be read (damaged files, foreign schema)."""


class SchemaMismatchError(GradstoreError, ValueError):
    """Appended data does not match the table's schema (missing columns, wrong types or dimensions)."""


class NonFiniteGradientError(GradstoreError, ValueError):
    """A gradient row holds NaN or Inf. The rows are rejected; nothing of the batch is written."""


class UnknownRunError(_Readable, GradstoreError, KeyError):
    """A run id that the store does not hold."""


class MissingIdsError(_Readable, GradstoreError, KeyError):
    """Example or query ids that the store does not hold."""


class UnknownIndexError(GradstoreError, FileNotFoundError):
    """An index name that the store does not hold."""


class MissingCurvatureError(GradstoreError, FileNotFoundError):
    """Kronecker curvature statistics that were never captured (capture with ``curvature=True``)."""


class SQLError(GradstoreError, ValueError):
    """A SQL query failed (DuckDB's message) or tried to modify the store."""


class WriterClosedError(GradstoreError, RuntimeError):
    """Rows appended to a writer that was closed, or whose background commit failed."""


class ProjectionMismatchError(GradstoreError, ingest.ProjectionMismatchError):
    """A capture or query whose projection spec differs from the run's (see ``ProjectionSpec.check_matches``)."""


class RecomputationError(GradstoreError, ingest.RecomputationError):
    """A captured module was recomputed inside a backward (reentrant gradient checkpointing)."""


class IndexMismatchError(GradstoreError, indexers.IndexMismatchError):
    """A saved index was built from other data than the store holds now (another projection or dim)."""


#: Lower-layer error class -> the gradstore class it is re-raised as.
_TRANSLATED: dict[type[Exception], type[GradstoreError]] = {
    ingest.ProjectionMismatchError: ProjectionMismatchError,
    ingest.RecomputationError: RecomputationError,
    indexers.IndexMismatchError: IndexMismatchError,
}


def translated(error: BaseException) -> GradstoreError | None:
    """The gradstore error to raise (``from error``) for a lower layer's ``error``; ``None`` if none applies."""
    if isinstance(error, GradstoreError):
        return None
    for original, ours in _TRANSLATED.items():
        if isinstance(error, original):
            if ours is IndexMismatchError:
                return IndexMismatchError(error.differences)
            return ours(*error.args)
    return None
