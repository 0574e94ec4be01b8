"""Exact top-k inner-product search: blocked matrix multiply and a running top-k, in torch (CPU or GPU)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from indexers.blocks import ArrayLike, VectorBlocks, as_tensor, blocks_from_arrays, unpack_block

Transform = Callable[[torch.Tensor], torch.Tensor]


class ExactIndex:
    """Brute-force search over a source of vector blocks, never holding more than one block of scores.

    Results equal a full ``Q @ X.T`` followed by a sort (best score first, ties broken by the smaller id).
    Blocks of any float dtype are upcast to float32 one block at a time (e.g. the store's float16 rows).
    """

    def __init__(self, device: str | torch.device | None = None, block_rows: int = 65536):
        if block_rows < 1:
            raise ValueError("block_rows must be >= 1")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.block_rows = block_rows

    def search(
        self,
        queries: ArrayLike,
        source: VectorBlocks | tuple[np.ndarray, ArrayLike],
        k: int,
        largest: bool = True,
        transform: Transform | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (or bottom-k with ``largest=False``) stored vectors by inner product with each query.

        ``queries`` is ``[q, d]`` (or ``[d]``); ``source`` is a :data:`VectorBlocks` callable or in-memory
        ``(ids, vectors)``; ``transform`` is applied to every float32 vector block before scoring (e.g. a
        preconditioner's ``apply_both``). Blocks with ``scales`` score ``scales * (transform(vectors) @ q)``,
        which equals scoring the scaled rows for linear transforms (every preconditioner's ``apply_both``
        except ``cosine``, which needs no scales).
        Returns ``(scores float32 [q, k'], ids int64 [q, k'])`` with
        ``k' = min(k, rows)``, best first: largest scores for top-k, smallest for bottom-k.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if isinstance(source, tuple):
            source = blocks_from_arrays(*source, block_rows=self.block_rows)
        signed = as_tensor(queries, torch.float32, self.device)
        signed = signed if largest else -signed
        # [d, q] contiguous: block @ queries_t is the faster orientation for BLAS (tall output).
        queries_t = signed.T.contiguous()
        best = RunningTopK(signed.shape[0], k, self.device)
        buffer: torch.Tensor | None = None
        for ids, vectors, scales in map(unpack_block, source()):
            for start in range(0, len(ids), self.block_rows):
                block_ids = torch.from_numpy(np.asarray(ids[start : start + self.block_rows], np.int64))
                block, buffer = self._float32_block(vectors[start : start + self.block_rows], buffer)
                if transform is not None:
                    block = transform(block).to(torch.float32)
                if block.shape[1] != signed.shape[1]:
                    raise ValueError(
                        f"queries have dimension {signed.shape[1]}, stored vectors {block.shape[1]}"
                    )
                scores = block @ queries_t
                if scales is not None:
                    scores *= torch.from_numpy(scales[start : start + self.block_rows]).to(self.device)[
                        :, None
                    ]
                best.add(scores.T, block_ids.to(self.device))
        scores, ids = best.result()
        return (scores if largest else -scores).cpu().numpy(), ids.cpu().numpy()

    def _float32_block(
        self, vectors: ArrayLike, buffer: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block as float32 on the device; other dtypes are upcast into one reused buffer.

        Reusing the buffer matters: a fresh 1 GB tensor per block costs more (page faults) than the upcast."""
        raw = as_tensor(vectors, None)
        if raw.dtype == torch.float32:
            return raw.to(self.device), buffer
        if buffer is None or buffer.shape[1] != raw.shape[1]:
            buffer = torch.empty(self.block_rows, raw.shape[1], dtype=torch.float32, device=self.device)
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

    def add(self, scores: torch.Tensor, ids: torch.Tensor) -> None:
        """Take in a block: ``scores [q, n]`` of the rows ``ids [n]``."""
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
    """The ``min(k, n)`` best columns of ``scores [q, n]`` per row; ties at the cut go to smaller ids."""
    if k >= scores.shape[1]:
        return scores, ids.expand(scores.shape[0], -1)
    # One extra candidate shows whether the cut is tied: more than k scores are >= the k-th iff the
    # (k+1)-th equals it, and then torch.topk's choice among the tied scores is arbitrary.
    values, positions = scores.topk(k + 1, dim=1)
    tied_rows = (values[:, k] == values[:, k - 1]).nonzero().flatten().tolist()
    values, candidate_ids = values[:, :k].clone(), ids[positions[:, :k]]
    for row in tied_rows:
        columns = (scores[row] >= values[row, k - 1]).nonzero().flatten()
        row_scores, row_ids = _merge(scores[row, columns][None], ids[columns][None], k)
        values[row], candidate_ids[row] = row_scores[0], row_ids[0]
    return values, candidate_ids


def _merge(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort candidates by score descending, then id ascending (two stable sorts), and keep the first ``k``."""
    ids, by_id = ids.sort(dim=1, stable=True)
    scores = scores.gather(1, by_id)
    scores, by_score = scores.sort(dim=1, descending=True, stable=True)
    return scores[:, :k], ids.gather(1, by_score)[:, :k]
