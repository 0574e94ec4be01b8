"""The error family of gradstore: everything it raises on purpose is a :class:`GradstoreError`.

Errors of the lower layers (``ingest``, ``indexers``) that reach a store user are re-raised at the
boundary as the gradstore subclass of the same name below, which is also an instance of the original
class (``except ingest.ProjectionMismatchError`` keeps working) and chains it as ``__cause__``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

import indexers
import ingest

_Function = TypeVar("_Function", bound=Callable[..., Any])


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


class StorePermissionError(GradstoreError, PermissionError):
    """The store (or a file of it) may not be read or written by this process: file modes, a read-only mount, or
    object-store credentials that are missing or refused. Writes asked of a store opened read-only raise it too."""


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


class MissingReplayError(_Readable, GradstoreError, LookupError):
    """``method="replay"`` asked for queries that no exact replay of the run computed (or the run's recorded
    steps changed since): compute it first with ``store.replay(...)``."""


class SQLError(GradstoreError, ValueError):
    """A SQL query failed (DuckDB's message) or tried to modify the store."""


class WriterClosedError(GradstoreError, RuntimeError):
    """Rows appended to a writer that was closed, or whose background commit failed."""


class ProjectionMismatchError(GradstoreError, ingest.ProjectionMismatchError):
    """A capture or query whose projection spec differs from the run's (see ``ProjectionSpec.check_matches``)."""


class RecomputationError(GradstoreError, ingest.RecomputationError):
    """A captured module was recomputed inside a backward (reentrant gradient checkpointing)."""


class CaptureUsageError(InvalidArgumentError, ingest.CaptureUsageError):
    """A capture used in a way it cannot work: no supported layer in the model, ids that do not match the
    batch, a loss reduction the inputs cannot support (the message says what to change)."""


class IndexMismatchError(GradstoreError, indexers.IndexMismatchError):
    """A saved index was built from other data than the store holds now (another projection or dim)."""


class UnstableRecursionError(GradstoreError, ArithmeticError):
    """A trajectory method's linearised recursion over the recorded steps overflowed (NaN/Inf) at a named step:
    the stored rows are finite, the product of the steps' operators is not (see docs/concepts.md, "Optimizer
    dynamics and stability")."""


class NonFiniteScoresError(GradstoreError, ArithmeticError):
    """A method's scores hold NaN/Inf (float overflow: rows, queries or a trajectory's products beyond float32, as
    after training that diverged); nothing is written."""


class GradstoreWarning(UserWarning):
    """Base class of the warnings gradstore issues on purpose."""


class StaleIndexWarning(GradstoreWarning):
    """A FAISS index searched after the rows of its selection changed: rows it does not hold yet (build it again to
    add them), or rows appended since the fit its FAISS rows and queries are balanced with (its scores are that
    fit's, not the current fit's that exact search and ``rerank=`` score with: ``refit=True`` rebuilds it)."""


class StaleCurvatureWarning(GradstoreWarning):
    """A checkpoint's Kronecker factors (``curvature=True``) do not describe its rows: rows were added to it by a
    capture without ``curvature=True`` (or deleted), or a resumed capture could not recover the factors of the rows
    before its first step. ``kfac``/``ekfac`` score every row with them as they are."""


class UnstableStepWarning(GradstoreWarning):
    """A recorded step's curvature would make a trajectory method's linearised recursion expand (e.g.
    ``lr * lambda_max(H) > 2`` for plain SGD): its eigenvalues were clipped to the stable range."""


class UnmodelledOptimizerWarning(GradstoreWarning):
    """The trajectory methods read steps whose update they do not model: taken by an optimizer whose update rule
    they do not model (RMSprop, Adagrad, NAdam, ...: each such step is taken as ``lr x gradient``), on gradients
    other than the backward's (clipping), or weighting their rows unevenly (micro-batches of different sizes)."""


class UnscaledRowsWarning(GradstoreWarning):
    """A capture saw the optimizer step on the backward's gradients divided by a power of two (an AMP
    ``GradScaler`` not given to it as ``grad_scaler=``): its rows carry the scaler's scale."""


class ReplayMismatchWarning(GradstoreWarning):
    """``store.replay``'s per-example losses of the run's first step differ from those capture recorded
    (``per_example_loss=``): ``batch_fn`` or ``loss_fn`` may not build the training's batches or losses."""


#: Lower-layer error class -> the gradstore class it is re-raised as.
_TRANSLATED: dict[type[Exception], type[GradstoreError]] = {
    ingest.ProjectionMismatchError: ProjectionMismatchError,
    ingest.RecomputationError: RecomputationError,
    ingest.CaptureUsageError: CaptureUsageError,
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


#: Keywords the API no longer takes -> what replaces them (the error names it).
REMOVED_KEYWORDS = {
    "eigen_correction": "method='ekfac' (eigen-corrected K-FAC is a method of its own)",
    "preconditioner_method": "method=...",
}


def surface_error(error: BaseException) -> GradstoreError | None:
    """The gradstore error a non-gradstore ``error`` escaping a public call is raised as (``from error``):
    a lower layer's error as its gradstore twin, ``PermissionError`` as :class:`StorePermissionError`, Lance's
    invalid-input ``ValueError`` as :class:`InvalidArgumentError`; ``None`` for anything else (a fault, not
    the user's input: it propagates as it is)."""
    ours = translated(error)
    if ours is not None:
        return ours
    if isinstance(error, PermissionError):
        return StorePermissionError(
            f"permission denied: {error} (check the store's file modes or object-store credentials; "
            "a store this process cannot write answers reads with write=False)"
        )
    if isinstance(error, ValueError) and str(error).startswith("Invalid user input"):
        return InvalidArgumentError(f"the store refused an argument: {str(error).splitlines()[0]}")
    return None


def surface(function: _Function) -> _Function:
    """Decorate a public entry point: keywords it does not take raise :class:`InvalidArgumentError` naming the
    ones it does (and a removed keyword's replacement), a flag (a parameter annotated ``bool``, or ``bool | None``)
    given anything but ``True``/``False`` (or ``None``) raises one naming the flag, a numpy integer or float scalar
    (``k=np.int64(5)``, ``damping=np.float32(0.1)``) is passed on as the Python number it holds, and errors escaping
    it go through :func:`surface_error`."""
    signature = inspect.signature(function)
    flags = _flags(signature)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise _argument_error(function.__name__, signature, kwargs, error) from error
        given = bound.arguments
        for name, optional in flags.items():
            if name in given:
                _check_flag(function.__name__, name, given[name], optional)
        numpy_scalars = [name for name, value in given.items() if isinstance(value, (np.integer, np.floating))]
        if numpy_scalars:
            for name in numpy_scalars:
                given[name] = given[name].item()
            args, kwargs = bound.args, bound.kwargs
        try:
            return function(*args, **kwargs)
        except GradstoreError:
            raise
        except Exception as error:
            ours = surface_error(error)
            if ours is None:
                raise
            raise ours from error

    return call  # type: ignore[return-value]


def _flags(signature: inspect.Signature) -> dict[str, bool]:
    """The flags of ``signature``: its parameters annotated ``bool`` (-> ``False``) or ``bool | None`` (-> ``True``:
    ``None`` is a value too)."""
    flags = {}
    for parameter in signature.parameters.values():
        annotation = parameter.annotation
        spelled = annotation.__name__ if isinstance(annotation, type) else str(annotation)
        if spelled in ("bool", "bool | None"):
            flags[parameter.name] = spelled != "bool"
    return flags


def _check_flag(call: str, name: str, value: Any, optional: bool) -> None:
    """Refuse flag ``name`` of ``call`` given ``value``, anything but ``True``/``False`` (numpy's too; or ``None``
    when ``optional``): ``"no"`` or ``0`` would otherwise pass as a truth value."""
    if isinstance(value, (bool, np.bool_)) or (optional and value is None):
        return
    choices = "True, False or None (the default)" if optional else "True or False"
    raise InvalidArgumentError(f"{call}(): {name}= takes {choices}, got {value!r}")


def _argument_error(
    name: str, signature: inspect.Signature, kwargs: dict[str, Any], error: TypeError
) -> InvalidArgumentError:
    known = [p for p in signature.parameters if p != "self"]
    for keyword in kwargs:
        if keyword in REMOVED_KEYWORDS:
            return InvalidArgumentError(f"{name}() no longer takes {keyword}=: use {REMOVED_KEYWORDS[keyword]}")
        if keyword not in signature.parameters:
            close = difflib.get_close_matches(keyword, known, n=1)
            hint = f"did you mean {close[0]}=? " if close else ""
            return InvalidArgumentError(f"{name}() takes no argument {keyword}=: {hint}it takes {', '.join(known)}")
    return InvalidArgumentError(f"{name}(): {error} (it takes {', '.join(known)})")
