"""Scoring scans: a task per shard on an engine, then an exact reduce on the caller's side.

Every task streams its shard block by block and returns something whose size depends on ``k`` (or on the
shard's examples), never a ``queries x rows`` matrix:

* :func:`top_k`: partial top-k and bottom-k per query (:class:`indexers.RunningTopK`), merged with the same
  order as one exact search (score, then the smaller ``grad_id``);
* :func:`self_influence`: ``g^T P^-1 g`` per row (the result has one value per row anyway);
* :func:`tracin_top_k`: TracIn sums one example's rows over every checkpoint before ranking, so its shards
  are ``example_id`` ranges (:func:`gradstore.core.shards.example_shards`): a task holds a dense ``[queries,
  examples of its range]`` float64 sum, ranks it and returns the top-k/bottom-k examples (ties by id);
* :func:`example_totals`: LESS selection's per-example scores (one float per example), by the same ranges;
* :func:`faiss_parts`: a trained FAISS index filled with each shard's rows, to be merged (index builds).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import torch

from gradstore.core.engine import Engine
from gradstore.core.shards import Shard
from gradstore.preconditioning.scoring import ScoringSpace
from indexers import FaissIndex, RunningTopK, float32_products
from indexers.blocks import as_tensor, unpack_block
from indexers.identity import unit_rows
from indexers.screening import as_scales

TopK = dict[bool, tuple[np.ndarray, np.ndarray]]
"""``{largest: (scores [q, k'], ids [q, k'])}``: top-k for ``True``, bottom-k for ``False``, best first."""


# ---------------------------------------------------------------------------------------------- top-k of rows
@dataclass
class _TopKJob:
    space: ScoringSpace
    prepared: torch.Tensor  # [q, dim] float32, already in the searched space
    k: int
    sides: tuple[bool, ...]


def top_k(
    engine: Engine,
    shards: Sequence[Shard],
    space: ScoringSpace,
    prepared: torch.Tensor,
    k: int,
    sides: Sequence[bool] = (True,),
) -> TopK:
    """Exact top-k (``True`` in ``sides``) and bottom-k (``False``) ``grad_id``s per prepared query."""
    job = _TopKJob(space, prepared.to(torch.float32).contiguous(), k, tuple(sides))
    merged = {side: RunningTopK(len(prepared), k) for side in job.sides}
    for partial in engine.map(_top_k_task, shards, job):
        for side, (scores, ids) in partial.items():
            merged[side].merge(scores if side else -scores, ids)
    return {side: _signed(best, side) for side, best in merged.items()}


def _signed(best: RunningTopK, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    scores, ids = best.result()
    return (scores if largest else -scores).numpy(), ids.numpy()


def _top_k_task(shard: Shard, job: _TopKJob) -> TopK:
    best = {side: RunningTopK(len(job.prepared), job.k) for side in job.sides}
    for ids, scores in _block_scores(shard, job.space, job.prepared.T.contiguous()):
        for side, running in best.items():
            running.add(scores if side else -scores, ids)
    return {side: _signed(running, side) for side, running in best.items()}


def _block_scores(shard: Shard, space: ScoringSpace, queries_t: torch.Tensor) -> Iterator[tuple]:
    """``(grad_ids [n], scores [q, n])`` of each of the shard's blocks. Methods that search the rows as stored
    score them as stored, upcast tile by tile and scaled by their norms after the product (no float32 copy of the
    block, as the local exact search); the others decode the rows and map them into the method's space."""
    if space.method.query_only:
        for block in shard.stored_blocks():
            ids, rows, norms = unpack_block(block)
            yield (
                torch.from_numpy(ids),
                float32_products(as_tensor(rows, None), queries_t, as_scales(norms, torch.device("cpu"))).T,
            )
        return
    for block in shard.blocks():
        yield torch.from_numpy(block.grad_ids), (space.rows(torch.from_numpy(block.vectors)) @ queries_t).T


# ---------------------------------------------------------------------------------------------- FAISS builds
def faiss_parts(
    engine: Engine, shards: Sequence[Shard], space: ScoringSpace, trained: FaissIndex
) -> list[tuple[FaissIndex, np.ndarray]]:
    """Per shard: a copy of the ``trained`` (empty) index holding the shard's balanced rows
    (:meth:`~gradstore.preconditioning.scoring.ScoringSpace.balanced`), and their ids in the order added; merging them
    in shard order gives the index one process would build."""
    return engine.map(_faiss_task, shards, (space, trained))


def _faiss_task(shard: Shard, job: tuple[ScoringSpace, FaissIndex]) -> tuple[FaissIndex, np.ndarray]:
    space, index = job
    added = [np.empty(0, np.int64)]
    for block in shard.blocks():
        index.add(block.grad_ids, space.balanced(block.vectors).numpy())
        added.append(block.grad_ids)
    return index, np.concatenate(added)


