"""Exact top-k inner-product search: blocked matrix multiply and a running top-k, in torch (CPU or GPU)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from indexers.blocks import ArrayLike, VectorBlocks, as_tensor, blocks_from_arrays, unpack_block
from indexers.screening import (
    RowPieces,
    ScreenedBlock,
    ScreenedQueries,
    as_scales,
    candidate_scores,
    float32_products,
    resolve_kernel,
    screened_block,
)

Transform = Callable[[torch.Tensor], torch.Tensor]
#: Row dtypes that prepared rows keep as they are on the CPU (the store's encodings); others become float32.
STORED_ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)
#: An upper bound of the norm of a float32 unit vector rounded to bfloat16 (each entry moves by at most 2**-8 of
#: itself; the rest covers the float32 rounding of the unit vector's own scaling, with a wide margin).
UNIT_BF16_NORM = 1 + 2**-6


class PreparedRows:
    """In-memory rows made ready once for repeated searches with one kernel (see :meth:`ExactIndex.prepare`).

    Rows prepared from a stream (:meth:`ExactIndex.prepare_blocks`) are prepared block by block as the first
    search iterates them, so that search scores each block while the stream reads the next; they are
    :attr:`complete` once some iteration reached the end. Iterating is safe from several threads (each block
    is prepared once)."""

    def __init__(
        self,
        kernel: str,
        blocks: list,
        pending: Iterator | None = None,
        on_complete: Callable[[PreparedRows], None] | None = None,
    ) -> None:
        self.kernel = kernel
        self.blocks = list(blocks)
        self._pending = pending
        self._on_complete = on_complete
        self._lock = threading.Lock()

    @property
    def complete(self) -> bool:
        """Whether every block is prepared (rows from a stream: once an iteration reached its end)."""
        return self._pending is None

    def __iter__(self) -> Iterator:
        """The prepared blocks in order, preparing the pending ones as they are reached."""
        position = 0
        while True:
            if position < len(self.blocks):
                yield self.blocks[position]
                position += 1
                continue
            with self._lock:
                if position < len(self.blocks):  # another iteration prepared it meanwhile
                    continue
                if self._pending is None:
                    return
                block = next(self._pending, None)
                if block is None:
                    self._pending = None
                    if self._on_complete is not None:
                        self._on_complete(self)
                    return
                self.blocks.append(block)

    def __len__(self) -> int:
        return sum(len(block[0]) if isinstance(block, tuple) else len(block) for block in self)


def resolve_device(device: str | torch.device | None = None, kernel: str = "auto") -> torch.device:
    """The torch device an exact search runs on: ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
    :class:`torch.device`), or for ``None`` CUDA when torch sees a GPU (and ``kernel`` is not the CPU-only
    ``"bfloat16"``), else the CPU. A CUDA device torch does not see here is a ``ValueError`` saying which ones
    it sees."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() and kernel != "bfloat16" else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from error
    if resolved.type != "cuda":  # the CPU (other torch devices are taken as they are)
        return resolved
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {str(device)!r}: torch sees no CUDA GPU here; use device='cpu' "
            "(or leave device unset: CUDA when there is one, else the CPU)"
        )
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(f"device {str(device)!r}: torch sees {count} CUDA GPU(s) here, cuda:0 to cuda:{count - 1}")
    return resolved


