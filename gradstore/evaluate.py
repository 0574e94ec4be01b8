"""Counterfactual check of attribution scores: the linear datamodeling score (LDS).

Retrain the user's model on random subsets of the training set and ask whether a method's scores predict
the retrained models' query losses: for query ``q`` and subset ``S`` the prediction is
``sum_{i in S} score(q, i)`` (a positive score means example ``i`` lowers ``q``'s loss); ``LDS_q`` is the
Spearman correlation of the predictions with ``-loss_S(q)`` across subsets, and the LDS is the mean over
queries (with its standard error over queries). With two or more seeds per subset the losses are averaged
over seeds, and the **noise ceiling** is the mean over queries of the Spearman correlation between the
seed-averaged losses of two disjoint seed groups: how well retraining predicts itself, which bounds what
any method can reach at this number of seeds.

``train_fn(subsets, queries, seed)`` is the user's code: given a list of subsets (each a list of training
example ids) it retrains one model per subset with ``seed`` and returns their losses on the query ids,
``[len(subsets), len(queries)]``. It receives all subsets of a seed at once, so it may train them together
or in parallel. Everything is deterministic given ``seed`` and ``seeds`` (and a deterministic ``train_fn``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from gradstore.core import sql_literal
from gradstore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from gradstore.store import GradStore

TrainFn = Callable[[list[list[str]], list[str], int], Any]

EVALUATIONS = "evaluations"
EVALUATIONS_SCHEMA = pa.schema(
    [
        pa.field("evaluation_id", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("label", pa.string()),  # the caller's name for the scored variant
        pa.field("method", pa.string()),
        pa.field("options", pa.string()),  # JSON of the attribute() options
        pa.field("metric", pa.string()),
        pa.field("value", pa.float64()),
        pa.field("stderr", pa.float64()),
        pa.field("noise_ceiling", pa.float64()),
        pa.field("queries", pa.int32()),
        pa.field("subsets", pa.int32()),
        pa.field("seeds", pa.string()),  # JSON list
        pa.field("fraction", pa.float64()),
        pa.field("seed", pa.int64()),
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)
DEFAULT_METHODS: dict[str, dict[str, Any]] = {"grad-dot": {"method": "grad-dot"}, "fisher": {"method": "fisher"}}


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


def training_ids(store: GradStore, run: str, split: str = "train") -> list[str]:
    """The distinct example ids of a run's ``split`` rows, sorted."""
    store.run(run)
    relation = store.sql(
        f"SELECT DISTINCT example_id FROM gradients WHERE run_id = {sql_literal(run)} "
        f"AND split = {sql_literal(split)} ORDER BY example_id"
    )
    return [row[0] for row in relation.fetchall()]


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
        result = np.asarray(train_fn(subset_ids, list(queries), int(s)), dtype=np.float64)
        if result.shape != (subsets, len(queries)):
            raise InvalidArgumentError(f"train_fn returned shape {result.shape}, expected ({subsets}, {len(queries)})")
        losses.append(result)
    return Retraining(ids, list(queries), masks, np.stack(losses), tuple(int(s) for s in seeds), fraction, seed)


def scores_by_example(
    store: GradStore, run: str, queries: Sequence[str] | np.ndarray, train_ids: Sequence[str], **options: Any
) -> np.ndarray:
    """Every training example's score for every query, ``[queries, len(train_ids)]``, from
    ``store.attribute(..., write=False)`` (scores of several rows of one example are summed)."""
    k = store.core.gradient_table(run).count_rows(f"run_id = {sql_literal(run)} AND split = 'train'")
    table = store.attribute(queries, run=run, k=k, write=False, **options)
    query_ids = table.column("query_id").to_pylist()
    order = {q: i for i, q in enumerate(dict.fromkeys(query_ids))}
    column = {e: i for i, e in enumerate(train_ids)}
    rows = np.fromiter((order[q] for q in query_ids), np.int64, len(query_ids))
    examples = table.column("example_id").to_pylist()
    keep = np.fromiter((e in column for e in examples), bool, len(examples))
    columns = np.fromiter((column.get(e, -1) for e in examples), np.int64, len(examples))
    scores = np.zeros((len(order), len(train_ids)))
    np.add.at(scores, (rows[keep], columns[keep]), table.column("score").to_numpy()[keep])
    return scores


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

    ``methods``: label -> ``store.attribute`` options (default grad-dot and fisher). Ground truth comes from
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
    evaluation_id = uuid.uuid4().hex[:16]
    now = datetime.now(timezone.utc)
    rows = []
    for label, options in (methods or DEFAULT_METHODS).items():
        scores = scores_by_example(store, run, list(queries), truth.train_ids, **options)
        result = lds_of_scores(scores, truth, queries, label)
        rows.append(
            {
                "evaluation_id": evaluation_id,
                "run_id": run,
                "label": label,
                "method": options.get("method", "grad-dot"),
                "options": json.dumps(dict(options), sort_keys=True),
                "metric": "lds",
                "value": result.value,
                "stderr": result.stderr,
                "noise_ceiling": result.noise_ceiling,
                "queries": len(queries),
                "subsets": len(truth.masks),
                "seeds": json.dumps(list(truth.seeds)),
                "fraction": truth.fraction,
                "seed": truth.seed,
                "created_at": now,
            }
        )
    table = pa.Table.from_pylist(rows, schema=EVALUATIONS_SCHEMA)
    if write:
        store.core.append_table(EVALUATIONS, table)
    return table, truth