# ---------------------------------------------------------------------------------------------- self-influence
def self_influence(engine: Engine, shards: Sequence[Shard], space: ScoringSpace) -> pa.Table:
    """``(example_id, grad_id, self_influence)`` of every row of the shards, in shard order."""
    parts = [part for part in engine.map(_self_influence_task, shards, space) if part.num_rows]
    if not parts:
        return pa.table(
            {
                "example_id": pa.array([], pa.string()),
                "grad_id": pa.array([], pa.int64()),
                "self_influence": pa.array([], pa.float64()),
            }
        )
    return pa.concat_tables(parts)


def _self_influence_task(shard: Shard, space: ScoringSpace) -> pa.Table:
    parts = [
        pa.table(
            {
                "example_id": block.metadata.column("example_id"),
                "grad_id": pa.array(block.grad_ids, pa.int64()),
                "self_influence": pa.array(space.self_influence(torch.from_numpy(block.vectors)).numpy(), pa.float64()),
            }
        )
        for block in shard.blocks()
    ]
    return pa.concat_tables(parts) if parts else pa.table({})


# ---------------------------------------------------------------------------------------------- per example
class ExampleScores:
    """A dense ``[queries, examples]`` float64 sum keyed by ``example_id`` (for sums over checkpoints).

    A scan task holds one for the examples of its shard's id range only."""

    def __init__(self, n_queries: int) -> None:
        self.n_queries = n_queries
        self.position: dict[str, int] = {}
        self._scores = torch.zeros(n_queries, 0, dtype=torch.float64)

    def add(self, example_ids: Sequence[str], scores: torch.Tensor) -> None:
        """Add ``scores [queries, rows]`` to the rows' examples (several rows of one example add up)."""
        columns = []
        for example_id in example_ids:
            if example_id not in self.position:
                self.position[example_id] = len(self.position)
            columns.append(self.position[example_id])
        if len(self.position) > self._scores.shape[1]:
            grown = torch.zeros(self.n_queries, max(len(self.position), 2 * self._scores.shape[1]), dtype=torch.float64)
            grown[:, : self._scores.shape[1]] = self._scores
            self._scores = grown
        self._scores.index_add_(1, torch.tensor(columns, dtype=torch.long), scores.to(torch.float64))

    @property
    def matrix(self) -> torch.Tensor:
        """The accumulated ``[queries, examples]`` scores (columns in :attr:`example_ids` order)."""
        return self._scores[:, : len(self.position)]

    @property
    def example_ids(self) -> list[str]:
        """Example ids in column order."""
        return list(self.position)


ExampleTopK = dict[bool, tuple[np.ndarray, np.ndarray]]
"""``{largest: (scores float64 [q, k'], example_ids object [q, k'])}``, best first (ties: smaller id)."""


