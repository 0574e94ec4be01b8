"""Gradient rows as the store holds them, for search: no decoding to float32, no regrouping of Lance batches.

The float16 layout (unit rows + a float32 norm) is handed over as ``(grad_ids, unit rows, norms)`` blocks,
the :data:`indexers.VectorBlocks` form with scales, so the exact kernel converts each tile itself (to bf16 or
float32) instead of the reader writing a float32 copy first; float32 rows come as ``(grad_ids, rows)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from gradstore.core import schema as S
from gradstore.core.filters import gradient_filter

if TYPE_CHECKING:
    from gradstore.core.database import StoreCore
    from indexers import VectorBlocks


def stored_blocks(
    store: StoreCore, run: str, checkpoint: str, split: str, where: str | None = None, block_rows: int = 65536
) -> VectorBlocks:
    """A re-iterable source of the selected rows' stored values (rows are read-only views of Lance's buffers)."""

    def source() -> Iterator[tuple[np.ndarray, ...]]:
        scaled = store.storage_dtype != "float32"
        columns = ["grad_id", S.VECTOR_COLUMN] + ([S.NORM_COLUMN] if scaled else [])
        scanner = (
            store.gradient_table(run)
            .to_lance()
            .scanner(
                columns=columns, filter=gradient_filter(run, checkpoint, split, None, where), batch_size=block_rows
            )
        )
        for batch in scanner.to_reader():
            if batch.num_rows == 0:
                continue
            ids = np.array(batch.column("grad_id").to_numpy())  # small copies: writable, unlike Arrow's buffers
            rows = _values(batch.column(S.VECTOR_COLUMN))
            yield (ids, rows, np.array(batch.column(S.NORM_COLUMN).to_numpy())) if scaled else (ids, rows)

    return source


def _values(column: pa.FixedSizeListArray) -> np.ndarray:
    """``[n, dim]`` numpy view of a fixed-size list column (copied only when Arrow cannot share it)."""
    dim = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
