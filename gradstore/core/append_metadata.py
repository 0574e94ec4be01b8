"""Metadata of appended gradient rows, checked and converted to its column types when it is appended.

A value that does not fit its column (``step="abc"``, ``split=123``, ``loss="x"``, a fractional step,
a loss beyond float32's range) is refused in ``append`` itself with ``SchemaMismatchError``, so it
never reaches the background commit, where it would fail a whole buffer of good rows. Used by
:class:`~gradstore.core.writer.GradientWriter`; nothing to do with the row cache (:mod:`gradstore.core.row_cache`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gradstore.core import schema as S
from gradstore.errors import SchemaMismatchError

Value = pa.Scalar | pa.Array
_FIELDS = {f.name: f for f in S.GRADIENT_METADATA_FIELDS if f.name not in ("grad_id", "run_id", "example_id")}
_CONVERSION_ERRORS = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,
    TypeError,
    ValueError,
    OverflowError,
)


def is_sequence(value: Any) -> bool:
    """Whether a metadata value holds one value per row (list, tuple, 1-d array or tensor, Arrow array)."""
    return isinstance(value, (list, tuple, np.ndarray, pa.Array)) or (hasattr(value, "shape") and len(value.shape) == 1)


def checked_metadata(metadata: dict[str, Any], n: int) -> dict[str, Value]:
    """Each value as an Arrow scalar (broadcast) or an array of ``n`` values of its column's type."""
    unknown = set(metadata) - set(_FIELDS)
    if unknown:
        raise SchemaMismatchError(f"unknown metadata column(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    return {name: _converted(_FIELDS[name], value, n) for name, value in metadata.items()}


def _converted(field: pa.Field, value: Any, n: int) -> Value:
    sequence = is_sequence(value)
    try:
        if sequence:
            raw = value if isinstance(value, (list, pa.Array)) else np.asarray(value)
            converted = raw.cast(field.type) if isinstance(raw, pa.Array) else pa.array(raw, field.type)
        else:
            converted = pa.scalar(value.item() if isinstance(value, np.generic) else value, field.type)
    except _CONVERSION_ERRORS as error:
        raise SchemaMismatchError(
            f"metadata {field.name!r} must hold {field.type} values, got {_show(value)} ({error})"
        ) from None
    if sequence and len(converted) != n:
        raise SchemaMismatchError(f"metadata {field.name!r} has {len(converted)} values for {n} rows")
    if (
        pa.types.is_integer(field.type)
        and not sequence
        and isinstance(value, (float, np.floating))
        and not float(value).is_integer()
    ):
        raise SchemaMismatchError(f"metadata {field.name!r} must hold integers, got {value!r}")
    if pa.types.is_floating(field.type):
        _check_no_overflow(field, value, converted)
    return converted


def _check_no_overflow(field: pa.Field, value: Any, converted: Value) -> None:
    """A finite value that became infinite in the column's type is refused (never stored as ``inf``)."""
    infinite = pc.is_inf(converted)
    if not (infinite.as_py() if isinstance(infinite, pa.Scalar) else pc.any(infinite).as_py()):
        return
    original = np.asarray(
        value.to_numpy(zero_copy_only=False) if isinstance(value, pa.Array) else value, dtype=np.float64
    )
    if np.isfinite(original[np.asarray(infinite).astype(bool)] if original.ndim else original).any():
        raise SchemaMismatchError(
            f"metadata {field.name!r} holds a value beyond the range of {field.type} "
            f"(largest finite {np.finfo(np.float32).max:.3g}); it would be stored as inf"
        )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def take(value: Value, keep: np.ndarray) -> Value:
    """The rows ``keep`` of a per-row value (a broadcast scalar is kept as it is)."""
    return value.take(pa.array(keep)) if isinstance(value, pa.Array) else value


def metadata_column(field: pa.Field, values: list[Value | None], counts: list[int]) -> pa.Array:
    """One column over several appends (``values[i]`` for ``counts[i]`` rows): per-row arrays concatenated,
    scalars broadcast in C (the usual case is one scalar per append for step, epoch, split, ...)."""
    if not any(isinstance(v, pa.Array) for v in values):
        if all(v is None for v in values):
            return pa.nulls(sum(counts), field.type)
        scalars = pa.array([None if v is None else v.as_py() for v in values], field.type)
        return scalars.take(pa.array(np.repeat(np.arange(len(values)), counts)))
    parts = [
        v if isinstance(v, pa.Array) else pa.repeat(v if v is not None else pa.scalar(None, field.type), n)
        for v, n in zip(values, counts)
    ]
    return pa.concat_arrays([p.cast(field.type) for p in parts])
