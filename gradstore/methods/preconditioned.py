"""The preconditioned single-checkpoint family: ``grad-dot``, ``cosine``, ``diagonal``, ``fisher``, ``kfac``,
``ekfac``, ``trackstar`` and every method :func:`gradstore.register_method` adds.

Each scores one checkpoint's training rows in the space of a preconditioner fitted over them
(:class:`~gradstore.preconditioning.Preconditioning`: ``(P^-1 q) . g`` or ``(P^-1/2 q) . (P^-1/2 g)``): top-k
through an index (:mod:`gradstore.search.index`, exact or FAISS), dense matrices and self-influence by scans,
and LESS selection as a learning-rate weighted sum of whitened cosines over checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from gradstore.core import StoreCore
from gradstore.core.engine import Engine
from gradstore.errors import InvalidArgumentError
from gradstore.methods.queries import Queries, QueryInput, resolve_queries
from gradstore.methods.registry import ALL_OPERATIONS, ONE_CHECKPOINT, Method, ScoreOptions, resolve_method
from gradstore.methods.results import ScoreMatrix, index_table, self_influence_table
from gradstore.methods.rows import require_rows
from gradstore.methods.summed import learning_rates, per_example_shards
from gradstore.preconditioning import Preconditioning
from gradstore.preconditioning.fitting import FitCache, Selection
from gradstore.search import scan_tasks
from gradstore.search.building import build_index
from gradstore.search.index import AttributionIndex
from indexers.identity import unit_rows


@dataclass(frozen=True)
class Preconditioned(Preconditioning, Method):
    """A method over one checkpoint's rows, scoring in its preconditioner's space (the fields of
    :class:`~gradstore.preconditioning.Preconditioning`, then what the registry shows)."""

    summary: str = ""
    requires: str = ""
    operations: frozenset[str] = ALL_OPERATIONS

    @property
    def uses(self) -> frozenset[str]:
        used = set(ONE_CHECKPOINT)
        if self.damped:
            used.add("damping")
        if self.blocked:
            used.add("blocks")
        return frozenset(used)

    def selection(self, store: StoreCore, options: ScoreOptions, run: str) -> Selection:
        """The training rows it scores: those of ``options.checkpoint`` (default: the run's latest)."""
        checkpoint = options.checkpoint or store.default_checkpoint(run)
        return Selection(run, checkpoint, options.split, options.where)

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
        selection = self.selection(store, options, run)
        require_rows(store, selection)
        resolved = resolve_queries(store, queries, run, selection.checkpoint, options.query_checkpoint)  # dims first
        return index_top_k(
            store, fits, resolved, selection, self, options, self.name, run=run, k=k, opponents=opponents, engine=engine
        )

    def matrix(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
    ) -> ScoreMatrix:
        selection = self.selection(store, options, run)
        require_rows(store, selection)
        resolved = resolve_queries(store, queries, run, selection.checkpoint, options.query_checkpoint)
        return dense_matrix(store, fits, resolved, selection, self, options.blocks, options.damping)

    def self_influence(
        self, store: StoreCore, fits: FitCache, options: ScoreOptions, *, run: str, engine: Engine
    ) -> pa.Table:
        selection = self.selection(store, options, run)
        require_rows(store, selection)
        space = fits.space(selection, self, options.blocks, options.damping, engine)
        values = scan_tasks.self_influence(engine, selection.shards(store, engine.parallelism, ("example_id",)), space)
        return self_influence_table(
            values.column("example_id"),
            values.column("grad_id"),
            values.column("self_influence"),
            method=self.name,
            run=run,
            checkpoint=selection.checkpoint,
        )

    def select(
        self,
        store: StoreCore,
        fits: FitCache,
        target: QueryInput,
        options: ScoreOptions,
        *,
        run: str,
        aggregate: str,
        engine: Engine,
    ) -> tuple[np.ndarray, np.ndarray]:
        """LESS: per example, ``sum_c lr_c * agg_q cos(P_c^-1/2 g_c, P_c^-1/2 q_c)`` over the checkpoints with a
        learning rate (one unweighted checkpoint when the run records none)."""
        checkpoints, split, where = options.checkpoints, options.split, options.where
        try:
            rates = learning_rates(store, run, checkpoints)
        except InvalidArgumentError:
            if checkpoints is not None:
                raise
            rates = {store.default_checkpoint(run): 1.0}  # no learning rates recorded: one unweighted checkpoint
        jobs = []
        for checkpoint, rate in rates.items():
            selection = Selection(run, checkpoint, split, where)
            space = fits.space(selection, self, options.blocks, options.damping, engine)
            resolved = resolve_queries(store, target, run, checkpoint)
            whitened = unit_rows(space.whitened(torch.from_numpy(resolved.vectors)))
            jobs.append((selection.filter, rate, space, whitened))
        shards = per_example_shards(store, engine, [Selection(run, c, split, where) for c in rates])
        return scan_tasks.example_totals(engine, shards, jobs, aggregate)

    def build_index(
        self,
        store: StoreCore,
        fits: FitCache,
        options: ScoreOptions,
        *,
        run: str,
        name: str | None,
        refit: bool,
        engine: Engine,
    ) -> AttributionIndex:
        selection = self.selection(store, options, run)
        require_rows(store, selection)
        return build_index(
            store,
            fits,
            selection,
            self,
            damping=options.damping,
            kind=options.kind,
            name=name,
            blocks=options.blocks,
            refit=refit,
            engine=engine,
            device=options.device,
        )


def index_top_k(
    store: StoreCore,
    fits: FitCache,
    queries: Queries,
    selection: Selection,
    preconditioning: Preconditioning,
    options: ScoreOptions,
    method: str,
    *,
    run: str,
    k: int,
    opponents: bool,
    engine: Engine,
    blocks: str | None = None,
) -> pa.Table:
    """The top-k rows of ``selection`` for ``queries`` scored with ``preconditioning`` (through the index
    :func:`~gradstore.search.building.build_index` builds or reuses), as a ``scores`` table of method ``method``;
    ``blocks``: the Fisher blocks (default: the options')."""
    index = build_index(
        store,
        fits,
        selection,
        preconditioning,
        damping=options.damping,
        kind=options.kind,
        blocks=options.blocks if blocks is None else blocks,
        engine=engine,
        device=options.device,
    )
    sides = (True, False) if opponents else (True,)
    found = index.search_sides(queries.vectors, k, sides, engine, options.rerank)
    return pa.concat_tables([index_table(index, queries.ids, *found[side], side, method, run) for side in sides])


def dense_matrix(
    store: StoreCore,
    fits: FitCache,
    queries: Queries,
    selection: Selection,
    preconditioning: Preconditioning,
    blocks: str,
    damping: float | None,
) -> ScoreMatrix:
    """The dense queries x rows scores of ``selection`` with ``preconditioning``."""
    space = fits.space(selection, preconditioning, blocks, damping)
    prepared = space.queries(queries.vectors, torch.float64)  # float64: ScoringSpace.scores
    parts, example_ids, grad_ids = [], [], []
    rows = store.iter_gradients(
        selection.run,
        checkpoint=selection.checkpoint,
        split=selection.split,
        where=selection.where,
        columns=("example_id",),
    )
    for block in rows:
        parts.append(space.scores(prepared, torch.from_numpy(block.vectors)))
        example_ids += block.metadata.column("example_id").to_pylist()
        grad_ids.append(block.grad_ids)
    scores = torch.cat(parts, dim=1).numpy() if parts else np.empty((len(queries.ids), 0), np.float32)
    return ScoreMatrix(
        scores, queries.ids, example_ids, np.concatenate(grad_ids) if grad_ids else np.empty(0, np.int64)
    )


def indexed(name: str) -> Preconditioning:
    """The preconditioning of the method an index manifest names (what :func:`gradstore.search.loading.load_index`
    loads it with): an unknown method, or one with no index of its own, is an ``InvalidArgumentError``."""
    method = resolve_method(name)
    if not isinstance(method, Preconditioning):
        raise InvalidArgumentError(f"an index names method {name!r}, which has no index of its own")
    return method
