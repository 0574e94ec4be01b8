"""Attribution: top-k proponents/opponents of queries, TracIn over checkpoints, dense score matrices and
self-influence, all scored through :class:`~gradstore.scoring.ScoringSpace` with fits from the store's
:class:`~gradstore.fitting.FitCache`.

Every top-k result is a pyarrow Table and is also appended to the store's ``scores`` (or ``self_influence``)
table, so it can be joined with ``examples`` in SQL. Proponents get ranks 1..k (most supportive first);
opponents get ranks -1..-k (most opposing first).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from gradstore.core import StoreCore, sql_literal
from gradstore.core import schema as S
from gradstore.errors import InvalidArgumentError, MissingIdsError
from gradstore.fitting import FitCache, Selection, fit_spec
from gradstore.index import AttributionIndex, build_index
from gradstore.methods import BlockStructure, Method, check_k, resolve_method
from gradstore.queries import Queries, QueryInput, resolve_queries
from gradstore.scoring import ScoringSpace
from indexers import IdentityPreconditioner


def attribute(store: StoreCore, fits: FitCache, queries: QueryInput = None, *, run: str, k: int = 10,
              method: str = "grad-dot", checkpoint: str | None = None, checkpoints: Sequence[str] | None = None,
              damping: float | None = None, blocks: BlockStructure = "auto", kind: str = "exact",
              opponents: bool = False, split: str = "train", where: str | None = None,
              write: bool = True) -> pa.Table:
    """Top-k training rows for each query; see :meth:`gradstore.GradStore.attribute`."""
    check_k(k)
    resolved = resolve_method(method)
    if resolved.over_checkpoints:
        return tracin(store, queries, run=run, k=k, checkpoints=checkpoints, opponents=opponents, split=split,
                      where=where, write=write)
    checkpoint = checkpoint or store.default_checkpoint(run)
    index = build_index(store, fits, Selection(run, checkpoint, split, where), resolved.name, damping=damping,
                        kind=kind, blocks=blocks)
    resolved_queries = resolve_queries(store, queries, run, checkpoint)
    parts = []
    for largest in [True, False] if opponents else [True]:
        scores, grad_ids = index.search(resolved_queries.vectors, k, largest=largest)
        parts.append(_result_table(store, index, resolved_queries.ids, scores, grad_ids, largest))
    table = pa.concat_tables(parts)
    if write:
        store.append_results(S.SCORES, table)
    return table


def _result_table(store: StoreCore, index: AttributionIndex, query_ids: list[str], scores: np.ndarray,
                  grad_ids: np.ndarray, largest: bool) -> pa.Table:
    n_queries, width = scores.shape
    flat_ids = grad_ids.reshape(-1)
    example_of = store.example_ids_for(flat_ids)
    ranks = np.tile(np.arange(1, width + 1, dtype=np.int32), n_queries) * (1 if largest else -1)
    n = len(flat_ids)
    return pa.table({
        "query_id": pa.array(np.repeat(np.asarray(query_ids, dtype=object), width), pa.string()),
        "example_id": pa.array([example_of[g] for g in flat_ids.tolist()], pa.string()),
        "grad_id": pa.array(flat_ids, pa.int64()),
        "score": pa.array(scores.reshape(-1).astype(np.float64)),
        "rank": pa.array(ranks),
        "method": pa.array([index.method.name] * n, pa.string()),
        "run_id": pa.array([index.manifest["run_id"]] * n, pa.string()),
        "checkpoint": pa.array([index.manifest["checkpoint"]] * n, pa.string()),
        "index_name": pa.array([index.name] * n, pa.string()),
    })


# ---------------------------------------------------------------------------------------------- dense scores
@dataclass
class ScoreMatrix:
    """Dense scores of every query against every selected training row."""

    scores: np.ndarray  # float32 [queries, rows]
    query_ids: list[str]
    example_ids: list[str]  # one per row (column)
    grad_ids: np.ndarray  # int64, one per row

    def torch(self) -> torch.Tensor:
        """The scores as a torch tensor (zero-copy)."""
        return torch.from_numpy(self.scores)


def score_matrix(store: StoreCore, fits: FitCache, queries: QueryInput = None, *, run: str, method: str = "fisher",
                 checkpoint: str | None = None, damping: float | None = None, blocks: BlockStructure = "auto",
                 split: str = "train", where: str | None = None) -> ScoreMatrix:
    """Queries x training rows scores (for small problems: it is dense); nothing is written to ``scores``."""
    resolved = resolve_method(method)
    if resolved.over_checkpoints:
        raise InvalidArgumentError("score_matrix scores one checkpoint; TracIn sums over several (use attribute)")
    checkpoint = checkpoint or store.default_checkpoint(run)
    selection = Selection(run, checkpoint, split, where)
    space = ScoringSpace(resolved, fits.get(fit_spec(store, selection, resolved, blocks), damping))
    resolved_queries = resolve_queries(store, queries, run, checkpoint)
    prepared = space.queries(resolved_queries.vectors)
    parts, example_ids, grad_ids = [], [], []
    for block in _selected(store, selection):
        parts.append(space.scores(prepared, torch.from_numpy(block.vectors)))
        example_ids += block.metadata.column("example_id").to_pylist()
        grad_ids.append(block.grad_ids)
    scores = torch.cat(parts, dim=1).numpy() if parts else np.empty((len(resolved_queries.ids), 0), np.float32)
    return ScoreMatrix(scores, resolved_queries.ids, example_ids,
                       np.concatenate(grad_ids) if grad_ids else np.empty(0, np.int64))


def _selected(store: StoreCore, selection: Selection):
    return store.iter_gradients(selection.run, checkpoint=selection.checkpoint, split=selection.split,
                                where=selection.where, columns=("example_id",))


# ---------------------------------------------------------------------------------------------- TracIn
def learning_rates(store: StoreCore, run: str, checkpoints: Sequence[str] | None) -> dict[str, float]:
    """``checkpoint -> learning rate`` of a run. By default: every recorded checkpoint that has a learning
    rate and query rows (checkpoint passes), in step order."""
    store.run(run)
    table = store.checkpoints(run)
    recorded = dict(zip(table.column("checkpoint").to_pylist(), table.column("learning_rate").to_pylist()))
    if checkpoints is None:
        with_queries = set(store.sql(f"select distinct checkpoint from gradients where run_id = {sql_literal(run)} "
                                     "and split = 'query'").df().checkpoint)
        wanted = [c for c, lr in recorded.items() if lr is not None and c in with_queries]
    else:
        wanted = list(checkpoints)
    if not wanted:
        raise InvalidArgumentError(f"run {run!r} records no checkpoint with a learning rate and query rows: "
                                   "capture checkpoint passes with learning_rate=... (or give checkpoints=)")
    missing = [c for c in wanted if recorded.get(c) is None]
    if missing:
        raise InvalidArgumentError(f"checkpoints {missing} of run {run!r} have no recorded learning rate")
    return {c: float(recorded[c]) for c in wanted}


class ExampleScores:
    """A dense ``[queries, examples]`` score accumulator keyed by ``example_id`` (for sums over checkpoints)."""

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
            grown = torch.zeros(self.n_queries, max(len(self.position), 2 * self._scores.shape[1]),
                                dtype=torch.float64)
            grown[:, :self._scores.shape[1]] = self._scores
            self._scores = grown
        self._scores.index_add_(1, torch.tensor(columns, dtype=torch.long), scores.to(torch.float64))

    @property
    def matrix(self) -> torch.Tensor:
        """The accumulated ``[queries, examples]`` scores (columns in :attr:`example_ids` order)."""
        return self._scores[:, :len(self.position)]

    @property
    def example_ids(self) -> list[str]:
        """Example ids in column order."""
        return list(self.position)


def checkpoint_queries(store: StoreCore, queries: QueryInput, run: str, checkpoints: Sequence[str]
                       ) -> Iterator[tuple[str, Queries]]:
    """The queries resolved at each checkpoint, in the order of the first checkpoint's ids."""
    first: list[str] | None = None
    for checkpoint in checkpoints:
        resolved = resolve_queries(store, queries, run, checkpoint)
        if first is None:
            first = resolved.ids
        elif resolved.ids != first:
            position = {q: i for i, q in enumerate(resolved.ids)}
            missing = [q for q in first if q not in position]
            if missing:
                raise MissingIdsError(f"queries {missing[:5]} have no rows at checkpoint {checkpoint!r}")
            resolved = Queries(first, resolved.vectors[[position[q] for q in first]])
        yield checkpoint, resolved


