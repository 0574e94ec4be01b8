"""Two-stage search: candidates from an approximate index, then an exact re-rank of rows read back from Lance.

The approximate index (FAISS IVF/SQ/PQ over the prepared rows: a compressed copy) proposes ``candidates``
rows per query; their stored vectors are read back from the gradients table by ``grad_id`` (a
:class:`RowLocator`: Lance ``take`` by row offset, no filtered scan), moved into the method's space and scored
exactly against the prepared queries, and the best ``k`` are kept (ties: the smaller ``grad_id``). The scores
returned are exact; the recall is that of the candidate lists. Candidates deleted from the store since the
index was built are dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from gradstore.core import StoreCore
from gradstore.core.vectors import decode, vector_columns
from gradstore.errors import StoreCorruptError
from gradstore.preconditioning.scoring import ScoringSpace
from indexers import RunningTopK


class RowLocator:
    """Reads stored rows by ``grad_id`` with Lance ``take`` (row offsets), through a ``grad_id -> offset`` map.

    Offsets are positions in one version of the gradients dataset: appends leave them alone but deletions
    and compaction move rows, so the map (one scan of the ``grad_id`` column, 16 bytes a row) is rebuilt
    whenever the dataset's version changes, and every read checks the ids it got back."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None  # (table, version) the map was built from
        self._ids = np.empty(0, np.int64)  # sorted grad_ids of the whole table
        self._offsets = np.empty(0, np.int64)  # their row offsets, aligned

    def read(self, store: StoreCore, run: str, grad_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found bool [n], float32 rows [found.sum(), dim])`` for sorted unique ``grad_ids [n]`` of run
        ``run``: the rows of the ids present in the store now, in that order."""
        name = store.gradient_table_name(run)
        with store.reading(name):
            dataset = store.gradient_dataset(run)
            if (name, dataset.version) != self._key:
                self._build(dataset)
                self._key = (name, dataset.version)
            positions = np.minimum(np.searchsorted(self._ids, grad_ids), max(len(self._ids) - 1, 0))
            found = self._ids[positions] == grad_ids if len(self._ids) else np.zeros(len(grad_ids), bool)
            offsets = self._offsets[positions[found]]  # ascending with the ids? not after compaction: sort
            order = np.argsort(offsets, kind="stable")
            table = dataset.take(offsets[order], columns=["grad_id", *vector_columns(dataset.schema)])
        got = table.column("grad_id").to_numpy()
        if not np.array_equal(got, grad_ids[found][order]):
            raise StoreCorruptError(
                f"the gradient table of run {run!r} in {store.uri} returned other rows than asked for"
            )
        rows = decode(table, store.storage_dtype)
        rows[order] = rows.copy()
        return found, rows

    def _build(self, dataset) -> None:
        ids = dataset.to_table(columns=["grad_id"]).column("grad_id").to_numpy()
        order = np.argsort(ids, kind="stable")
        self._ids, self._offsets = ids[order], order.astype(np.int64)


def rerank(
    store: StoreCore,
    run: str,
    space: ScoringSpace,
    prepared: torch.Tensor,
    candidates: np.ndarray,
    k: int,
    locator: RowLocator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k among each query's ``candidates [q, c]`` (``grad_id``s of run ``run``; ``-1`` marks none,
    as FAISS does).

    ``locator`` (kept by the caller across searches) reads the candidates' rows. Returns ``(scores float32
    [q, k'], ids int64 [q, k'])``, best first; ``-1`` ids (score ``-inf``) fill rows with fewer than ``k``
    candidates."""
    wanted = np.unique(candidates[candidates >= 0])
    found, stored = (locator or RowLocator()).read(store, run, wanted)
    wanted = wanted[found]
    rows = space.rows(torch.from_numpy(stored)).to(torch.float32)
    positions = np.minimum(np.searchsorted(wanted, candidates), max(len(wanted) - 1, 0))
    present = (candidates >= 0) & (wanted[positions] == candidates if len(wanted) else False)
    scores = (
        (prepared.to(torch.float32) @ rows.T).gather(1, torch.from_numpy(np.where(present, positions, 0)))
        if len(wanted)
        else torch.zeros(candidates.shape, dtype=torch.float32)
    )
    scores[~torch.from_numpy(present)] = -torch.inf
    best = RunningTopK(len(prepared), k)
    best.merge(scores, torch.from_numpy(np.ascontiguousarray(candidates, np.int64)))
    top_scores, top_ids = best.result()
    return top_scores.numpy(), top_ids.numpy()
