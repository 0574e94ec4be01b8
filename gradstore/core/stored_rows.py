"""Gradient rows as the store holds them, for search: no decoding to float32, no regrouping of Lance batches.

The unit-row layouts (float16 or bfloat16 unit rows + a float32 norm) are handed over as ``(grad_ids, unit
rows, norms)`` blocks, the :data:`indexers.VectorBlocks` form with scales, so the exact kernel converts each
tile itself (to bf16 or float32) instead of the reader writing a float32 copy first, and bfloat16 rows reach
its bf16 GEMM as read (a torch bfloat16 view of Lance's buffer); float32 rows come as ``(grad_ids, rows)``. What
exact search prepares from these blocks is kept for later calls by :mod:`gradstore.core.row_cache`; the scanner
options are :mod:`gradstore.core.vector_scanner`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from gradstore.core import schema as S
from gradstore.core.filters import gradient_filter
from gradstore.core.vector_scanner import late_materialization, vector_scanner
from gradstore.core.vectors import UNIT_DTYPES, int8_scales, stored_unit_rows, vector_columns

if TYPE_CHECKING:
    from gradstore.core.database import StoreCore
    from indexers import VectorBlocks


def stored_blocks(
    store: StoreCore,
    run: str,
    checkpoint: str,
    split: str,
    where: str | None = None,
    block_rows: int = 65536,
    selected_rows: int | None = None,
    dataset: Any | None = None,
) -> VectorBlocks:
    """A re-iterable source of the selected rows' stored values (rows are read-only views of Lance's buffers).
    ``selected_rows`` (how many rows the filter keeps, when the caller knows) decides whether the vectors of
    the matching rows are taken after the filter or every row's is read
    (:func:`~gradstore.core.vector_scanner.late_materialization`); unknown: taken after the filter. ``dataset``: the
    run's Lance dataset at the version to read (default: the table's latest, looked up at each iteration)."""

    def source() -> Iterator[tuple]:
        dtype = store.storage_dtype
        read = dataset if dataset is not None else store.gradient_dataset(run)
        columns = stored_columns(dtype, read.schema)
        late = selected_rows is None or late_materialization(selected_rows, read.count_rows())
        scanner = vector_scanner(read, columns, gradient_filter(run, checkpoint, split, None, where), block_rows, late)
        for batch in scanner.to_reader():
            if batch.num_rows:
                yield stored_block(batch, dtype)

    return source


def stored_columns(dtype: str, schema: pa.Schema) -> list[str]:
    """The columns :func:`stored_block` reads for rows stored as ``dtype`` in a table of ``schema``."""
    if dtype not in UNIT_DTYPES:
        return ["grad_id", S.VECTOR_COLUMN]
    return ["grad_id", *vector_columns(schema)]


def stored_block(batch: pa.RecordBatch, dtype: str) -> tuple:
    """A scanned batch of :func:`stored_columns` as a :data:`indexers.VectorBlocks` block: ``(grad_ids, rows as
    stored, norms)`` for unit-row encodings (the row is ``norm * unit row``; int8 rows come with their per-row
    scales ``norm / ||v||`` instead, :func:`~gradstore.core.vectors.int8_scales`, and int8 rows in blocks as their
    unit rows in bf16, exact), ``(grad_ids, rows)`` for float32."""
    ids = np.array(batch.column("grad_id").to_numpy())  # small copies: writable, unlike Arrow's buffers
    rows, unit_norms = stored_unit_rows(batch, dtype, torch.bfloat16)  # blocked int8: exact in bf16
    if dtype not in UNIT_DTYPES:
        return ids, rows
    norms = np.array(batch.column(S.NORM_COLUMN).to_numpy())
    return ids, rows, int8_scales(rows, norms, unit_norms) if dtype == "int8" else norms
