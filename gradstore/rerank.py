"""Two-stage search: candidates from an approximate index, then an exact re-rank of rows read back from Lance.

The approximate index (FAISS IVF/SQ/PQ over the prepared rows: a compressed copy) proposes ``candidates``
rows per query; their stored vectors are read back from the gradients table by ``grad_id``, moved into the
method's space and scored exactly against the prepared queries, and the best ``k`` are kept (ties: the
smaller ``grad_id``). The scores returned are exact; the recall is that of the candidate lists.
"""

from __future__ import annotations

import numpy as np
import torch

from gradstore.core import StoreCore
from gradstore.core import schema as S
from gradstore.core.vectors import decode
from gradstore.scoring import ScoringSpace
from indexers import RunningTopK


def read_rows(store: StoreCore, run: str, grad_ids: np.ndarray) -> np.ndarray:
    """The stored float32 vectors of run ``run``'s ``grad_ids`` (sorted, unique, all present), in that order."""
    if len(grad_ids) == 0:
        return np.empty((0, store.run_dim(run)), np.float32)
    table = (
        store.gradient_table(run)
        .to_lance()
        .to_table(
            columns=["grad_id", S.VECTOR_COLUMN, S.NORM_COLUMN],
            filter=f"grad_id IN ({', '.join(str(int(g)) for g in grad_ids)})",
        )
    )
    found = table.column("grad_id").to_numpy()
    rows = decode(table.column(S.VECTOR_COLUMN), table.column(S.NORM_COLUMN), store.storage_dtype)
    return rows[np.argsort(found)]


def rerank(
    store: StoreCore, run: str, space: ScoringSpace, prepared: torch.Tensor, candidates: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k among each query's ``candidates [q, c]`` (``grad_id``s of run ``run``; ``-1`` marks none,
    as FAISS does).

    Returns ``(scores float32 [q, k'], ids int64 [q, k'])``, best first; ``-1`` ids (score ``-inf``) fill rows
    with fewer than ``k`` candidates."""
    wanted = np.unique(candidates[candidates >= 0])
    rows = space.rows(torch.from_numpy(read_rows(store, run, wanted))).to(torch.float32)
    present = candidates >= 0
    positions = torch.from_numpy(np.where(present, np.searchsorted(wanted, candidates), 0))
    scores = (
        torch.einsum("qd,qcd->qc", prepared.to(torch.float32), rows[positions])
        if len(wanted)
        else torch.zeros(candidates.shape, dtype=torch.float32)
    )
    scores[~torch.from_numpy(present)] = -torch.inf
    best = RunningTopK(len(prepared), k)
    best.merge(scores, torch.from_numpy(np.ascontiguousarray(candidates, np.int64)))
    top_scores, top_ids = best.result()
    return top_scores.numpy(), top_ids.numpy()
