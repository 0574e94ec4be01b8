"""Scores summed per example over its rows: the shards, the checkpoint weights and the scans shared by TracIn over
checkpoints (:mod:`gradstore.methods.checkpoint_sum`), learning-rate weighted selection
(:mod:`gradstore.methods.preconditioned`) and the trajectory methods' sums over history
(:mod:`gradstore.methods.trajectory`, :mod:`gradstore.methods.dvemb`). Every scan runs on an engine
(:mod:`gradstore.search.scan_tasks`), never holding a queries x rows matrix beyond a task's share."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
import pyarrow as pa

from gradstore.core import StoreCore, sql_in, sql_literal
from gradstore.core.engine import Engine, resolve_engine
from gradstore.core.shards import Shard, example_shards
from gradstore.errors import InvalidArgumentError, MissingIdsError
from gradstore.methods.queries import Queries, QueryInput, resolve_queries
from gradstore.methods.registry import Method, ScoreOptions
from gradstore.methods.results import ScoreMatrix, example_table, self_influence_table
from gradstore.preconditioning import GRAD_DOT
from gradstore.preconditioning.fitting import Selection
from gradstore.preconditioning.scoring import ScoringSpace
from gradstore.search import scan_tasks
from indexers import IdentityPreconditioner

#: Examples a TracIn or selection task sums at most (about; ranges come from a sample of the ids): bounds
#: a task's dense ``[queries, examples]`` float64 sum (64 queries: 32 MB).
EXAMPLES_PER_TASK = 65536
#: Examples whose trajectory self-influence one dense ``[chunk, chunk]`` score matrix computes (32 MB float64).
SELF_INFLUENCE_CHUNK = 2048


class Summed(Protocol):
    """A per-example sum over stored history (:class:`gradstore.methods.trajectory.History`): the query ids, its
    terms (row filter, prepared queries, per-row weights), the rows it reads (their first selection sizes the
    scan's shards), the metadata columns its scan needs and the checkpoints it used."""

    query_ids: list[str]
    entries: list[tuple]  # (row filter, prepared queries, per-row weights or None)
    selection: Selection
    columns: tuple[str, ...]
    checkpoints: list[str]


#: A trajectory method's per-example sum for some queries: ``(store, queries, options, run) -> Summed``.
HistoryOf = Callable[[StoreCore, QueryInput, ScoreOptions, str], Summed]


def grad_dot_space() -> ScoringSpace:
    """The space sums are scored in: the raw inner product (the sums' terms carry their own preconditioning)."""
    return ScoringSpace(GRAD_DOT, IdentityPreconditioner())


def per_example_shards(
    store: StoreCore, engine: Engine, selections: Sequence[Selection], columns: tuple[str, ...] = ("example_id",)
) -> list[Shard]:
    """Shards of disjoint ``example_id`` ranges over every row of the store (tasks narrow them to each of
    ``selections``): ``engine.parallelism`` of them, more when the first selection has more than
    :data:`EXAMPLES_PER_TASK` rows per shard."""
    first = selections[0]
    parts = max(engine.parallelism, math.ceil(first.count(store) / EXAMPLES_PER_TASK))
    return example_shards(store, first.run, None, first.filter, parts, columns=columns)


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


# ---------------------------------------------------------------------------------------------- over history
def history_top_k(
    store: StoreCore, summed: Summed, *, method: str, run: str, k: int, opponents: bool, engine: Engine
) -> pa.Table:
    """Top-k examples of a per-example sum over history (and bottom-k with ``opponents``)."""
    sides = (True, False) if opponents else (True,)
    shards = per_example_shards(store, engine, [summed.selection], summed.columns)
    found = scan_tasks.tracin_top_k(engine, shards, grad_dot_space(), summed.entries, k, sides)
    return example_table(
        found, summed.query_ids, sides, method=method, run=run, checkpoint=",".join(summed.checkpoints)
    )


def history_matrix(store: StoreCore, summed: Summed) -> ScoreMatrix:
    """The dense per-example scores of a sum over history (columns: examples; ``grad_ids`` -1: sums of rows)."""
    engine = resolve_engine("local")
    shards = per_example_shards(store, engine, [summed.selection], summed.columns)
    scores, example_ids = scan_tasks.example_score_matrix(engine, shards, grad_dot_space(), summed.entries)
    order = np.argsort(np.asarray(example_ids, dtype=str), kind="stable")
    return ScoreMatrix(
        scores[:, order].astype(np.float32),
        summed.query_ids,
        [example_ids[i] for i in order],
        np.full(len(order), -1, np.int64),
    )


def history_self_influence(
    store: StoreCore,
    history: HistoryOf,
    options: ScoreOptions,
    *,
    final: str,
    method: str,
    run: str,
    engine: Engine,
    chunk_only: bool = False,
) -> pa.Table:
    """A trajectory method's self-influence: the first-order effect of up-weighting each example on its own final
    loss, ``score(g_z(final), z)`` with ``g_z(final)`` its row at checkpoint ``final`` (the last checkpoint pass);
    computed for chunks of :data:`SELF_INFLUENCE_CHUNK` examples at a time (the diagonal of each chunk's dense score
    matrix). ``history`` gets ``options`` with ``where`` narrowed to the chunk's examples: ``options.where`` and the
    chunk's ``example_id`` clause, or (``chunk_only``: ``where`` is applied inside ``history``) the clause alone."""
    space = grad_dot_space()
    example_ids: list[str] = []
    values: list[float] = []
    blocks = store.iter_gradients(
        run, checkpoint=final, split=options.split, where=options.where, block_rows=SELF_INFLUENCE_CHUNK
    )
    checkpoints: list[str] = []
    for block in blocks:
        ids = block.metadata.column("example_id").to_pylist()
        chunk = sql_in("example_id", ids)
        if options.where is not None and not chunk_only:
            chunk = f"({options.where}) AND {chunk}"
        narrowed = replace(options, where=chunk)
        summed = history(store, block.vectors, narrowed, run)
        shards = per_example_shards(store, engine, [summed.selection], summed.columns)
        scores, scored_ids = scan_tasks.example_score_matrix(engine, shards, space, summed.entries)
        column = {example: i for i, example in enumerate(scored_ids)}
        example_ids += ids
        values += [float(scores[row, column[e]]) if e in column else 0.0 for row, e in enumerate(ids)]
        checkpoints = summed.checkpoints
    return self_influence_table(
        example_ids,
        pa.nulls(len(example_ids), pa.int64()),
        values,
        method=method,
        run=run,
        checkpoint=",".join(checkpoints),
    )


def history_aggregates(
    store: StoreCore, summed: Summed, aggregate: str, engine: Engine
) -> tuple[np.ndarray, np.ndarray]:
    """Per example, the ``max``/``mean`` over the queries of a sum over history."""
    shards = per_example_shards(store, engine, [summed.selection], summed.columns)
    return scan_tasks.example_aggregates(engine, shards, grad_dot_space(), summed.entries, aggregate)


def refuse_checkpoints(method: Method, options: ScoreOptions) -> None:
    """``select`` takes ``checkpoints=`` whatever its method; one that scores with the history and does not use it
    refuses it."""
    if options.checkpoints is not None and "checkpoints" not in method.uses:
        raise InvalidArgumentError(
            f"select(preconditioner={method.name!r}) scores with the run's training history and does not use "
            "checkpoints=: drop it"
        )
