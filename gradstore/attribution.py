"""Attribution: top-k proponents/opponents of queries, TracIn over checkpoints, self-influence.

Every result is a pyarrow Table and is also appended to the store's ``scores`` (or ``self_influence``)
table, so it can be joined with ``examples`` in SQL. Proponents get ranks 1..k (most supportive first);
opponents get ranks -1..-k (most opposing first).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from gradstore import schema as S
from gradstore.index import AttributionIndex, Selection, build_index, make_method_preconditioner
from gradstore.methods import DEFAULT_DAMPING, resolve_method
from gradstore.queries import resolve_queries
from gradstore.store import sql_literal

if TYPE_CHECKING:
    from gradstore.store import GradStore


def default_checkpoint(store: GradStore, run: str) -> str:
    """The run's latest recorded checkpoint (by step, then recording time), or ``"train"`` when none is."""
    store.run(run)  # UnknownRunError for a run the store does not hold
    checkpoints = store.checkpoints(run).sort_by([("step", "ascending"), ("created_at", "ascending")])
    if checkpoints.num_rows == 0:
        return "train"
    return checkpoints.column("checkpoint")[checkpoints.num_rows - 1].as_py()


def attribute(store: GradStore, queries: Any = None, *, run: str, k: int = 10, method: str = "grad-dot",
              checkpoint: str | None = None, checkpoints: Sequence[str] | None = None,
              damping: float | None = None, kind: str = "exact", opponents: bool = False,
              split: str = "train", where: str | None = None, write: bool = True) -> pa.Table:
    """Top-k training rows for each query (see :func:`gradstore.queries.resolve_queries` for ``queries``).

    ``method``: ``grad-dot``, ``cosine``, ``diagonal``, ``fisher``/``influence``, ``kfac`` or ``tracin``
    (which sums over ``checkpoints``, default all recorded). ``opponents=True`` adds the bottom-k.
    Returns ``(query_id, example_id, grad_id, score, rank, method, run_id, checkpoint, index_name)``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    resolved = resolve_method(method)
    if resolved.name == "tracin":
        return tracin(store, queries, run=run, k=k, checkpoints=checkpoints, opponents=opponents, split=split,
                      where=where, write=write)
    checkpoint = checkpoint or default_checkpoint(store, run)
    index = build_index(store, Selection(run, checkpoint, split, where), resolved.name, damping=damping, kind=kind)
    resolved_queries = resolve_queries(store, queries, run, checkpoint)
    directions = [True, False] if opponents else [True]
    parts = []
    for largest in directions:
        scores, grad_ids = index.search(resolved_queries.vectors, k, largest=largest)
        parts.append(_result_table(store, index, resolved_queries.ids, scores, grad_ids, largest))
    table = pa.concat_tables(parts)
    if write:
        _append(store, S.SCORES, table, S.SCORES_SCHEMA)
    return table


def _result_table(store: GradStore, index: AttributionIndex, query_ids: list[str], scores: np.ndarray,
                  grad_ids: np.ndarray, largest: bool) -> pa.Table:
    n_queries, width = scores.shape
    flat_ids = grad_ids.reshape(-1)
    example_of = example_ids_for(store, flat_ids)
    ranks = np.tile(np.arange(1, width + 1, dtype=np.int32), n_queries) * (1 if largest else -1)
    return pa.table({
        "query_id": pa.array(np.repeat(np.asarray(query_ids, dtype=object), width), pa.string()),
        "example_id": pa.array([example_of[g] for g in flat_ids.tolist()], pa.string()),
        "grad_id": pa.array(flat_ids, pa.int64()),
        "score": pa.array(scores.reshape(-1).astype(np.float64)),
        "rank": pa.array(ranks),
        "method": pa.array([index.method.name] * len(flat_ids), pa.string()),
        "run_id": pa.array([index.manifest["run_id"]] * len(flat_ids), pa.string()),
        "checkpoint": pa.array([index.manifest["checkpoint"]] * len(flat_ids), pa.string()),
        "index_name": pa.array([index.name] * len(flat_ids), pa.string()),
    })


def example_ids_for(store: GradStore, grad_ids: np.ndarray) -> dict[int, str]:
    """``grad_id -> example_id`` for the given ids (one filtered scan of two int/string columns)."""
    unique = np.unique(grad_ids)
    if len(unique) == 0:
        return {}
    table = store.table(S.GRADIENTS).to_lance().to_table(
        columns=["grad_id", "example_id"], filter=f"grad_id IN ({', '.join(str(int(g)) for g in unique)})")
    return dict(zip(table.column("grad_id").to_pylist(), table.column("example_id").to_pylist()))


def _append(store: GradStore, name: str, table: pa.Table, schema: pa.Schema) -> None:
    now = pa.array([datetime.now(timezone.utc)] * table.num_rows, schema.field("created_at").type)
    store.table(name).add(table.append_column(schema.field("created_at"), now).select(schema.names).cast(schema))


# ---------------------------------------------------------------------------------------------- TracIn
def learning_rates(store: GradStore, run: str, checkpoints: Sequence[str] | None) -> dict[str, float]:
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
        raise ValueError(f"run {run!r} records no checkpoint with a learning rate and query rows: capture "
                         "checkpoint passes with learning_rate=... (or give checkpoints=)")
    missing = [c for c in wanted if recorded.get(c) is None]
    if missing:
        raise ValueError(f"checkpoints {missing} of run {run!r} have no recorded learning rate")
    return {c: float(recorded[c]) for c in wanted}


class ExampleScores:
    """A dense ``[queries, examples]`` score accumulator keyed by ``example_id`` (for sums over checkpoints)."""

    def __init__(self, n_queries: int) -> None:
        self.n_queries = n_queries
        self.position: dict[str, int] = {}
        self._chunks: list[torch.Tensor] = []
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


def _selection_blocks(store: GradStore, selection: Selection) -> Iterator[tuple[list[str], torch.Tensor]]:
    for block in store.iter_gradients(selection.run, checkpoint=selection.checkpoint, split=selection.split,
                                      where=selection.where, columns=("example_id",)):
        yield block.metadata.column("example_id").to_pylist(), torch.from_numpy(block.vectors)


def tracin(store: GradStore, queries: Any = None, *, run: str, k: int = 10, checkpoints: Sequence[str] | None = None,
           opponents: bool = False, split: str = "train", where: str | None = None, write: bool = True) -> pa.Table:
    """TracIn-CP: ``score(q, x) = sum_c lr_c * q_c . g_c(x)`` over checkpoints, summed exactly per example
    before ranking (not a merge of per-checkpoint top-k lists). Queries must be stored query rows captured at
    every checkpoint (ids, a filter, or ``None`` for all)."""
    rates = learning_rates(store, run, checkpoints)
    first = None
    accumulator: ExampleScores | None = None
    for checkpoint, rate in tqdm(rates.items(), desc="tracin checkpoints", disable=len(rates) < 4):
        resolved = resolve_queries(store, queries if queries is not None else None, run, checkpoint)
        if first is None:
            first, accumulator = resolved.ids, ExampleScores(len(resolved.ids))
        elif resolved.ids != first:
            position = {q: i for i, q in enumerate(resolved.ids)}
            missing = [q for q in first if q not in position]
            if missing:
                raise KeyError(f"queries {missing[:5]} have no rows at checkpoint {checkpoint!r}")
            resolved.vectors = resolved.vectors[[position[q] for q in first]]
        q = torch.from_numpy(resolved.vectors).to(torch.float64) * rate
        for example_ids, vectors in _selection_blocks(store, Selection(run, checkpoint, split, where)):
            accumulator.add(example_ids, q @ vectors.to(torch.float64).T)
    table = _ranked_examples(accumulator, first, k, opponents, method="tracin", run=run,
                             checkpoint=",".join(rates))
    if write:
        _append(store, S.SCORES, table, S.SCORES_SCHEMA)
    return table


def _ranked_examples(accumulator: ExampleScores, query_ids: list[str], k: int, opponents: bool, *, method: str,
                     run: str, checkpoint: str) -> pa.Table:
    matrix, example_ids = accumulator.matrix, np.asarray(accumulator.example_ids, dtype=object)
    width = min(k, matrix.shape[1])
    columns: dict[str, list] = {name: [] for name in ("query_id", "example_id", "score", "rank")}
    for largest in ([True, False] if opponents else [True]):
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
                     "method": pa.array([method] * n, pa.string()), "run_id": pa.array([run] * n, pa.string()),
                     "checkpoint": pa.array([checkpoint] * n, pa.string()),
                     "index_name": pa.nulls(n, pa.string())})


# ---------------------------------------------------------------------------------------------- self-influence
def self_influence(store: GradStore, *, run: str, method: str = "fisher", checkpoint: str | None = None,
                   damping: float | None = None, split: str = "train", where: str | None = None,
                   write: bool = True) -> pa.Table:
    """``g^T P^-1 g`` for every selected training row (large values: outliers, likely mislabels).

    Returns ``(example_id, grad_id, run_id, checkpoint, method, self_influence)``, also appended to the
    ``self_influence`` table."""
    resolved = resolve_method(method)
    if resolved.name in ("cosine", "tracin"):
        raise ValueError(f"self-influence under {resolved.name!r} is not informative; use grad-dot, diagonal, "
                         "fisher or kfac")
    checkpoint = checkpoint or default_checkpoint(store, run)
    selection = Selection(run, checkpoint, split, where)
    preconditioner = make_method_preconditioner(store, selection, resolved, DEFAULT_DAMPING if damping is None
                                                else damping)
    preconditioner.fit(vectors for _, vectors in selection.blocks(store)())
    parts = []
    for block in store.iter_gradients(run, checkpoint=checkpoint, split=split, where=where, columns=("example_id",)):
        whitened = preconditioner.apply_both(torch.from_numpy(block.vectors).to(torch.float64))
        values = (whitened * whitened).sum(dim=1).numpy()
        n = len(block)
        parts.append(pa.table({"example_id": block.metadata.column("example_id"),
                               "grad_id": pa.array(block.grad_ids, pa.int64()),
                               "run_id": pa.array([run] * n, pa.string()),
                               "checkpoint": pa.array([checkpoint] * n, pa.string()),
                               "method": pa.array([resolved.name] * n, pa.string()),
                               "self_influence": pa.array(values, pa.float64())}))
    table = pa.concat_tables(parts).sort_by([("self_influence", "descending")])
    if write:
        _append(store, S.SELF_INFLUENCE, table, S.SELF_INFLUENCE_SCHEMA)
    return table