def rank_examples(scores: np.ndarray, example_ids: np.ndarray, k: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ``min(k, n)`` best of ``scores [q, n]`` per query: best score first, ties to the smaller id."""
    width = min(k, scores.shape[1])
    ids = example_ids.astype(str)
    orders = [np.lexsort((ids, -row if largest else row))[:width] for row in scores]
    order = np.array(orders, dtype=np.int64).reshape(len(scores), width)
    return np.take_along_axis(scores, order, 1), example_ids[order]


class RowWeights(Protocol):
    """A weight per row looked up from the rows' ``step`` column (:class:`gradstore.methods.trajectory.StepWeights`)."""

    def of(self, steps: np.ndarray) -> np.ndarray: ...


#: One term of a per-example sum: (row filter, prepared query vectors [q, dim] float64, per-step row weights or
#: ``None`` for weight 1).
SumEntry = tuple[str, torch.Tensor, "RowWeights | None"]


@dataclass
class _TracInJob:
    checkpoints: list[SumEntry]
    space: ScoringSpace
    k: int
    sides: tuple[bool, ...]


def tracin_top_k(
    engine: Engine,
    shards: Sequence[Shard],
    space: ScoringSpace,
    checkpoints: list[SumEntry],
    k: int,
    sides: Sequence[bool] = (True,),
) -> ExampleTopK:
    """Top-k/bottom-k examples of ``sum_c w(row) * queries_c . rows_c(example)`` over shards of disjoint example
    ranges; ``checkpoints`` pairs each row filter (a checkpoint's, or a trajectory's) with its prepared queries
    and, for rows weighted by their step, the weights (shards must then read the ``step`` column)."""
    n_queries = len(checkpoints[0][1])
    job = _TracInJob(checkpoints, space, k, tuple(sides))
    partials = engine.map(_tracin_task, shards, job)
    merged: ExampleTopK = {}
    for side in job.sides:
        scores = np.concatenate([p[side][0] for p in partials], axis=1) if partials else np.empty((n_queries, 0))
        ids = np.concatenate([p[side][1] for p in partials], axis=1) if partials else np.empty((n_queries, 0), object)
        merged[side] = _rank_candidates(scores, ids, k, side)
    return merged


def _rank_candidates(scores: np.ndarray, ids: np.ndarray, k: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the best ``k`` of candidate lists that hold different examples per row."""
    if scores.shape[1] == 0:
        return scores, ids
    ranked = [rank_examples(scores[row][None], ids[row], k, largest) for row in range(len(scores))]
    return np.concatenate([r[0] for r in ranked]), np.concatenate([r[1] for r in ranked])


def _tracin_task(shard: Shard, job: _TracInJob) -> ExampleTopK:
    sums = _example_sums(shard, job.checkpoints, job.space)
    ids = np.asarray(sums.example_ids, dtype=object)
    return {side: rank_examples(sums.matrix.numpy(), ids, job.k, side) for side in job.sides}


#: Bytes of float64 rows one scoring step of a sum holds (a block's rows are scored in slices of this size).
SUM_SLICE_BYTES = 16 << 20


def _example_sums(shard: Shard, entries: Sequence[SumEntry], space: ScoringSpace) -> ExampleScores:
    sums = ExampleScores(len(entries[0][1]))
    for where, queries, weights in entries:
        for block in shard.narrowed(where).blocks():
            vectors = torch.from_numpy(block.vectors)
            step = max(1, SUM_SLICE_BYTES // (8 * max(1, vectors.shape[1])))
            scores = torch.cat([queries @ space.rows(part.to(torch.float64)).T for part in vectors.split(step)], dim=1)
            if weights is not None:
                scores *= torch.from_numpy(weights.of(block.metadata.column("step").to_numpy(zero_copy_only=False)))
            sums.add(block.metadata.column("example_id").to_pylist(), scores)
    return sums


def example_score_matrix(
    engine: Engine, shards: Sequence[Shard], space: ScoringSpace, entries: list[SumEntry]
) -> tuple[np.ndarray, list[str]]:
    """The dense ``[queries, examples]`` per-example sums of ``entries`` (for small problems) and the example ids
    of its columns, over shards of disjoint example ranges."""
    partials = engine.map(_example_matrix_task, shards, (entries, space))
    ids = [example for _, part in partials for example in part]
    matrices = [matrix for matrix, _ in partials]
    return (np.concatenate(matrices, axis=1) if matrices else np.empty((len(entries[0][1]), 0))), ids


def _example_matrix_task(shard: Shard, job: tuple[list[SumEntry], ScoringSpace]) -> tuple[np.ndarray, list[str]]:
    sums = _example_sums(shard, *job)
    return sums.matrix.numpy(), sums.example_ids


def example_aggregates(
    engine: Engine, shards: Sequence[Shard], space: ScoringSpace, entries: list[SumEntry], aggregate: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per example, the ``max`` or ``mean`` over the queries of its per-example sum: ``(example_ids, values)``
    over shards of disjoint example ranges (a task holds its range's ``[queries, examples]`` sums only)."""
    partials = engine.map(_aggregate_task, shards, (entries, space, aggregate))
    ids = np.concatenate([p[0] for p in partials]) if partials else np.empty(0, object)
    values = np.concatenate([p[1] for p in partials]) if partials else np.empty(0)
    return ids, values


def _aggregate_task(shard: Shard, job: tuple[list[SumEntry], ScoringSpace, str]) -> tuple[np.ndarray, np.ndarray]:
    entries, space, aggregate = job
    sums = _example_sums(shard, entries, space)
    if not sums.example_ids:
        return np.empty(0, object), np.empty(0)
    values = sums.matrix.max(dim=0).values if aggregate == "max" else sums.matrix.mean(dim=0)
    return np.asarray(sums.example_ids, dtype=object), values.numpy()


@dataclass
class _SelectJob:
    checkpoints: list[tuple[str, float, ScoringSpace, torch.Tensor]]  # (filter, rate, space, unit whitened queries)
    aggregate: str


def example_totals(
    engine: Engine,
    shards: Sequence[Shard],
    checkpoints: list[tuple[str, float, ScoringSpace, torch.Tensor]],
    aggregate: str,
) -> tuple[np.ndarray, np.ndarray]:
    """LESS scores ``sum_c rate_c * agg_q cos(whitened row, query)`` per example: ``(example_ids, scores)``
    over shards of disjoint example ranges (one value per example)."""
    partials = engine.map(_select_task, shards, _SelectJob(checkpoints, aggregate))
    ids = np.concatenate([p[0] for p in partials]) if partials else np.empty(0, object)
    scores = np.concatenate([p[1] for p in partials]) if partials else np.empty(0)
    return ids, scores


def _select_task(shard: Shard, job: _SelectJob) -> tuple[np.ndarray, np.ndarray]:
    totals = ExampleScores(1)
    for where, rate, space, queries in job.checkpoints:
        for block in shard.narrowed(where).blocks():
            cosines = queries @ unit_rows(space.whitened(torch.from_numpy(block.vectors))).T
            reduced = cosines.max(dim=0).values if job.aggregate == "max" else cosines.mean(dim=0)
            totals.add(block.metadata.column("example_id").to_pylist(), rate * reduced[None])
    return np.asarray(totals.example_ids, dtype=object), totals.matrix[0].numpy()
