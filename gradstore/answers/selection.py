"""Data selection (LESS-style): the training examples whose gradients align best with a target set.

``score(x) = sum_c lr_c * agg_{q in target} cos(P_c^-1/2 g_c(x), P_c^-1/2 q_c)`` with ``agg`` the max (LESS)
or the mean over the target's query rows, ``P_c`` the preconditioner fitted at checkpoint ``c``
(identity: plain cosine; ``fisher``/``diagonal``/``kfac``: cosine in the whitened space) and ``lr_c`` the
checkpoint's learning rate. The top ``budget`` examples (a fraction of the examples or a count) are selected.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gradstore.answers.attribution import history_for, learning_rates, per_example_shards
from gradstore.core import StoreCore, one_snapshot
from gradstore.core.engine import Engine, EngineName, resolve_engine
from gradstore.errors import InvalidArgumentError
from gradstore.methods import ScoreOptions, resolve_method
from gradstore.methods.fitting import FitCache, Selection
from gradstore.methods.queries import QueryInput, resolve_queries
from gradstore.methods.rows import check_where
from gradstore.methods.scoring import ScoringSpace
from gradstore.search.scan_tasks import example_aggregates, example_totals, unit_rows
from indexers import IdentityPreconditioner

Aggregate = Literal["max", "mean"]
AGGREGATES = get_args(Aggregate)


@one_snapshot
def select(
    store: StoreCore,
    fits: FitCache,
    target: QueryInput,
    options: ScoreOptions,
    *,
    run: str,
    budget: float = 0.05,
    aggregate: Aggregate = "max",
    engine: EngineName | Engine = "local",
) -> pa.Table:
    """Select training examples for ``target`` queries; see :meth:`gradstore.GradStore.select`.

    Runs on ``engine`` over shards of disjoint ``example_id`` ranges (an example's rows at every checkpoint
    are summed by one task); the result holds one score per example until the budget is cut. ``options.method``
    is the space of the cosines (the facade's ``preconditioner``)."""
    if aggregate not in AGGREGATES:
        raise InvalidArgumentError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    budget_count(budget, 1)  # a bad budget fails before any work
    method = options.check("select")  # cosines in a preconditioned space: not cosine or tracin
    checkpoints, split, where = options.checkpoints, options.split, options.where
    check_where(store, run, where)
    engine = resolve_engine(engine)
    if method.trajectory:
        example_ids, scores = _by_influence(store, fits, target, options, run, aggregate, engine)
        return _ranked(example_ids, scores, budget)
    try:
        rates = learning_rates(store, run, checkpoints)
    except InvalidArgumentError:
        if checkpoints is not None:
            raise
        rates = {store.default_checkpoint(run): 1.0}  # no learning rates recorded: one unweighted checkpoint
    jobs = []
    for checkpoint, rate in rates.items():
        selection = Selection(run, checkpoint, split, where)
        space = fits.space(selection, method, options.blocks, options.damping, engine)
        resolved = resolve_queries(store, target, run, checkpoint)
        jobs.append((selection.filter, rate, space, unit_rows(space.whitened(torch.from_numpy(resolved.vectors)))))
    shards = per_example_shards(store, engine, [Selection(run, c, split, where) for c in rates])
    example_ids, scores = example_totals(engine, shards, jobs, aggregate)
    return _ranked(example_ids, scores, budget)


def _by_influence(
    store: StoreCore,
    fits: FitCache,
    target: QueryInput,
    options: ScoreOptions,
    run: str,
    aggregate: Aggregate,
    engine: Engine,
) -> tuple[np.ndarray, np.ndarray]:
    """Per example, the ``max``/``mean`` over the target queries of a trajectory method's influence score (its
    per-example sum over the stored history: :func:`gradstore.answers.attribution.history_for`)."""
    method = resolve_method(options.method)
    if options.checkpoints is not None and "checkpoints" not in method.uses:
        raise InvalidArgumentError(
            f"select(preconditioner={method.name!r}) scores with the run's training history and does not use "
            "checkpoints=: drop it"
        )
    summed = history_for(store, fits, target, options, run)
    shards = per_example_shards(store, engine, [summed.selection], summed.columns)
    space = ScoringSpace(resolve_method("grad-dot"), IdentityPreconditioner())
    return example_aggregates(engine, shards, space, summed.entries, aggregate)


def _ranked(example_ids: np.ndarray, scores: np.ndarray, budget: float) -> pa.Table:
    """The top ``budget`` examples by score (ties: the smaller id), ranked from 1."""
    count = budget_count(budget, len(example_ids))
    order = np.lexsort((example_ids.astype(str), -scores))[:count]
    return pa.table(
        {
            "example_id": pa.array(example_ids[order].tolist(), pa.string()),
            "score": pa.array(scores[order], pa.float64()),
            "rank": pa.array(np.arange(1, count + 1, dtype=np.int32)),
        }
    )


def budget_count(budget: float, n_examples: int) -> int:
    """Examples to select: ``budget`` in (0, 1] is a fraction (rounded up), an int >= 1 a count."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise InvalidArgumentError(f"budget must be a fraction in (0, 1] or a positive count, got {budget!r}")
    if isinstance(budget, float) and budget <= 1.0:
        return min(n_examples, math.ceil(budget * n_examples))
    if float(budget) != int(budget):
        raise InvalidArgumentError(f"a budget above 1 must be a whole number of examples, got {budget!r}")
    return min(n_examples, int(budget))


def export_selection(selection: pa.Table, path: str | Path) -> Path:
    """Write a selection to parquet."""
    path = Path(path)
    pq.write_table(selection, path)
    return path


def filter_dataset(dataset: Any, selection: pa.Table, id_column: str = "example_id") -> Any:
    """The rows of an HF ``datasets.Dataset`` whose ``id_column`` is in the selection (order kept)."""
    chosen = set(selection.column("example_id").to_pylist())
    return dataset.filter(lambda row: str(row[id_column]) in chosen)
