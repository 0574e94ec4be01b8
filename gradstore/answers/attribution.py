"""Attribution: top-k proponents/opponents of queries, TracIn over checkpoints, dense score matrices and
self-influence, all scored through :class:`~gradstore.methods.scoring.ScoringSpace` with fits from the store's
:class:`~gradstore.methods.fitting.FitCache`. Top-k, TracIn and self-influence run as scans on an engine
(:mod:`gradstore.search.scan_tasks`: in this process by default, or on Ray), never holding a queries x rows matrix.

Every top-k result is a pyarrow Table and is also appended to the store's ``scores`` (or ``self_influence``)
table, so it can be joined with ``examples`` in SQL. Proponents get ranks 1..k (most supportive first);
opponents get ranks -1..-k (most opposing first).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from gradstore.core import StoreCore, one_snapshot, sql_in, sql_literal
from gradstore.core import schema as S
from gradstore.core.engine import Engine, EngineName, resolve_engine
from gradstore.core.shards import Shard, example_shards
from gradstore.errors import InvalidArgumentError, MissingIdsError
from gradstore.methods import Method, ScoreOptions, check_k, dvemb, resolve_method, trajectory
from gradstore.methods.fitting import FitCache, Selection
from gradstore.methods.queries import Queries, QueryInput, resolve_queries
from gradstore.methods.rows import check_where, require_rows
from gradstore.methods.scoring import ScoringSpace
from gradstore.search import scan_tasks
from gradstore.search.index import AttributionIndex, build_index, valid_entries
from indexers import IdentityPreconditioner

#: Examples a TracIn or selection task sums at most (about; ranges come from a sample of the ids): bounds
#: a task's dense ``[queries, examples]`` float64 sum (64 queries: 32 MB).
EXAMPLES_PER_TASK = 65536
#: Examples whose trajectory self-influence one dense ``[chunk, chunk]`` score matrix computes (32 MB float64).
SELF_INFLUENCE_CHUNK = 2048


@one_snapshot
def attribute(
    store: StoreCore,
    fits: FitCache,
    queries: QueryInput,
    options: ScoreOptions,
    *,
    run: str,
    k: int = 10,
    opponents: bool = False,
    write: bool = True,
    engine: EngineName | Engine = "local",
) -> pa.Table:
    """Top-k training rows for each query; see :meth:`gradstore.GradStore.attribute`."""
    check_k(k)
    if write:
        store.require_writable("attribute with write=True")
    resolved = options.check("attribute")
    engine = resolve_engine(engine)
    if resolved.trajectory in ("steps", "segments"):
        return _history_top_k(
            store, fits, queries, options, run=run, k=k, opponents=opponents, engine=engine, write=write
        )
    if resolved.over_checkpoints:
        return tracin(
            store,
            queries,
            run=run,
            k=k,
            checkpoints=options.checkpoints,
            opponents=opponents,
            split=options.split,
            where=options.where,
            write=write,
            engine=engine,
        )
    resolved_queries, selection, searched = _searched(store, queries, options, resolved, run)
    index = build_index(
        store,
        fits,
        selection,
        searched.name,
        damping=options.damping,
        kind=options.kind,
        blocks=options.blocks if searched is resolved else "auto",
        engine=engine,
        device=options.device,
    )
    sides = (True, False) if opponents else (True,)
    found = index.search_sides(resolved_queries.vectors, k, sides, engine, options.rerank)
    table = pa.concat_tables(
        [_result_table(index, resolved_queries.ids, *found[side], side, resolved, run) for side in sides]
    )
    if write:
        store.append_results(S.SCORES, table)
    return table


def _searched(
    store: StoreCore, queries: QueryInput, options: ScoreOptions, method: Method, run: str
) -> tuple[Queries, Selection, Method]:
    """The resolved queries, the rows searched and the method they are searched with: one checkpoint's training
    rows by ``method``, or for ``dvemb`` the derived run's embeddings by grad-dot with final-model queries
    (:mod:`gradstore.methods.dvemb`, built or extended first)."""
    if method.trajectory == "embeddings":
        checkpoint = trajectory.final_query_checkpoint(store, run, options.query_checkpoint)
        resolved_queries = resolve_queries(store, queries, run, checkpoint)
        return resolved_queries, dvemb.ensure(store, run, options), resolve_method("grad-dot")
    checkpoint = options.checkpoint or store.default_checkpoint(run)
    selection = Selection(run, checkpoint, options.split, options.where)
    require_rows(store, selection)
    resolved_queries = resolve_queries(store, queries, run, checkpoint, options.query_checkpoint)  # dims: fail fast
    return resolved_queries, selection, method


def _result_table(
    index: AttributionIndex,
    query_ids: list[str],
    scores: np.ndarray,
    grad_ids: np.ndarray,
    largest: bool,
    method: Method,
    run: str,
) -> pa.Table:
    positions, ranks, flat_scores, flat_ids = valid_entries(scores, grad_ids)  # FAISS padding dropped
    n = len(flat_ids)
    return pa.table(
        {
            "query_id": pa.array(np.asarray(query_ids, dtype=object)[positions], pa.string()),
            "example_id": index.example_ids(flat_ids),
            "grad_id": pa.array(flat_ids, pa.int64()),
            "score": pa.array(flat_scores.astype(np.float64)),
            "rank": pa.array(ranks * (1 if largest else -1)),
            "method": pa.array([method.name] * n, pa.string()),
            "run_id": pa.array([run] * n, pa.string()),
            "checkpoint": pa.array([index.manifest["checkpoint"]] * n, pa.string()),
            "index_name": pa.array([index.name] * n, pa.string()),
        }
    )


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


@one_snapshot
def score_matrix(
    store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
) -> ScoreMatrix:
    """Queries x training rows scores (for small problems: it is dense); nothing is written to ``scores``."""
    resolved = options.check("score_matrix")
    if resolved.trajectory in ("steps", "segments"):
        return _history_matrix(store, fits, queries, options, run=run)
    resolved_queries, selection, searched = _searched(store, queries, options, resolved, run)
    space = fits.space(selection, searched, options.blocks if searched is resolved else "auto", options.damping)
    prepared = space.queries(resolved_queries.vectors)
    parts, example_ids, grad_ids = [], [], []
    for block in _selected(store, selection):
        parts.append(space.scores(prepared, torch.from_numpy(block.vectors)))
        example_ids += block.metadata.column("example_id").to_pylist()
        grad_ids.append(block.grad_ids)
    scores = torch.cat(parts, dim=1).numpy() if parts else np.empty((len(resolved_queries.ids), 0), np.float32)
    return ScoreMatrix(
        scores, resolved_queries.ids, example_ids, np.concatenate(grad_ids) if grad_ids else np.empty(0, np.int64)
    )


def _selected(store: StoreCore, selection: Selection):
    return store.iter_gradients(
        selection.run,
        checkpoint=selection.checkpoint,
        split=selection.split,
        where=selection.where,
        columns=("example_id",),
    )


# ---------------------------------------------------------------------------------------------- history
def history_for(
    store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, run: str
) -> trajectory.History:
    """A trajectory method's scores as a per-example sum over stored history (``tracin-steps``, ``source``:
    :mod:`gradstore.methods.trajectory`; ``dvemb``: its derived run, :mod:`gradstore.methods.dvemb`)."""
    if resolve_method(options.method).trajectory == "embeddings":
        return dvemb.history(store, queries, options, run)
    return trajectory.history(store, fits, queries, options, run)


def _history_top_k(
    store: StoreCore,
    fits: FitCache,
    queries: QueryInput,
    options: ScoreOptions,
    *,
    run: str,
    k: int,
    opponents: bool,
    engine: Engine,
    write: bool,
) -> pa.Table:
    """Top-k examples of a trajectory method summed over rows (``tracin-steps``, ``source``)."""
    check_where(store, run, options.where)
    summed = history_for(store, fits, queries, options, run)
    sides = (True, False) if opponents else (True,)
    shards = per_example_shards(store, engine, [summed.selection], summed.columns)
    space = ScoringSpace(resolve_method("grad-dot"), IdentityPreconditioner())
    found = scan_tasks.tracin_top_k(engine, shards, space, summed.entries, k, sides)
    method = resolve_method(options.method)
    table = _example_table(
        found, summed.query_ids, sides, method=method, run=run, checkpoint=",".join(summed.checkpoints)
    )
    if write:
        store.append_results(S.SCORES, table)
    return table


def _history_matrix(
    store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
) -> ScoreMatrix:
    """The dense per-example scores of a trajectory method (columns: examples; ``grad_ids`` -1: sums of rows)."""
    check_where(store, run, options.where)
    summed = history_for(store, fits, queries, options, run)
    engine = resolve_engine("local")
    shards = per_example_shards(store, engine, [summed.selection], summed.columns)
    space = ScoringSpace(resolve_method("grad-dot"), IdentityPreconditioner())
    scores, example_ids = scan_tasks.example_score_matrix(engine, shards, space, summed.entries)
    order = np.argsort(np.asarray(example_ids, dtype=str), kind="stable")
    return ScoreMatrix(
        scores[:, order].astype(np.float32),
        summed.query_ids,
        [example_ids[i] for i in order],
        np.full(len(order), -1, np.int64),
    )


# ---------------------------------------------------------------------------------------------- TracIn
def learning_rates(store: StoreCore, run: str, checkpoints: Sequence[str] | None) -> dict[str, float]:
    """``checkpoint -> learning rate`` of a run. By default: every recorded checkpoint that has a learning
    rate and query rows (checkpoint passes), in step order."""
    store.run(run)
    table = store.checkpoints(run)
    recorded = dict(zip(table.column("checkpoint").to_pylist(), table.column("learning_rate").to_pylist()))
    if checkpoints is None:
        with_queries = set(
            store.sql(
                f"select distinct checkpoint from gradients where run_id = {sql_literal(run)} and split = 'query'"
            )
            .df()
            .checkpoint
        )
        wanted = [c for c, lr in recorded.items() if lr is not None and c in with_queries]
    else:
        wanted = list(checkpoints)
    if not wanted:
        raise InvalidArgumentError(
            f"run {run!r} records no checkpoint with a learning rate and query rows: "
            "capture checkpoint passes with learning_rate=... (or give checkpoints=)"
        )
    missing = [c for c in wanted if recorded.get(c) is None]
    if missing:
        raise InvalidArgumentError(f"checkpoints {missing} of run {run!r} have no recorded learning rate")
    return {c: float(recorded[c]) for c in wanted}


def checkpoint_queries(
    store: StoreCore, queries: QueryInput, run: str, checkpoints: Sequence[str]
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


@one_snapshot
def tracin(
    store: StoreCore,
    queries: QueryInput = None,
    *,
    run: str,
    k: int = 10,
    checkpoints: Sequence[str] | None = None,
    opponents: bool = False,
    split: str = "train",
    where: str | None = None,
    write: bool = True,
    engine: EngineName | Engine = "local",
) -> pa.Table:
    """TracIn-CP: ``score(q, x) = sum_c lr_c * q_c . g_c(x)``, a learning-rate weighted sum of per-checkpoint
    grad-dot scores, summed exactly per example before ranking (not a merge of per-checkpoint top-k lists).
    Queries must be stored query rows captured at every checkpoint (ids, a filter, or ``None`` for all).

    Streaming: the training rows are split into ``example_id`` ranges (:func:`gradstore.core.shards.example_shards`)
    so that every row of an example, at every checkpoint, is summed by one task; each task ranks its
    examples and the top-k lists are merged (ties: the smaller example id)."""
    check_k(k)
    check_where(store, run, where)
    engine = resolve_engine(engine)
    rates = learning_rates(store, run, checkpoints)
    space = ScoringSpace(resolve_method("grad-dot"), IdentityPreconditioner())
    weighted: list[tuple[str, torch.Tensor]] = []
    query_ids: list[str] = []
    progress = tqdm(
        checkpoint_queries(store, queries, run, list(rates)),
        total=len(rates),
        desc="tracin checkpoints",
        disable=len(rates) < 4,
    )
    for checkpoint, resolved in progress:
        query_ids = resolved.ids
        prepared = space.queries(resolved.vectors).to(torch.float64) * rates[checkpoint]
        weighted.append((Selection(run, checkpoint, split, where).filter, prepared, None))
    sides = (True, False) if opponents else (True,)
    shards = per_example_shards(store, engine, [Selection(run, c, split, where) for c in rates])
    found = scan_tasks.tracin_top_k(engine, shards, space, weighted, k, sides)
    table = _example_table(
        found, query_ids, sides, method=resolve_method("tracin"), run=run, checkpoint=",".join(rates)
    )
    if write:
        store.append_results(S.SCORES, table)
    return table


def per_example_shards(
    store: StoreCore, engine: Engine, selections: Sequence[Selection], columns: tuple[str, ...] = ("example_id",)
) -> list[Shard]:
    """Shards of disjoint ``example_id`` ranges over every row of the store (tasks narrow them to each of
    ``selections``): ``engine.parallelism`` of them, more when the first selection has more than
    :data:`EXAMPLES_PER_TASK` rows per shard."""
    first = selections[0]
    parts = max(engine.parallelism, math.ceil(first.count(store) / EXAMPLES_PER_TASK))
    return example_shards(store, first.run, None, first.filter, parts, columns=columns)


def _example_table(
    found: scan_tasks.ExampleTopK,
    query_ids: list[str],
    sides: tuple[bool, ...],
    *,
    method: Method,
    run: str,
    checkpoint: str,
) -> pa.Table:
    """The per-example top-k (and bottom-k) lists as a ``scores`` table (no ``grad_id``: sums over rows)."""
    columns: dict[str, list] = {name: [] for name in ("query_id", "example_id", "score", "rank")}
    for side in sides:
        scores, example_ids = found[side]
        width = scores.shape[1]
        for row, query_id in enumerate(query_ids):
            columns["query_id"] += [query_id] * width
            columns["example_id"] += example_ids[row].tolist()
            columns["score"] += scores[row].tolist()
            columns["rank"] += [(r + 1) * (1 if side else -1) for r in range(width)]
    n = len(columns["rank"])
    return pa.table(
        {
            "query_id": pa.array(columns["query_id"], pa.string()),
            "example_id": pa.array(columns["example_id"], pa.string()),
            "grad_id": pa.nulls(n, pa.int64()),
            "score": pa.array(columns["score"], pa.float64()),
            "rank": pa.array(columns["rank"], pa.int32()),
            "method": pa.array([method.name] * n, pa.string()),
            "run_id": pa.array([run] * n, pa.string()),
            "checkpoint": pa.array([checkpoint] * n, pa.string()),
            "index_name": pa.nulls(n, pa.string()),
        }
    )


# ---------------------------------------------------------------------------------------------- self-influence
def self_influence(
    store: StoreCore,
    fits: FitCache,
    options: ScoreOptions,
    *,
    run: str,
    write: bool = True,
    engine: EngineName | Engine = "local",
) -> pa.Table:
    """``g^T P^-1 g`` for every selected training row; see :meth:`gradstore.GradStore.self_influence`."""
    if write:
        store.require_writable("self_influence with write=True")
    resolved = options.check("self_influence")  # cosine-like methods: 1 for every row, not informative
    engine = resolve_engine(engine)
    if resolved.trajectory:
        table = _history_self_influence(store, fits, options, run=run, engine=engine)
        if write:
            store.append_results(S.SELF_INFLUENCE, table)
        return table
    checkpoint = options.checkpoint or store.default_checkpoint(run)
    selection = Selection(run, checkpoint, options.split, options.where)
    require_rows(store, selection)
    space = fits.space(selection, resolved, options.blocks, options.damping, engine)
    values = scan_tasks.self_influence(engine, selection.shards(store, engine.parallelism, ("example_id",)), space)
    n = values.num_rows
    table = pa.table(
        {
            "example_id": values.column("example_id"),
            "grad_id": values.column("grad_id"),
            "run_id": pa.array([run] * n, pa.string()),
            "checkpoint": pa.array([checkpoint] * n, pa.string()),
            "method": pa.array([resolved.name] * n, pa.string()),
            "self_influence": values.column("self_influence"),
        }
    )
    table = table.sort_by([("self_influence", "descending")])
    if write:
        store.append_results(S.SELF_INFLUENCE, table)
    return table


def _history_self_influence(
    store: StoreCore, fits: FitCache, options: ScoreOptions, *, run: str, engine: Engine
) -> pa.Table:
    """A trajectory method's self-influence: the first-order effect of up-weighting each example on its own final
    loss, ``score(g_z(final), z)`` with ``g_z(final)`` its row at the last checkpoint pass; computed for chunks of
    :data:`SELF_INFLUENCE_CHUNK` examples at a time (the diagonal of each chunk's dense score matrix)."""
    check_where(store, run, options.where)
    final = trajectory.final_training_checkpoint(store, run, options.split)
    space = ScoringSpace(resolve_method("grad-dot"), IdentityPreconditioner())
    example_ids: list[str] = []
    values: list[float] = []
    blocks = store.iter_gradients(
        run, checkpoint=final, split=options.split, where=options.where, block_rows=SELF_INFLUENCE_CHUNK
    )
    checkpoints: list[str] = []
    for block in blocks:
        ids = block.metadata.column("example_id").to_pylist()
        chunk = sql_in("example_id", ids)
        narrowed = replace(options, where=chunk if options.where is None else f"({options.where}) AND {chunk}")
        summed = history_for(store, fits, block.vectors, narrowed, run)
        shards = per_example_shards(store, engine, [summed.selection], summed.columns)
        scores, scored_ids = scan_tasks.example_score_matrix(engine, shards, space, summed.entries)
        column = {example: i for i, example in enumerate(scored_ids)}
        example_ids += ids
        values += [float(scores[row, column[e]]) if e in column else 0.0 for row, e in enumerate(ids)]
        checkpoints = summed.checkpoints
    n = len(example_ids)
    table = pa.table(
        {
            "example_id": pa.array(example_ids, pa.string()),
            "grad_id": pa.nulls(n, pa.int64()),
            "run_id": pa.array([run] * n, pa.string()),
            "checkpoint": pa.array([",".join(checkpoints)] * n, pa.string()),
            "method": pa.array([resolve_method(options.method).name] * n, pa.string()),
            "self_influence": pa.array(values, pa.float64()),
        }
    )
    return table.sort_by([("self_influence", "descending")])
