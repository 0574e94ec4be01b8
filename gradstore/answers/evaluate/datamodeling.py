"""The linear datamodeling score (LDS): the retraining on random subsets and the Spearman correlations of a
method's summed scores with the retrained query losses (see :mod:`gradstore.answers.evaluate`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from gradstore.answers.evaluate.evaluations import (
    TrainFn,
    check_methods,
    evaluation_row,
    record_evaluation,
    retrained_losses,
    scores_by_example,
    training_ids,
)
from gradstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from gradstore.store import GradStore


@dataclass
class Retraining:
    """Ground truth of an LDS evaluation: the subsets and the retrained models' query losses."""

    train_ids: list[str]
    queries: list[str]
    masks: np.ndarray  # [subsets, n_train] float64 0/1
    losses: np.ndarray  # [seeds, subsets, queries]
    seeds: tuple[int, ...]
    fraction: float
    seed: int

    def outcome(self, queries: Sequence[str] | None = None) -> np.ndarray:
        """Seed-averaged negative losses ``[subsets, queries]`` (of ``queries``, default all)."""
        return -self.losses[:, :, self._columns(queries)].mean(0)

    def noise_ceiling(self, queries: Sequence[str] | None = None) -> float | None:
        """Mean Spearman correlation between two disjoint seed groups' averaged losses (None: one seed)."""
        if len(self.seeds) < 2:
            return None
        half = len(self.seeds) // 2
        losses = self.losses[:, :, self._columns(queries)]
        return float(spearman_columns(-losses[:half].mean(0), -losses[half:].mean(0)).mean())

    def _columns(self, queries: Sequence[str] | None) -> list[int]:
        if queries is None:
            return list(range(len(self.queries)))
        position = {q: i for i, q in enumerate(self.queries)}
        missing = [q for q in queries if q not in position]
        if missing:
            raise KeyError(f"queries {missing[:5]} were not evaluated in this retraining")
        return [position[q] for q in queries]


@dataclass
class LDSResult:
    """The LDS of one scored variant."""

    label: str
    value: float
    stderr: float
    noise_ceiling: float | None
    per_query: np.ndarray  # [queries]


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks (1-based) of every column of ``x [n, m]``, ties given their average rank."""
    ranks = np.empty(x.shape, dtype=np.float64)
    for j in range(x.shape[1]):
        order = np.argsort(x[:, j], kind="stable")
        values = x[order, j]
        starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
        ends = np.concatenate([starts[1:], [len(values)]])
        ranks[order, j] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks


def spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of every column of ``a`` with the same column of ``b`` (0 where constant)."""
    ra = average_ranks(np.asarray(a, dtype=np.float64))
    rb = average_ranks(np.asarray(b, dtype=np.float64))
    ra -= ra.mean(0)
    rb -= rb.mean(0)
    denominator = np.sqrt((ra * ra).sum(0) * (rb * rb).sum(0))
    return np.where(denominator > 0, (ra * rb).sum(0) / np.where(denominator > 0, denominator, 1), 0.0)


def retrain(
    train_fn: TrainFn,
    train_ids: Sequence[str],
    *,
    queries: Sequence[str],
    subsets: int = 100,
    fraction: float = 0.5,
    seeds: Sequence[int] = (0,),
    seed: int = 0,
) -> Retraining:
    """Draw ``subsets`` random subsets of ``fraction`` of ``train_ids`` (seeded by ``seed``) and retrain each
    once per seed of ``seeds`` through ``train_fn``."""
    if not 0 < fraction < 1:
        raise InvalidArgumentError(f"fraction must be in (0, 1), got {fraction}")
    if subsets < 2 or not seeds:
        raise InvalidArgumentError("an LDS needs at least 2 subsets and one seed")
    ids = list(train_ids)
    size = max(1, round(fraction * len(ids)))
    rng = np.random.default_rng(seed)
    chosen = [np.sort(rng.choice(len(ids), size=size, replace=False)) for _ in range(subsets)]
    masks = np.zeros((subsets, len(ids)))
    for row, members in enumerate(chosen):
        masks[row, members] = 1.0
    subset_ids = [[ids[i] for i in members] for members in chosen]
    losses = []
    for s in seeds:
        losses.append(retrained_losses(train_fn, subset_ids, list(queries), int(s)))
    return Retraining(ids, list(queries), masks, np.stack(losses), tuple(int(s) for s in seeds), fraction, seed)


def lds_of_scores(
    scores: np.ndarray, truth: Retraining, queries: Sequence[str] | None = None, label: str = "scores"
) -> LDSResult:
    """LDS of a ``[queries, n_train]`` score matrix (columns in ``truth.train_ids`` order)."""
    per_query = spearman_columns(truth.masks @ scores.T, truth.outcome(queries))
    stderr = float(per_query.std(ddof=1) / np.sqrt(len(per_query))) if len(per_query) > 1 else float("nan")
    return LDSResult(label, float(per_query.mean()), stderr, truth.noise_ceiling(queries), per_query)


def lds(
    store: GradStore,
    run: str,
    train_fn: TrainFn | None = None,
    *,
    queries: Sequence[str],
    methods: Mapping[str, Mapping[str, Any]] | None = None,
    subsets: int = 100,
    fraction: float = 0.5,
    seeds: Sequence[int] = (0,),
    seed: int = 0,
    truth: Retraining | None = None,
    write: bool = True,
) -> tuple[pa.Table, Retraining]:
    """LDS of each scored variant on stored query ids ``queries``.

    ``methods``: label -> ``store.attribute`` options, a dict or a :class:`~gradstore.methods.ScoreOptions` (default
    grad-dot and fisher). Ground truth comes from
    ``truth`` when given (reuse one retraining for several evaluations), else from :func:`retrain` of the
    run's training example ids with ``train_fn``, ``subsets``, ``fraction``, ``seeds`` and ``seed``. Returns
    the rows (also appended to the ``evaluations`` table unless ``write=False``) and the retraining.
    """
    if truth is None:
        if train_fn is None:
            raise InvalidArgumentError("lds needs a train_fn (or a previous retraining as truth=)")
        truth = retrain(
            train_fn,
            training_ids(store, run),
            queries=queries,
            subsets=subsets,
            fraction=fraction,
            seeds=seeds,
            seed=seed,
        )
    chosen = check_methods(methods)
    rows = []
    for label, options in chosen.items():
        scores = scores_by_example(store, run, list(queries), truth.train_ids, **options)
        result = lds_of_scores(scores, truth, queries, label)
        rows.append(
            evaluation_row(
                options,
                label=label,
                metric="lds",
                value=result.value,
                stderr=result.stderr,
                noise_ceiling=result.noise_ceiling,
                queries=len(queries),
                subsets=len(truth.masks),
                seeds=truth.seeds,
                fraction=truth.fraction,
                seed=truth.seed,
            )
        )
    return record_evaluation(store, run, rows, write), truth