def tracin(store: StoreCore, queries: QueryInput = None, *, run: str, k: int = 10,
           checkpoints: Sequence[str] | None = None, opponents: bool = False, split: str = "train",
           where: str | None = None, write: bool = True) -> pa.Table:
    """TracIn-CP: ``score(q, x) = sum_c lr_c * q_c . g_c(x)``, a learning-rate weighted sum of per-checkpoint
    grad-dot scores, summed exactly per example before ranking (not a merge of per-checkpoint top-k lists).
    Queries must be stored query rows captured at every checkpoint (ids, a filter, or ``None`` for all)."""
    check_k(k)
    rates = learning_rates(store, run, checkpoints)
    space = ScoringSpace(resolve_method("grad-dot"), IdentityPreconditioner())
    accumulator: ExampleScores | None = None
    query_ids: list[str] = []
    progress = tqdm(checkpoint_queries(store, queries, run, list(rates)), total=len(rates),
                    desc="tracin checkpoints", disable=len(rates) < 4)
    for checkpoint, resolved in progress:
        query_ids = resolved.ids
        accumulator = accumulator or ExampleScores(len(query_ids))
        prepared = space.queries(resolved.vectors).to(torch.float64) * rates[checkpoint]
        for block in _selected(store, Selection(run, checkpoint, split, where)):
            rows = torch.from_numpy(block.vectors).to(torch.float64)
            accumulator.add(block.metadata.column("example_id").to_pylist(), prepared @ space.rows(rows).T)
    table = ranked_examples(accumulator, query_ids, k, opponents, method=resolve_method("tracin"), run=run,
                            checkpoint=",".join(rates))
    if write:
        store.append_results(S.SCORES, table)
    return table


