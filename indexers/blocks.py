"""Sources of (ids, vectors) blocks and the conversions every index and preconditioner shares."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch

VectorBlocks = Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]
"""A re-iterable source: each call yields ``(ids int64 [n], vectors [n, d])`` blocks from the start.

It may be called several times (multi-pass algorithms such as sampling for IVF training). A block may
carry a third element, ``scales float32 [n]``: the stored row is then ``scales[:, None] * vectors`` (the
store's float16 unit rows plus a float32 norm column), without materializing the product."""

ArrayLike = np.ndarray | torch.Tensor
Rows = VectorBlocks | ArrayLike
"""What preconditioners fit on: a :data:`VectorBlocks` source, or one in-memory ``[n, d]`` array."""


def blocks_from_arrays(ids: np.ndarray, vectors: ArrayLike, block_rows: int = 65536) -> VectorBlocks:
    """Wrap in-memory ``ids [n]`` and ``vectors [n, d]`` as a :data:`VectorBlocks` source (no copy)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) != len(vectors):
        raise ValueError(f"ids must be 1-D with one id per vector row; got {ids.shape} for {tuple(vectors.shape)}")
    if block_rows < 1:
        raise ValueError("block_rows must be >= 1")

    def source() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, len(ids), block_rows):
            yield ids[start : start + block_rows], vectors[start : start + block_rows]

    return source


def as_source(rows: Rows, block_rows: int = 65536) -> VectorBlocks:
    """``rows`` as a :data:`VectorBlocks` source (an in-memory array gets ids ``0..n-1``)."""
    if callable(rows):
        return rows
    if isinstance(rows, (np.ndarray, torch.Tensor)) and rows.ndim == 2:
        return blocks_from_arrays(np.arange(len(rows)), rows, block_rows)
    raise TypeError(f"expected a VectorBlocks source or a [rows, dim] array, got {type(rows).__name__}")


def as_tensor(block: ArrayLike, dtype: torch.dtype | None, device: torch.device | str | None = None) -> torch.Tensor:
    """Convert a numpy or torch block to a 2-D tensor of ``dtype`` (``None``: keep it) on ``device``.

    No copy when the block already has that dtype and device; read-only arrays (e.g. views of Arrow buffers)
    are shared too: search never writes to its input."""
    if isinstance(block, np.ndarray):
        block = np.ascontiguousarray(block)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(block)
    else:
        tensor = block
    if tensor.ndim == 1:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim != 2:
        raise ValueError(f"expected a [rows, dim] block, got shape {tuple(tensor.shape)}")
    return tensor.to(device=device if device is not None else tensor.device, dtype=dtype or tensor.dtype)


def unpack_block(block: tuple) -> tuple[np.ndarray, ArrayLike, np.ndarray | None]:
    """``(ids, vectors, scales or None)`` from a source's 2- or 3-element block."""
    if len(block) == 2:
        return block[0], block[1], None
    ids, vectors, scales = block
    return ids, vectors, np.asarray(scales, dtype=np.float32)


def count_rows(source: VectorBlocks) -> int:
    """Number of rows a source yields (one pass over the ids only)."""
    return sum(len(block[0]) for block in source())
