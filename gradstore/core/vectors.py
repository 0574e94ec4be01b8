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
    One byte per dimension, in blocks: the unit vector ``u = g / ||g||`` is cut into blocks of
    :data:`INT8_BLOCK` (32) consecutive entries, each block ``b`` stored as ``q_b = round(u_b / 2^e_b)`` with one
    shared power-of-two exponent ``e_b = ceil(log2(max|u_b| / 127))`` (so ``|q| <= 127``; the OCP microscaling
    MXINT8 layout), the exponents in an int8 column ``grad_exponents`` (``ceil(d / 32)`` bytes a row), plus the
    float32 norm in ``grad_norm``. A block's entries are rounded at its own scale, so a layer (or an eigen-direction
    range) whose entries are 100x smaller than the row's largest keeps the same ~1% relative error as the largest:
    with one scale per row (the format before, still read: a table without ``grad_exponents``) those blocks were
    rounded at the row's scale, 40-96% off on the demo's curvature-aware rows, and preconditioning amplified that
    (the demo's curvature-aware fisher recall@10 fell from 0.796 to 0.500). The unit row decodes as
    ``v = q_b 2^e_b`` (exact in bf16 and float32: at most 7 significant bits times a power of two) and the row as
    ``||g|| v / ||v||``: its per-row scale ``||g|| / ||v||`` is derived from the stored values and the norm, so the
    decoded row keeps the true norm exactly. Each entry of the stored unit row ``v`` is off by at most
    ``2^(e_b - 1) <= max|u_b| / 127`` (a block's scale is within 2x of its peak's). The decoded row (what
    ``read_gradients`` returns) is also divided by ``||v||``, which moves entry ``i`` by a further
    ``|u_i| |1 - ||v||| <= |u_i| ||v - u||``: ``|g~_i / ||g|| - u_i| <= (max|u_b| / 127 + |u_i| ||v - u||) / ||v||``,
    which can exceed ``max|u_b| / 127`` (by up to 1.14x on 3,000 x 512 N(0,1) rows whose second half is 100x
    smaller). Inner products: ``|a . b~ - a . b| <= sqrt(d) max|u| / 127 ||a|| ||b||`` in the worst case and
    ``~max|u_b| / (127 sqrt(3))`` per block for a query unrelated to the errors (all checked in
    tests/core/test_int8_store.py). The exact kernel takes the decoded unit rows as bf16 (exact) with the per-row
    scale: its bf16 screen is exact on the stored values and float32 rescoring decides, so top-k is exact on what
    is stored, with 2 bytes per dimension prepared (float16's 4). Measured (2026-12-06, docs/benchmarks.md):
    ``gradstore demo`` best/BM25 2.361 (float16 2.349; the per-row format 2.205), fisher recall@10 0.629 (float16
    0.623), curvature-aware fisher 0.798 (0.796); recall@10 against a float32 scan on dense decaying-spectrum
    rows (4,000 x 256, no block structure to exploit) 0.986 (per-row 0.9875, bfloat16 0.998, float16 1.0), short
    of issue 39's 0.999; bench/fidelity.py's MLP: all 70 method x variant LDS within 0.001 of float16's. Not the
    default for that recall. 1 byte per dimension + 1 byte per 32 + 4 bytes.
``"float32"``
    The raw vector in float32 (``grad_norm`` is still stored, for cosine and audits). 4 bytes per dimension.

Every gradient table made since the bfloat16 encoding exists tags its ``grad`` field with
``gradstore.encoding`` (:data:`ENCODING_KEY`); a table without the tag is read by its value type (float16 or
float32, all a store could hold before), and a tag or type this version does not know is refused. int8 rows in
blocks are tagged ``"int8-blocks"`` (:data:`INT8_BLOCKS_TAG`), so a version that knows only the per-row ``"int8"``
refuses them rather than decoding them at the wrong scales; a layout that contradicts its tag (blocks without
``grad_exponents``, or per-row rows beside it) is refused as corrupt.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gradstore.errors import InvalidArgumentError, StoreCorruptError

STORAGE_DTYPES = ("float16", "bfloat16", "float32", "int8")
#: Field metadata key of the ``grad`` column naming its storage dtype (one of :data:`STORAGE_DTYPES`, or
#: :data:`INT8_BLOCKS_TAG`).
ENCODING_KEY = b"gradstore.encoding"
#: The encoding tag of int8 rows in blocks (the plain ``"int8"`` tag: the per-row format before them).
INT8_BLOCKS_TAG = "int8-blocks"
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
#: Entries of an int8 row sharing one power-of-two exponent (the ``grad_exponents`` column).
INT8_BLOCK = 32
#: The columns of a gradient table's rows: the stored values, the norm, and an int8 table's block exponents
#: (absent in int8 tables of the per-row format).
VECTOR_COLUMN = "grad"
NORM_COLUMN = "grad_norm"
EXPONENT_COLUMN = "grad_exponents"
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


def vector_field(name: str, dim: int, dtype: str, *, int8_blocks: bool = True) -> pa.Field:
    """The ``grad`` field of a new table: :func:`vector_type`, tagged with its storage dtype (int8 in blocks:
    :data:`INT8_BLOCKS_TAG`, which versions before the blocks refuse instead of misreading)."""
    tag = INT8_BLOCKS_TAG if dtype == "int8" and int8_blocks else dtype
    return pa.field(name, vector_type(dim, dtype), nullable=False, metadata={ENCODING_KEY: tag.encode()})


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
    if dtype == INT8_BLOCKS_TAG:
        dtype = "int8"
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


def exponent_count(dim: int) -> int:
    """Exponents per int8 row of ``dim`` entries."""
    return -(-dim // INT8_BLOCK)


def exponent_field(dim: int) -> pa.Field:
    """The ``grad_exponents`` field of a new int8 table of ``dim``-entry rows."""
    return pa.field(EXPONENT_COLUMN, pa.list_(pa.int8(), exponent_count(dim)), nullable=False)


#: The largest finite float32: a row scale above it would be infinite.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def encode_rows(vectors: np.ndarray, dtype: str) -> tuple[np.ndarray, ...]:
    """Encode float32 rows ``[n, dim]`` for storage: ``(values [n, dim], norms float64 [n])``, and for int8
    ``(values, norms, exponents int8 [n, ceil(dim / 32)])``.

    Never modifies ``vectors`` and never returns a view of it. A row holding NaN/Inf gets a non-finite norm.
    Runs on torch's vectorised CPU kernels (numpy's float16 cast is several times slower), chunk by chunk on
    the calling thread (:data:`ENCODE_CHUNK_VALUES`), writing straight into the result.
    """
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = row_norms(vectors)
    if check_storage_dtype(dtype) == "float32":
        return vectors.copy(), norms
    scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    tiny = scale > FLOAT32_MAX  # 1 / norm overflows float32 (norm below ~2.9e-39: subnormal entries)
    if tiny.any():  # those rows made unit in float64 first (a copy: the caller's rows stay as they are)
        vectors = vectors.copy()
        vectors[tiny] = (vectors[tiny].astype(np.float64) * scale[tiny, None]).astype(np.float32)
        scale[tiny] = 1.0
    scale = torch.from_numpy(scale.astype(np.float32))[:, None]
    source = torch.from_numpy(vectors)
    if dtype == "int8":
        values, exponents = _quantised(source, scale)
        return values, norms, exponents
    values = torch.empty(source.shape, dtype=torch.float16 if dtype == "float16" else torch.bfloat16)
    for rows in _row_chunks(*source.shape):
        torch.mul(source[rows], scale[rows], out=values[rows])  # rounded to nearest (even) once
    if dtype == "float16":
        return values.numpy(), norms
    return values.view(torch.int16).numpy().view(np.uint16), norms  # bfloat16's bit patterns


def _quantised(source: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The unit rows ``source * scale`` in int8 blocks (see the module docstring): ``(q [n, d], exponents [n,
    ceil(d / 32)])``, ``q = round(u_b / 2^e_b)`` clamped to +-127 (a peak just above a power-of-two boundary in
    float32 rounding). Zero blocks get exponent 0; rows holding NaN/Inf (scale 0 or NaN) are stored as zeros, their
    non-finite norm decoding them as NaN."""
    n, dim = source.shape
    blocks = exponent_count(dim)
    values = torch.empty((n, dim), dtype=torch.int8)
    exponents = torch.empty((n, blocks), dtype=torch.int8)
    padded = blocks * INT8_BLOCK
    for rows in _row_chunks(n, padded):
        unit = torch.zeros((rows.stop - rows.start, padded))
        torch.mul(source[rows], scale[rows], out=unit[:, :dim])
        unit.nan_to_num_(0.0, 0.0, 0.0)
        tiles = unit.view(len(unit), blocks, INT8_BLOCK)
        mantissa, exponent = torch.frexp(tiles.abs().amax(2) / 127)  # peak / 127 = m 2^x, m in [0.5, 1)
        exponent -= (mantissa == 0.5).to(exponent.dtype)  # ceil(log2(peak / 127)); 0 for a zero block
        exponent.clamp_(-127, 127)  # 2^-e finite in float32 (a block below 2^-120 keeps fewer bits)
        tiles.mul_(torch.exp2(-exponent.float()).unsqueeze(2)).round_().clamp_(-127, 127)  # exact powers of 2
        values[rows].copy_(unit[:, :dim])
        exponents[rows].copy_(exponent)
    return values.numpy(), exponents.numpy()


def _quantised_per_row(vectors: np.ndarray) -> np.ndarray:
    """The int8 format of tables without ``grad_exponents`` (one scale per row): ``round(127 v / max|v|)`` of each
    row (equal to the unit row's; zero rows and rows holding NaN/Inf are stored as zeros: their norm, 0 or
    non-finite, decodes them as 0 or NaN). Written only to such tables, so each table keeps one format."""
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


def int8_unit_rows(
    values: np.ndarray, exponents: np.ndarray, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, np.ndarray]:
    """The stored unit rows ``q_b 2^e_b`` of int8 rows in blocks as ``dtype`` ``[n, d]`` (exact in float32 and
    bfloat16), and their float32 norms ``||v||``; decoded a cache-sized tile at a time (no float32 copy of the
    whole block)."""
    n, dim = values.shape
    blocks = exponents.shape[1]
    with warnings.catch_warnings():  # shared read-only: only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        q, e = torch.from_numpy(np.ascontiguousarray(values)), torch.from_numpy(np.ascontiguousarray(exponents))
    rows = torch.empty((n, dim), dtype=dtype)
    norms = torch.empty(n)
    tile_rows = max(1, SCALE_TILE_VALUES // (blocks * INT8_BLOCK))
    tile = torch.zeros((min(n, tile_rows), blocks * INT8_BLOCK))  # the padding past ``dim`` stays 0
    for start in range(0, n, tile_rows):
        part = slice(start, start + tile_rows)
        unit = tile[: len(q[part])]
        unit[:, :dim].copy_(q[part])
        unit.view(len(unit), blocks, INT8_BLOCK).mul_(torch.exp2(e[part].float()).unsqueeze(2))  # exact powers of 2
        rows[part].copy_(unit[:, :dim])
        torch.linalg.vector_norm(unit, dim=1, out=norms[part])
    return rows, norms.numpy()


def int8_scales(rows: np.ndarray, norms: np.ndarray, unit_norms: np.ndarray | None = None) -> np.ndarray:
    """Per-row float32 scales of int8 rows: ``norm / ||v||`` (a row is ``scale * v``, ``v`` the stored unit row:
    the int8 values of a per-row table, measured here; a blocked table's, whose norms :func:`int8_unit_rows` gives
    as ``unit_norms``); a zero row's scale is ``0 * norm`` (0, or NaN for a row stored with a non-finite norm)."""
    if unit_norms is None:
        unit_norms = np.empty(len(rows), dtype=np.float32)
        with warnings.catch_warnings():  # shared read-only: only read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            source = torch.from_numpy(np.ascontiguousarray(rows))
        tile_rows = max(1, SCALE_TILE_VALUES // max(rows.shape[1], 1))
        tile = torch.empty(min(len(rows), tile_rows), rows.shape[1])
        out = torch.from_numpy(unit_norms)
        for start in range(0, len(rows), tile_rows):
            part = slice(start, start + tile_rows)
            stored = source[part]
            torch.linalg.vector_norm(tile[: len(stored)].copy_(stored), dim=1, out=out[part])
    norms = np.asarray(norms, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(unit_norms > 0, norms / np.where(unit_norms > 0, unit_norms, 1), norms * 0).astype(np.float32)


def encode(vectors: np.ndarray, dtype: str, *, blocks: bool = True) -> dict[str, pa.Array]:
    """Encode float32 rows ``[n, dim]`` as the ``grad`` and ``grad_norm`` columns (and, int8, ``grad_exponents``),
    by column name; ``blocks=False``: int8 in the per-row format of tables made before the blocks."""
    if dtype == "int8" and not blocks:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        encoded: tuple[np.ndarray, ...] = (_quantised_per_row(vectors), row_norms(vectors))
    else:
        encoded = encode_rows(vectors, dtype)
    values, norms = encoded[0], encoded[1]
    columns = {
        VECTOR_COLUMN: pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1]),
        NORM_COLUMN: pa.array(norms.astype(np.float32)),
    }
    if len(encoded) == 3:
        columns[EXPONENT_COLUMN] = pa.FixedSizeListArray.from_arrays(
            pa.array(encoded[2].reshape(-1)), encoded[2].shape[1]
        )
    return columns


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


def vector_columns(schema: pa.Schema) -> list[str]:
    """The columns that hold a gradient table's rows (``grad``, ``grad_norm``, and an int8 table's exponents)."""
    return [VECTOR_COLUMN, NORM_COLUMN] + ([EXPONENT_COLUMN] if EXPONENT_COLUMN in schema.names else [])


def stored_unit_rows(
    columns: Any, dtype: str, blocked_dtype: torch.dtype = torch.float32
) -> tuple[np.ndarray | torch.Tensor, np.ndarray | None]:
    """The stored rows of :func:`vector_columns` (a record batch, table, or :func:`encode`'s dict), as
    :func:`stored_values` gives them, except int8 rows in blocks: their unit rows as ``blocked_dtype``
    (:func:`int8_unit_rows`); with the unit rows' norms where those were decoded (else ``None``)."""
    rows = stored_values(_column(columns, VECTOR_COLUMN), dtype)
    if dtype == "int8" and not isinstance(columns, dict):
        tag = (columns.schema.field(VECTOR_COLUMN).metadata or {}).get(ENCODING_KEY, b"").decode(errors="replace")
        if (tag == INT8_BLOCKS_TAG) != _has(columns, EXPONENT_COLUMN):
            raise StoreCorruptError(
                f"int8 rows tagged {tag!r} {'without' if tag == INT8_BLOCKS_TAG else 'with'} a {EXPONENT_COLUMN!r} "
                "column: the table's layout contradicts its encoding; its vectors cannot be read"
            )
    if dtype == "int8" and _has(columns, EXPONENT_COLUMN):
        exponents = _column(columns, EXPONENT_COLUMN)
        if isinstance(exponents, pa.ChunkedArray):
            exponents = exponents.combine_chunks()
        blocks = exponents.flatten().to_numpy(zero_copy_only=False).reshape(-1, exponents.type.list_size)
        return int8_unit_rows(rows, blocks, blocked_dtype)
    return rows, None


def decode(columns: Any, dtype: str) -> np.ndarray:
    """Decode the row columns of :func:`vector_columns` (a record batch, table, or :func:`encode`'s dict) back to
    float32 rows ``[n, dim]``."""
    rows, unit_norms = stored_unit_rows(columns, dtype)
    if dtype not in UNIT_DTYPES:
        return rows if rows.flags.writeable else rows.copy()  # Arrow buffers are read-only
    norm = np.asarray(_column(columns, NORM_COLUMN).to_numpy(zero_copy_only=False), dtype=np.float32)
    if dtype == "int8":
        norm = int8_scales(rows, norm, unit_norms)
    if isinstance(rows, torch.Tensor):  # bfloat16 values, or a blocked int8 table's fresh float32 unit rows
        decoded = rows.numpy() if rows.dtype == torch.float32 else rows.to(torch.float32).numpy()
    else:
        decoded = rows.astype(np.float32)
    decoded *= norm[:, None]  # in place: one float32 copy of the block, not two
    return decoded


def _column(columns: Any, name: str) -> Any:
    return columns[name] if isinstance(columns, dict) else columns.column(name)


def _has(columns: Any, name: str) -> bool:
    return name in columns if isinstance(columns, dict) else name in columns.schema.names
