"""The checkpoint-sum family: ``tracin`` (TracIn-CP), ``score(q, x) = sum_c lr_c * q_c . g_c(x)``, a learning-rate
weighted sum of per-checkpoint grad-dot scores over the run's checkpoint passes, summed exactly per example before
ranking (not a merge of per-checkpoint top-k lists)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import torch
from tqdm.auto import tqdm

from gradstore.core import StoreCore
from gradstore.core.engine import Engine
from gradstore.methods.queries import QueryInput
from gradstore.methods.registry import Method, ScoreOptions
from gradstore.methods.results import example_table
from gradstore.methods.rows import check_where
from gradstore.methods.summed import checkpoint_queries, grad_dot_space, learning_rates, per_example_shards
from gradstore.preconditioning.fitting import FitCache, Selection
from gradstore.search import scan_tasks


@dataclass(frozen=True)
class CheckpointSum(Method):
    """A learning-rate weighted sum of grad-dot scores over checkpoints (``checkpoints=``: which; default every
    checkpoint with a learning rate and query rows)."""

    name: str
    summary: str
    requires: str = ""
    operations: frozenset[str] = field(default_factory=lambda: frozenset({"attribute"}))

    @property
    def uses(self) -> frozenset[str]:
        return frozenset({"checkpoints"})

    @property
    def reads_history(self) -> bool:
        return True

    def attribute(
        self,
        store: StoreCore,
        fits: FitCache,
        queries: QueryInput,
        options: ScoreOptions,
        *,
        run: str,
        k: int,
        opponents: bool,
        engine: Engine,
    ) -> pa.Table:
        return tracin_top_k(
            store,
            queries,
            run=run,
            k=k,
            checkpoints=options.checkpoints,
            opponents=opponents,
            split=options.split,
            where=options.where,
            engine=engine,
            method=self.name,
        )


def tracin_top_k(
    store: StoreCore,
    queries: QueryInput,
    *,
    run: str,
    k: int,
    checkpoints: Sequence[str] | None,
    opponents: bool,
    split: str,
    where: str | None,
    engine: Engine,
    method: str = "tracin",
) -> pa.Table:
    """TracIn-CP's top-k examples (and bottom-k with ``opponents``) as a ``scores`` table. Queries must be stored
    query rows captured at every checkpoint (ids, a filter, or ``None`` for all).

    Streaming: the training rows are split into ``example_id`` ranges (:func:`gradstore.core.shards.example_shards`)
    so that every row of an example, at every checkpoint, is summed by one task; each task ranks its
    examples and the top-k lists are merged (ties: the smaller example id)."""
    check_where(store, run, where)
    rates = learning_rates(store, run, checkpoints)
    space = grad_dot_space()
    weighted: list[tuple[str, torch.Tensor, None]] = []
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
    return example_table(found, query_ids, sides, method=method, run=run, checkpoint=",".join(rates))
