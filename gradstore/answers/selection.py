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

from gradstore.core import StoreCore, one_snapshot
from gradstore.core.engine import Engine, EngineName, resolve_engine
from gradstore.errors import InvalidArgumentError
from gradstore.methods import ScoreOptions
from gradstore.methods.queries import QueryInput
from gradstore.methods.rows import check_where
from gradstore.preconditioning.fitting import FitCache

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
    method = options.check("select")  # cosines in a preconditioned space (not cosine or tracin), or a history sum
    check_where(store, run, options.where)
    engine = resolve_engine(engine)
    example_ids, scores = method.select(store, fits, target, options, run=run, aggregate=aggregate, engine=engine)
    return _ranked(example_ids, scores, budget)


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
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < math.inf:
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