def ranked_examples(accumulator: ExampleScores, query_ids: list[str], k: int, opponents: bool, *, method: Method,
                    run: str, checkpoint: str) -> pa.Table:
    """The top-k (and bottom-k) examples per query of an accumulator as a ``scores`` table (ties by id)."""
    matrix, example_ids = accumulator.matrix, np.asarray(accumulator.example_ids, dtype=object)
    width = min(k, matrix.shape[1])
    columns: dict[str, list] = {name: [] for name in ("query_id", "example_id", "score", "rank")}
    for largest in [True, False] if opponents else [True]:
        for row, query_id in enumerate(query_ids):
            scores = matrix[row].numpy()
            order = np.lexsort((example_ids.astype(str), -scores if largest else scores))[:width]
            columns["query_id"] += [query_id] * width
            columns["example_id"] += example_ids[order].tolist()
            columns["score"] += scores[order].tolist()
            columns["rank"] += [(r + 1) * (1 if largest else -1) for r in range(width)]
    n = len(columns["rank"])
    return pa.table({"query_id": pa.array(columns["query_id"], pa.string()),
                     "example_id": pa.array(columns["example_id"], pa.string()),
                     "grad_id": pa.nulls(n, pa.int64()),
                     "score": pa.array(columns["score"], pa.float64()),
                     "rank": pa.array(columns["rank"], pa.int32()),
                     "method": pa.array([method.name] * n, pa.string()), "run_id": pa.array([run] * n, pa.string()),
                     "checkpoint": pa.array([checkpoint] * n, pa.string()),
                     "index_name": pa.nulls(n, pa.string())})


# ---------------------------------------------------------------------------------------------- self-influence
def self_influence(store: StoreCore, fits: FitCache, *, run: str, method: str = "fisher",
                   checkpoint: str | None = None, damping: float | None = None, blocks: BlockStructure = "auto",
                   split: str = "train", where: str | None = None, write: bool = True) -> pa.Table:
    """``g^T P^-1 g`` for every selected training row; see :meth:`gradstore.GradStore.self_influence`."""
    resolved = resolve_method(method)
    if resolved.name == "cosine" or resolved.unit_norm or resolved.over_checkpoints:
        raise InvalidArgumentError(f"self-influence under {resolved.name!r} is not informative; use grad-dot, "
                                   "diagonal, fisher, kfac or ekfac")
    checkpoint = checkpoint or store.default_checkpoint(run)
    selection = Selection(run, checkpoint, split, where)
    space = ScoringSpace(resolved, fits.get(fit_spec(store, selection, resolved, blocks), damping))
    parts = []
    for block in _selected(store, selection):
        values = space.self_influence(torch.from_numpy(block.vectors)).numpy()
        n = len(block)
        parts.append(pa.table({"example_id": block.metadata.column("example_id"),
                               "grad_id": pa.array(block.grad_ids, pa.int64()),
                               "run_id": pa.array([run] * n, pa.string()),
                               "checkpoint": pa.array([checkpoint] * n, pa.string()),
                               "method": pa.array([resolved.name] * n, pa.string()),
                               "self_influence": pa.array(values, pa.float64())}))
    table = pa.concat_tables(parts).sort_by([("self_influence", "descending")])
    if write:
        store.append_results(S.SELF_INFLUENCE, table)
    return table
