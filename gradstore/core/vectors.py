"""How gradient vectors are stored: the column codec for each storage dtype.

Storage dtypes
--------------
``"float16"`` (default)
    The row's unit vector ``g / ||g||`` in float16 plus its float32 norm in ``grad_norm``. Scaling to unit
    length keeps every entry in float16's normal range whatever the gradient's magnitude, so inner products
    keep a relative error of about ``1e-4 * ||a|| ||b||`` even for gradients whose entries are ``1e-8``
    (a plain float16 column underflows to zero there). 2 bytes per dimension + 4 bytes.
``"bfloat16"``
    The same unit vector rounded to bfloat16 (float32's exponent range, 8 significant bits), stored as the
    bit patterns in a ``uint16`` column (Arrow has no bfloat16) plus the float32 norm. The exact kernel's bf16
    GEMM screens these rows as read, with no conversion. Each entry is within ``2**-8`` (relative) of the unit
    row's, so ``|a . b~ - a . b| <= 2**-8 ||a|| ||b||`` (3.9e-3) in the worst case, a query aligned with the
    rounding errors themselves (measured: 1.7e-3); for a query unrelated to them the errors mostly cancel,
    ``~2**-8 / sqrt(3 d)`` (measured maxima over 500 N(0,1) pairs: 7e-5 at d = 4,096, 3e-4 at 256, 1.4e-3 at
    16). So the 1e-3 rule holds for spread-out gradients of a few hundred dims and more, not for every pair.
    2 bytes per dimension + 4 bytes.
``"int8"``
    One byte per dimension: the unit vector ``u = g / ||g||`` quantised per row as ``q = round(127 u / max|u|)``
    (``|q| <= 127``, the row's largest entry exactly +-127) plus the float32 norm in ``grad_norm``. The row
    decodes as ``||g|| q / ||q||``: its per-row scale ``||g|| / ||q||`` is derived from the stored values and the
    norm (no scale column: every reader of unit rows reads the same two columns), and the decoded row keeps the
    true norm exactly. Each entry of ``127 u / max|u|`` is rounded by at most 1/2, so the direction's error is
    ``||q/||q|| - u|| <= sqrt(d) / ||q||`` (``<= sqrt(d) max|u| / 127``), i.e. ``|a . b~ - a . b| <= sqrt(d)
    max|u_b| / 127 ||a|| ||b||`` in the worst case (a query aligned with the rounding errors); for spread-out rows
    ``max|u| ~ 4/sqrt(d)`` this is about ``4/127 = 0.03``, and for a query unrelated to the errors they cancel
    to ``~max|u| / (127 sqrt(3))``, about 1e-3 at d = 256 and 1.6e-4 at d = 4,096 (checked in
    tests/core/test_int8_store.py). int8 values convert to bf16 exactly, so the exact kernel's bf16 screen is exact on
    the stored values and float32 rescoring decides: exact top-k on what is stored. Measured (2026-12-05,
    docs/benchmarks.md): 4,119 bytes per row on disk at 4,096 dims (float16 8,215: 0.501x); recall@10 against a
    float32 scan on decaying-spectrum rows 0.9875 (float16 1.0, bfloat16 0.998), short of the issue's 0.999;
    ``gradstore demo`` best/BM25 2.205 (float16 2.349) but fisher's recall@10 0.496 (float16 0.623) and the
    curvature-aware fisher's 0.500 (0.796): preconditioning amplifies the quantisation error. The scan of
    prepared rows is no faster than float16's (the bf16 kernel screens a bf16 copy; an int8 screen, whose bound is
    wider, rescores more rows than it saves: bench/screen.py). bench/fidelity.py's MLP (``--storage-dtype``): the
    best method at full dims and at 416 dims within 0.001 LDS of float16 (s.e. 0.006-0.008), every 416-dim method
    within 0.001, but ``source`` on full-dim true-Fisher rows 0.535 against 0.557. Not the default: the demo's
    fisher rows and the 0.999 recall fail. 1 byte per dimension + 4 bytes.
``"float32"``
    The raw vector in float32 (``grad_norm`` is still stored, for cosine and audits). 4 bytes per dimension.

Every gradient table made since the bfloat16 encoding exists tags its ``grad`` field with
``gradstore.encoding`` (:data:`ENCODING_KEY`); a table without the tag is read by its value type (float16 or
float32, all a store could hold before), and a tag or type this version does not know is refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import torch

from gradstore.errors import InvalidArgumentError, StoreCorruptError

STORAGE_DTYPES = ("float16", "bfloat16", "float32", "int8")
#: Field metadata key of the ``grad`` column naming its storage dtype (one of :data:`STORAGE_DTYPES`).
ENCODING_KEY = b"gradstore.encoding"
#: Arrow value type of each storage dtype's ``grad`` column.
VALUE_TYPES = {"float16": pa.float16(), "bfloat16": pa.uint16(), "float32": pa.float32(), "int8": pa.int8()}
#: Storage dtypes whose rows are unit vectors scaled by ``grad_norm`` (the others store the raw vector).
UNIT_DTYPES = ("float16", "bfloat16", "int8")
#: Values per kernel call when encoding: torch's parallel grain size, so each kernel does one grain of work
#: on one thread. Encoding, a memory-bound pass, then never keeps OpenMP workers spinning on cores other
#: writers (or the training) need, and its temporaries stay small (no fresh pages to fault in per commit).
ENCODE_CHUNK_VALUES = 32768
#: Values per float32 tile when measuring int8 rows' norms (:func:`int8_scales`): cache-sized, few kernel calls.
SCALE_TILE_VALUES = 1 << 18
DEFAULT_STORAGE_DTYPE = "float16"
#: The largest row norm a store holds (``grad_norm`` is float32): larger rows would be stored as ``inf``.
MAX_NORM = float(np.finfo(np.float32).max)


def check_storage_dtype(dtype: str) -> str:
    """Return ``dtype`` if it is a supported storage dtype, else raise ``InvalidArgumentError``."""
    if dtype not in STORAGE_DTYPES:
        raise InvalidArgumentError(f"storage_dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    return dtype


def vector_type(dim: int, dtype: str) -> pa.DataType:
    """Arrow type of the ``grad`` column: a fixed-size list of ``dim`` values."""
    return pa.list_(VALUE_TYPES[check_storage_dtype(dtype)], dim)


def vector_field(name: str, dim: int, dtype: str) -> pa.Field:
    """The ``grad`` field of a new table: :func:`vector_type`, tagged with its storage dtype."""
    return pa.field(name, vector_type(dim, dtype), nullable=False, metadata={ENCODING_KEY: dtype.encode()})


def storage_dtype_of(field: pa.Field) -> str:
    """Storage dtype of an existing ``grad`` field: its :data:`ENCODING_KEY` tag, else (a table made before
    the tag) its value type. Raises ``StoreCorruptError`` for an unknown tag, a tag that contradicts the value
    type, or an untagged type no version wrote (e.g. ``uint16``)."""
    tag = (field.metadata or {}).get(ENCODING_KEY)
    value = getattr(field.type, "value_type", None)
    if tag is None:
        untagged = {pa.float16(): "float16", pa.float32(): "float32"}
        if value not in untagged:
            raise StoreCorruptError(f"vector column {field.name!r} of type {field.type} has no known encoding")
        return untagged[value]
    dtype = tag.decode(errors="replace")
    if dtype not in STORAGE_DTYPES:
        raise StoreCorruptError(
            f"vector column {field.name!r} is stored as {dtype!r}, which this version of gradstore cannot read "
            f"(it reads {', '.join(STORAGE_DTYPES)})"
        )
    if value != VALUE_TYPES[dtype]:
        raise StoreCorruptError(f"vector column {field.name!r} is tagged {dtype!r} but holds {field.type}")
    return dtype


def _row_chunks(rows: int, dim: int) -> Iterator[slice]:
    """Consecutive row ranges of at most :data:`ENCODE_CHUNK_VALUES` values (at least one row each)."""
    step = max(1, ENCODE_CHUNK_VALUES // max(dim, 1))
    return (slice(start, min(start + step, rows)) for start in range(0, rows, step))


def row_norms(vectors: np.ndarray) -> np.ndarray:
    """Euclidean norm of each float32 row, as float64. Rows whose float32 sum of squares under- or
    overflows (entries below ~1e-19 or above ~1e19) are recomputed in float64 after scaling by their max."""
    source = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))
    chunked = torch.empty(len(vectors), dtype=torch.float32)
    for rows in _row_chunks(*source.shape):
        torch.linalg.vector_norm(source[rows], dim=1, out=chunked[rows])
    norms = chunked.double().numpy()
    suspect = ~np.isfinite(norms) | (norms < 1e-18)
    if suspect.any():
        rows = vectors[suspect].astype(np.float64)
        peak = np.abs(rows).max(axis=1, keepdims=True)
        safe = np.where(peak > 0, peak, 1.0)
        norms[suspect] = np.linalg.norm(rows / safe, axis=1) * peak[:, 0]
    return norms


def row_peaks(vectors: np.ndarray) -> np.ndarray:
    """Largest absolute entry of each row (NaN for a row holding NaN), in two reductions without a copy."""
    return np.maximum(vectors.max(axis=1), -vectors.min(axis=1)) if vectors.shape[1] else np.zeros(len(vectors))


def too_large_rows(vectors: np.ndarray, peaks: np.ndarray) -> np.ndarray:
    """Indices of finite rows whose norm exceeds :data:`MAX_NORM` (given their :func:`row_peaks`)."""
    suspect = np.flatnonzero(np.isfinite(peaks) & (peaks.astype(np.float64) * np.sqrt(vectors.shape[1]) > MAX_NORM))
    if len(suspect) == 0:
        return suspect
    return suspect[row_norms(vectors[suspect]) > MAX_NORM]


def encode_rows(vectors: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Encode float32 rows ``[n, dim]`` for storage: ``(values [n, dim], norms float64 [n])``.

    Never modifies ``vectors`` and never returns a view of it. A row holding NaN/Inf gets a non-finite norm.
    Runs on torch's vectorised CPU kernels (numpy's float16 cast is several times slower), chunk by chunk on
    the calling thread (:data:`ENCODE_CHUNK_VALUES`), writing straight into the result.
    """
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = row_norms(vectors)
    if check_storage_dtype(dtype) == "float32":
        return vectors.copy(), norms
    if dtype == "int8":
        return _quantised(vectors), norms
    scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    scale = torch.from_numpy(scale.astype(np.float32))[:, None]
    source = torch.from_numpy(vectors)
    values = torch.empty(source.shape, dtype=torch.float16 if dtype == "float16" else torch.bfloat16)
    for rows in _row_chunks(*source.shape):
        torch.mul(source[rows], scale[rows], out=values[rows])  # rounded to nearest (even) once
    if dtype == "float16":
        return values.numpy(), norms
    return values.view(torch.int16).numpy().view(np.uint16), norms  # bfloat16's bit patterns


