"""Attribution: top-k proponents/opponents of queries, dense score matrices and self-influence, each answered by
the chosen method (:class:`~gradstore.methods.Method`: its family's ``attribute``, ``matrix`` and
``self_influence``); these calls check the arguments, dispatch and write the results.

Every top-k result is a pyarrow Table and is also appended to the store's ``scores`` (or ``self_influence``)
table, so it can be joined with ``examples`` in SQL. Proponents get ranks 1..k (most supportive first);
opponents get ranks -1..-k (most opposing first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from gradstore.core import StoreCore, one_snapshot
from gradstore.core import schema as S
from gradstore.core.engine import Engine, EngineName, resolve_engine
from gradstore.errors import NonFiniteScoresError
from gradstore.methods import ScoreOptions
from gradstore.methods.checkpoint_sum import tracin_top_k
from gradstore.methods.queries import QueryInput
from gradstore.methods.results import ScoreMatrix
from gradstore.methods.summed import (
    EXAMPLES_PER_TASK,
    SELF_INFLUENCE_CHUNK,
    checkpoint_queries,
    learning_rates,
    per_example_shards,
)
from gradstore.preconditioning.fitting import FitCache
from gradstore.search.arguments import check_k

__all__ = [
    "EXAMPLES_PER_TASK",
    "SELF_INFLUENCE_CHUNK",
    "ScoreMatrix",
    "attribute",
    "checkpoint_queries",
    "learning_rates",
    "per_example_shards",
    "score_matrix",
    "self_influence",
    "tracin",
]


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
    k = check_k(k)
    if write:
        store.require_writable("attribute with write=True")
    method = options.check("attribute")
    table = method.attribute(
        store, fits, queries, options, run=run, k=k, opponents=opponents, engine=resolve_engine(engine)
    )
    _check_finite(table.column("score").to_numpy(zero_copy_only=False), options, run)
    if write:
        store.append_results(S.SCORES, table)
    return table


@one_snapshot
def score_matrix(
    store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
) -> ScoreMatrix:
    """Queries x training rows scores (for small problems: it is dense); nothing is written to ``scores``."""
    matrix = options.check("score_matrix").matrix(store, fits, queries, options, run=run)
    _check_finite(matrix.scores, options, run)
    return matrix


def _check_finite(scores: np.ndarray, options: ScoreOptions, run: str) -> None:
    """``NonFiniteScoresError`` where ``scores`` hold NaN/Inf: a ranking of them would be arbitrary."""
    bad = int(np.count_nonzero(~np.isfinite(scores)))
    if bad:
        raise NonFiniteScoresError(
            f"{options.method} on run {run!r} gave {bad} of {scores.size} score(s) that are NaN/Inf (float overflow: "
            "the stored rows or queries are too large for their products, or a trajectory method's products over "
            "the steps grew beyond float32, as after training that diverged: check the run's training losses). "
            "Nothing was written: score the rows of a checkpoint before the divergence"
        )


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
    method = options.check("self_influence")  # cosine-like methods: 1 for every row, not informative
    table = method.self_influence(store, fits, options, run=run, engine=resolve_engine(engine))
    if write:
        store.append_results(S.SELF_INFLUENCE, table)
    return table


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
    """TracIn-CP: ``score(q, x) = sum_c lr_c * q_c . g_c(x)`` (:func:`gradstore.methods.checkpoint_sum.tracin_top_k`),
    written to ``scores`` unless ``write=False``."""
    k = check_k(k)
    table = tracin_top_k(
        store,
        queries,
        run=run,
        k=k,
        checkpoints=checkpoints,
        opponents=opponents,
        split=split,
        where=where,
        engine=resolve_engine(engine),
    )
    if write:
        store.append_results(S.SCORES, table)
    return table