class ExactIndex:
    """Brute-force search over a source of vector blocks, never holding more than one block of scores.

    Results equal a full float32 ``Q @ X.T`` followed by a sort (best score first, ties broken by the smaller
    id). Two kernels give the same result: ``"float32"`` (blocks of any float dtype upcast one cache-sized
    tile at a time, e.g. the store's float16 rows) and ``"bfloat16"`` (a bf16 GEMM screens, float32 rescoring of the
    rows that provably can reach the top-k decides; see :mod:`indexers.screening`). ``kernel="auto"`` takes
    bfloat16 on a CPU with native bf16 matmul (AVX-512 BF16 / AMX), float32 elsewhere; :attr:`kernel` says
    which one runs. The bf16 screen runs on :class:`PreparedRows` and on bf16 blocks; streamed float16 and
    float32 blocks are scored in float32 by either kernel (a bf16 copy made for one search costs more than
    it saves). ``max_norm``, when given, is an upper bound of every stored row's norm (before its scale) that
    the caller guarantees, e.g. :data:`UNIT_BF16_NORM` for unit rows rounded to bf16: the bfloat16 kernel then
    screens bf16 rows without measuring their norms (a pass over the rows that costs about a bf16 GEMM).
    ``device`` (:func:`resolve_device`; :attr:`device` says which) is where the search runs: CUDA when torch sees
    a GPU unless set, and a CUDA device torch does not see is a ``ValueError``.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        block_rows: int = 65536,
        kernel: str = "auto",
        max_norm: float | None = None,
    ):
        if block_rows < 1:
            raise ValueError("block_rows must be >= 1")
        if max_norm is not None and not max_norm >= 0:
            raise ValueError(f"max_norm must be a non-negative bound of the row norms, got {max_norm}")
        self.max_norm = max_norm
        self.device = resolve_device(device, kernel)
        self.block_rows = block_rows
        self.kernel = resolve_kernel(kernel, self.device)

    def prepare(self, ids: np.ndarray, vectors: ArrayLike, scales: np.ndarray | None = None) -> PreparedRows:
        """In-memory ``ids [n]`` and rows ``[n, d]`` (times ``scales [n]`` when given) made ready for repeated
        searches. The float32 kernel keeps float16, bfloat16 and float32 rows as they are on the CPU (each search
        upcasts them one cache-sized tile at a time: :func:`float32_products`) and float32 rows on a GPU; the
        bfloat16 kernel adds a bf16 copy and row norms. Rows already in a kept dtype on the device are referenced,
        not copied."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) != len(vectors) or (scales is not None and len(scales) != len(ids)):
            raise ValueError(
                f"ids must be 1-D with one id (and scale) per vector row; got {ids.shape} for {tuple(vectors.shape)}"
            )
        blocks = []
        for start in range(0, len(ids), self.block_rows):
            part = slice(start, start + self.block_rows)
            blocks.append(self._prepared(ids[part], vectors[part], None if scales is None else scales[part]))
        return PreparedRows(self.kernel, blocks)

    def prepare_blocks(
        self, source: VectorBlocks, on_complete: Callable[[PreparedRows], None] | None = None
    ) -> PreparedRows:
        """Every row of ``source`` (blocks with or without scales) made ready as :meth:`prepare` makes in-memory
        rows, block by block as the first search reaches them (:class:`PreparedRows`); ``on_complete`` is called
        with the rows once the last block is prepared. For the bfloat16 kernel, consecutive small blocks are
        grouped up to ``block_rows`` rows and prepared as one, so a source read in small pieces (Lance returns a
        batch per fragment) is screened in large blocks, which screen best; the group's rows stay in their pieces
        (:class:`~indexers.screening.RowPieces`: no copy). The float32 kernel keeps each source block as it
        comes (on the CPU as read: no copy), so the first search scores a block while the source reads the next:
        its speed does not depend on the block size (50,000 x 4,096 rows, 64 queries, 2 threads: 0.45-0.46 s in
        blocks of 1,024 to 65,536 rows), while joining the pieces cost a second float32 copy of the rows
        (``bench/query.py --rows 50000`` on a 2-core AVX2 CPU, first search ever over the float16 rows read from
        Lance: 1.78 s joined, 0.98 s block by block with a float32 copy of each block)."""
        return PreparedRows(self.kernel, [], self._prepared_stream(source), on_complete)

    def _prepared_stream(self, source: VectorBlocks) -> Iterator:
        """The prepared blocks of :meth:`prepare_blocks`: the float32 kernel's one source block at a time, the
        bfloat16 kernel's one group of source blocks at a time."""
        if self.kernel != "bfloat16":
            for block in map(unpack_block, source()):
                yield from self.prepare(*block).blocks
            return
        group: list[tuple] = []
        for block in map(unpack_block, source()):
            if group and sum(len(part[0]) for part in group) + len(block[0]) > self.block_rows:
                yield from self._prepared_group(group)
                group = []
            group.append(block)
        if group:
            yield from self._prepared_group(group)

    def _prepared_group(self, group: list[tuple]) -> list:
        """Consecutive source blocks ``(ids, vectors, scales or None)`` prepared as one block (a single source
        block larger than ``block_rows`` as several)."""
        if len(group) == 1:
            return self.prepare(*group[0]).blocks
        ids = np.concatenate([part[0] for part in group])
        scales = None if group[0][2] is None else np.concatenate([part[2] for part in group])
        pieces = RowPieces([as_tensor(part[1], None, self.device) for part in group])
        return [self._prepared(ids, pieces, scales)]

    def search(
        self,
        queries: ArrayLike,
        source: VectorBlocks | tuple[np.ndarray, ArrayLike] | PreparedRows,
        k: int,
        largest: bool = True,
        transform: Transform | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (or bottom-k with ``largest=False``) stored vectors by inner product with each query.

        ``queries`` is ``[q, d]`` (or ``[d]``); ``source`` is a :data:`VectorBlocks` callable, in-memory
        ``(ids, vectors)`` or :class:`PreparedRows`; ``transform`` is applied to every float32 vector block
        before scoring (e.g. a preconditioner's ``apply_both``; not with prepared rows). Blocks with ``scales``
        score ``scales * (transform(vectors) @ q)``, which equals scoring the scaled rows for linear transforms
        (every preconditioner's ``apply_both`` except ``cosine``, which needs no scales).
        Returns ``(scores float32 [q, k'], ids int64 [q, k'])`` with
        ``k' = min(k, rows)``, best first: largest scores for top-k, smallest for bottom-k.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        signed = as_tensor(queries, torch.float32, self.device)
        signed = signed if largest else -signed
        if isinstance(source, PreparedRows):
            if transform is not None or source.kernel != self.kernel:
                raise ValueError("prepared rows are searched as prepared: same kernel, no transform")
            blocks = iter(source)
        else:
            if isinstance(source, tuple):
                source = blocks_from_arrays(*source, block_rows=self.block_rows)
            blocks = self._streamed(source, transform)
        best = RunningTopK(signed.shape[0], k, self.device)
        screened = ScreenedQueries(signed) if self.kernel == "bfloat16" else None
        queries_t = signed.T.contiguous()  # [d, q]: block @ queries_t is the faster orientation (tall output)
        for block in blocks:
            is_screened = isinstance(block, ScreenedBlock)
            ids, rows, scales = (block.ids, block.exact, block.scales) if is_screened else block
            if rows.shape[1] != signed.shape[1]:
                raise ValueError(f"queries have dimension {signed.shape[1]}, stored vectors {rows.shape[1]}")
            if is_screened:
                best.add(*candidate_scores(block, screened, best.floor(), k))
                continue
            best.add(float32_products(rows, queries_t, scales).T, ids)
        scores, ids = best.result()
        return (scores if largest else -scores).cpu().numpy(), ids.cpu().numpy()

    def _prepared(self, ids: np.ndarray, vectors: ArrayLike | RowPieces, scales: np.ndarray | None):
        """One block of :meth:`prepare`: ``(ids, rows, scales)`` for the float32 kernel, a :class:`ScreenedBlock`
        for the bf16 kernel."""
        ids_t, scales_t = torch.from_numpy(ids).to(self.device), as_scales(scales, self.device)
        if self.kernel == "bfloat16":
            rows = vectors if isinstance(vectors, RowPieces) else as_tensor(vectors, None, self.device)
            return screened_block(ids_t, rows, scales_t, self.max_norm)
        rows = as_tensor(vectors, None, self.device)
        if self.device.type != "cpu" or rows.dtype not in STORED_ROW_DTYPES:
            rows = rows.to(torch.float32)
        return ids_t, rows, scales_t

    def _streamed(self, source: VectorBlocks, transform: Transform | None) -> Iterator:
        """The source's blocks, cut to ``block_rows``: bf16 blocks screened as they are (bfloat16 kernel, no
        transform), others scored in float32 as they are (:func:`float32_products` upcasts tile by tile), or, with a
        transform, upcast into a reused buffer and transformed. Measured on 65,536 float16 rows: screening a
        block scored once (bf16 copy, norms, rounding errors) costs 0.43-0.67 s against 0.19-0.37 s for the
        tiled float32 products (1-64 queries)."""
        upcast: torch.Tensor | None = None
        for ids, vectors, scales in map(unpack_block, source()):
            for start in range(0, len(ids), self.block_rows):
                part = slice(start, start + self.block_rows)
                ids_t = torch.from_numpy(np.asarray(ids[part], np.int64)).to(self.device)
                scales_t = as_scales(None if scales is None else scales[part], self.device)
                raw = as_tensor(vectors[part], None, self.device)
                if self.kernel == "bfloat16" and raw.dtype == torch.bfloat16 and transform is None:
                    yield screened_block(ids_t, raw, scales_t, self.max_norm)
                    continue
                if transform is None:  # scored as stored, upcast one tile at a time (see float32_products)
                    yield ids_t, raw, scales_t
                    continue
                raw, upcast = _reused(upcast, raw, torch.float32)
                yield ids_t, transform(raw).to(torch.float32), scales_t


def _reused(
    buffer: torch.Tensor | None, raw: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``raw`` as ``dtype``: itself when it already is, else copied into the reused ``buffer`` (a fresh 1 GB
    tensor per block costs more in page faults than the conversion)."""
    if raw.dtype == dtype:
        return raw, buffer
    if buffer is None or buffer.shape[1] != raw.shape[1] or buffer.shape[0] < raw.shape[0]:
        buffer = torch.empty(raw.shape, dtype=dtype, device=raw.device)
    block = buffer[: raw.shape[0]]
    block.copy_(raw)
    return block, buffer


class RunningTopK:
    """The ``k`` best ``(score, id)`` pairs per query seen so far (best score first, ties to the smaller id).

    Fed blocks of scores (:meth:`add`) or other top-k lists (:meth:`merge`): partial top-k lists of disjoint
    rows merged this way equal the top-k of all rows, ties included. For bottom-k, feed negated scores.
    """

    def __init__(self, n_queries: int, k: int, device: str | torch.device = "cpu"):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.scores = torch.empty(n_queries, 0, dtype=torch.float32, device=device)
        self.ids = torch.empty(n_queries, 0, dtype=torch.int64, device=device)

    def floor(self) -> torch.Tensor:
        """Each query's current k-th best score (a lower bound of its final one), ``-inf`` before k rows."""
        if self.scores.shape[1] < self.k:
            return torch.full((self.scores.shape[0],), -torch.inf, device=self.scores.device)
        return self.scores[:, self.k - 1]

    def add(self, scores: torch.Tensor, ids: torch.Tensor) -> None:
        """Take in a block: ``scores [q, n]`` of the rows ``ids`` (``[n]``, or ``[q, n]`` one per query)."""
        scores, candidate_ids = _block_top_k(scores, ids, self.k)
        self.merge(scores, candidate_ids)

    def merge(self, scores: ArrayLike, ids: ArrayLike) -> None:
        """Take in a top-k list: ``scores [q, m]`` and ``ids [q, m]`` (e.g. another shard's :meth:`result`)."""
        if isinstance(scores, np.ndarray):  # copied: arrays from another process may be read-only
            scores, ids = torch.from_numpy(np.array(scores, np.float32)), torch.from_numpy(np.array(ids, np.int64))
        scores = scores.to(device=self.scores.device, dtype=torch.float32)
        ids = ids.to(device=self.ids.device, dtype=torch.int64)
        self.scores, self.ids = _merge(torch.cat([self.scores, scores], 1), torch.cat([self.ids, ids], 1), self.k)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [q, k'], ids [q, k'])``, best first, ``k' = min(k, rows seen)``."""
        return self.scores, self.ids


def _block_top_k(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``min(k, n)`` best columns of ``scores [q, n]`` per row, the columns' ids ``[n]`` shared by all rows
    or ``[q, n]`` one per row; ties at the cut go to smaller ids."""
    ids = ids.expand(scores.shape[0], -1)
    if k >= scores.shape[1]:
        return scores, ids
    # One extra candidate shows whether the cut is tied: more than k scores are >= the k-th iff the
    # (k+1)-th equals it, and then torch.topk's choice among the tied scores is arbitrary.
    values, positions = scores.topk(k + 1, dim=1)
    tied_rows = (values[:, k] == values[:, k - 1]).nonzero().flatten().tolist()
    values, candidate_ids = values[:, :k].clone(), ids.gather(1, positions[:, :k])
    for row in tied_rows:
        columns = (scores[row] >= values[row, k - 1]).nonzero().flatten()
        row_scores, row_ids = _merge(scores[row, columns][None], ids[row, columns][None], k)
        values[row], candidate_ids[row] = row_scores[0], row_ids[0]
    return values, candidate_ids


def _merge(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort candidates by score descending, then id ascending (two stable sorts), and keep the first ``k``."""
    ids, by_id = ids.sort(dim=1, stable=True)
    scores = scores.gather(1, by_id)
    scores, by_score = scores.sort(dim=1, descending=True, stable=True)
    return scores[:, :k], ids.gather(1, by_score)[:, :k]