def _quantised(vectors: np.ndarray) -> np.ndarray:
    """``round(127 v / max|v|)`` of each row as int8 (equal to the unit row's; zero rows and rows holding NaN/Inf
    are stored as zeros: their norm, 0 or non-finite, decodes them as 0 or NaN)."""
    peaks = row_peaks(vectors).astype(np.float64)
    usable = np.isfinite(peaks) & (peaks > 0)
    factor = np.divide(127.0, peaks, out=np.zeros_like(peaks), where=usable)
    factor = torch.from_numpy(factor.astype(np.float32))[:, None]
    source = torch.from_numpy(vectors)
    values = torch.empty(source.shape, dtype=torch.int8)
    tile = torch.empty(min(len(vectors), max(1, ENCODE_CHUNK_VALUES // max(vectors.shape[1], 1))), vectors.shape[1])
    for rows in _row_chunks(*source.shape):
        scaled = tile[: rows.stop - rows.start]
        torch.mul(source[rows], factor[rows], out=scaled)
        scaled.nan_to_num_(0.0, 0.0, 0.0).round_().clamp_(-127, 127)
        values[rows].copy_(scaled)
    return values.numpy()


def int8_scales(rows: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Per-row float32 scales of int8 rows: ``norm / ||q||`` (a row is ``scale * q``); a zero row's scale is
    ``0 * norm`` (0, or NaN for a row stored with a non-finite norm)."""
    q_norms = np.empty(len(rows), dtype=np.float32)
    with warnings.catch_warnings():  # shared read-only: only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(np.ascontiguousarray(rows))
    tile_rows = max(1, SCALE_TILE_VALUES // max(rows.shape[1], 1))
    tile = torch.empty(min(len(rows), tile_rows), rows.shape[1])
    out = torch.from_numpy(q_norms)
    for start in range(0, len(rows), tile_rows):
        part = slice(start, start + tile_rows)
        stored = source[part]
        torch.linalg.vector_norm(tile[: len(stored)].copy_(stored), dim=1, out=out[part])
    norms = np.asarray(norms, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(q_norms > 0, norms / np.where(q_norms > 0, q_norms, 1), norms * 0).astype(np.float32)


def encode(vectors: np.ndarray, dtype: str) -> tuple[pa.FixedSizeListArray, pa.Array]:
    """Encode float32 rows ``[n, dim]`` as the ``grad`` column and the ``grad_norm`` column."""
    values, norms = encode_rows(vectors, dtype)
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    return column, pa.array(norms.astype(np.float32))


def stored_values(column: pa.Array | pa.ChunkedArray, dtype: str) -> np.ndarray | torch.Tensor:
    """The ``grad`` column's values ``[n, dim]`` as stored, shared with Arrow's buffers where it can be (read-only:
    never write to them): numpy float16 or float32, or a torch bfloat16 tensor (numpy has no bfloat16)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    rows = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, column.type.list_size)
    if check_storage_dtype(dtype) != "bfloat16":
        return rows
    with warnings.catch_warnings():  # shared read-only: the callers only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)


def decode(column: pa.Array | pa.ChunkedArray, norms: pa.Array | pa.ChunkedArray, dtype: str) -> np.ndarray:
    """Decode a ``grad`` column (and its ``grad_norm``) back to float32 rows ``[n, dim]``."""
    rows = stored_values(column, dtype)
    if dtype in UNIT_DTYPES:
        norm = np.asarray(norms.to_numpy(zero_copy_only=False), dtype=np.float32)
        decoded = rows.to(torch.float32).numpy() if isinstance(rows, torch.Tensor) else rows.astype(np.float32)
        if dtype == "int8":
            norm = int8_scales(rows, norm)
        decoded *= norm[:, None]  # in place: one float32 copy of the block, not two
        return decoded
    return rows if rows.flags.writeable else rows.copy()  # Arrow buffers are read-only
