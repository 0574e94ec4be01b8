"""The query loss difference (QLD): retraining without a query's top proponents against random removals of the
same size (see :mod:`gradstore.answers.evaluate`)."""

from __future__ import annotations

import numbers
import zlib
from collections import Counter
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
class QLDResult:
    """The query loss difference of one scored variant (:func:`qld_of_scores`)."""

    label: str
    value: float  # mean over queries of per_query
    stderr: float  # standard error of that mean over queries (nan with one query)
    per_query: np.ndarray  # [queries] proponent_loss - random_loss
    proponent_loss: np.ndarray  # [queries] loss without the query's top proponents (mean over seeds)
    random_loss: np.ndarray  # [queries] loss without a random set of the same size (mean over seeds and draws)
    removed: np.ndarray  # [queries, size] positions in train_ids of each query's removed proponents
    random: np.ndarray  # [queries, draws, size] positions of the random control's removals
    subsets: int  # distinct retrainings (per seed) the value rests on: proponent removals and random controls
    seeds: tuple[int, ...]
    fraction: float
    seed: int


def removal_size(n_train: int, fraction: float) -> int:
    """How many training examples a QLD removes per query: ``max(1, round(fraction * n_train))``, checked to
    leave at least one."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction < 1:
        raise InvalidArgumentError(
            f"fraction must be a number in (0, 1), the share of the training set removed per query; got {fraction!r}"
        )
    if n_train < 2:
        raise InvalidArgumentError(f"a QLD needs at least 2 training examples, the run has {n_train}")
    size = max(1, round(float(fraction) * n_train))
    if size >= n_train:
        raise InvalidArgumentError(
            f"fraction={fraction} removes all {n_train} training examples; pass a smaller fraction "
            f"(at most {(n_train - 1) / n_train:.3g} here)"
        )
    return size


def top_proponents(scores: np.ndarray, size: int) -> np.ndarray:
    """Positions ``[queries, size]`` of each row's ``size`` largest scores, largest first (ties: the earlier
    position first)."""
    return np.argsort(-np.asarray(scores, dtype=np.float64), axis=1, kind="stable")[:, :size]


def random_removals(n_train: int, size: int, queries: Sequence[str], draws: int, seed: int) -> np.ndarray:
    """Positions ``[queries, draws, size]`` (each draw sorted) of the random control's removals: for query id
    ``q``, ``rng = np.random.default_rng([seed % 2**32, zlib.crc32(q.encode())])`` draws ``draws`` times
    ``rng.choice(n_train, size, replace=False)``. A query's control depends only on ``seed``, its id and the
    sizes, never on the methods or the other queries evaluated with it."""
    out = np.empty((len(queries), draws, size), dtype=np.int64)
    for row, query in enumerate(queries):
        rng = np.random.default_rng([int(seed) % 2**32, zlib.crc32(str(query).encode())])
        for draw in range(draws):
            out[row, draw] = np.sort(rng.choice(n_train, size=size, replace=False))
    return out


def _check_queries(queries: Sequence[str]) -> list[str]:
    if isinstance(queries, str) or not isinstance(queries, Sequence):
        raise InvalidArgumentError(f"queries must be a list of query example ids, got {queries!r}")
    ids = [str(q) for q in queries]
    if not ids:
        raise InvalidArgumentError("queries is empty: pass the query example ids to evaluate")
    duplicated = sorted(q for q, count in Counter(ids).items() if count > 1)
    if duplicated:
        raise InvalidArgumentError(f"queries holds {duplicated[:5]} more than once: pass each query id once")
    return ids


def _check_seeds(seeds: Sequence[int]) -> tuple[int, ...]:
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or not seeds:
        raise InvalidArgumentError(f"seeds must be a non-empty list of training seeds, e.g. (0,); got {seeds!r}")
    if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in seeds):
        raise InvalidArgumentError(f"seeds must be integers, got {list(seeds)!r}")
    if len(set(seeds)) < len(seeds):
        raise InvalidArgumentError(f"seeds holds a seed more than once: {list(seeds)!r}; pass each seed once")
    return tuple(int(s) for s in seeds)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InvalidArgumentError(f"seed must be an integer (it seeds the random control's draws), got {seed!r}")
    return int(seed)


def _check_count(name: str, value: int | None, what: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgumentError(f"{name} must be a whole number >= 1 ({what}), got {value!r}")


def qld_of_scores(
    scores: np.ndarray | Mapping[str, np.ndarray],
    train_fn: TrainFn,
    train_ids: Sequence[str],
    *,
    queries: Sequence[str],
    fraction: float = 0.1,
    seeds: Sequence[int] = (0,),
    seed: int = 0,
    draws: int = 3,
    batch: int | None = None,
) -> dict[str, QLDResult]:
    """Query loss difference of precomputed scores (the lower level of :func:`qld`, for callers holding scores).

    ``scores``: a ``[len(queries), len(train_ids)]`` matrix (row ``i`` scores ``queries[i]``, columns in
    ``train_ids`` order, positive = the example lowers the query's loss), or a mapping label -> such matrix to
    evaluate several variants against one random control (results keyed by label; a bare matrix is labelled
    ``"scores"``). Each query's ``size = max(1, round(fraction * len(train_ids)))`` highest-scored examples
    are removed (:func:`top_proponents`); the control removes ``draws`` random sets of the same size per query
    (:func:`random_removals`, seeded by ``seed`` and the query id). Every removal of every query and variant is
    retrained once per seed of ``seeds``: ``train_fn(kept, queries, s)`` gets the kept ids of all removals (each
    a list in ``train_ids`` order, all of the same length ``len(train_ids) - size``; identical removals once)
    in one call per seed, or in calls of at most ``batch`` subsets, and only the removal's own query's loss is
    read. ``QLD_q`` = (loss of ``q`` without its proponents) - (mean loss of ``q`` without the random sets),
    each averaged over seeds; the result's ``value`` is the mean over queries and ``stderr`` its standard error.
    """
    ids = [str(i) for i in train_ids]
    queries = _check_queries(queries)
    seeds = _check_seeds(seeds)
    seed = _check_seed(seed)
    _check_count("draws", draws, "random removals per query in the control")
    _check_count("batch", batch, "subsets per train_fn call")
    if not callable(train_fn):
        raise InvalidArgumentError(
            "train_fn must be your retraining function f(subsets, queries, seed) -> losses [subsets, queries]"
        )
    if len(set(ids)) < len(ids):
        raise InvalidArgumentError("train_ids holds an id more than once: pass each training example id once")
    size = removal_size(len(ids), fraction)
    matrices = {"scores": scores} if not isinstance(scores, Mapping) else dict(scores)
    if not matrices:
        raise InvalidArgumentError("scores is an empty mapping: pass at least one [queries, n_train] score matrix")
    checked = {}
    for label, matrix in matrices.items():
        matrix = np.asarray(matrix, dtype=np.float64)
        if matrix.shape != (len(queries), len(ids)):
            raise InvalidArgumentError(
                f"scores[{label!r}] has shape {matrix.shape}, expected [queries, train_ids] = "
                f"({len(queries)}, {len(ids)})"
            )
        if not np.isfinite(matrix).all():
            raise InvalidArgumentError(f"scores[{label!r}] holds NaN or Inf: score every (query, example) pair")
        checked[label] = matrix

    # the retraining plan: every distinct removal once, remembered by its sorted positions
    plan: dict[tuple[int, ...], int] = {}

    def slot(removed: np.ndarray) -> int:
        return plan.setdefault(tuple(np.sort(removed).tolist()), len(plan))

    random = random_removals(len(ids), size, queries, draws, seed)
    random_rows = np.array([[slot(r) for r in per_query] for per_query in random], dtype=np.int64).reshape(
        len(queries), draws
    )
    removed = {label: top_proponents(matrix, size) for label, matrix in checked.items()}
    proponent_rows = {label: np.array([slot(r) for r in rem], dtype=np.int64) for label, rem in removed.items()}

    everyone = np.arange(len(ids))
    kept = [[ids[i] for i in np.setdiff1d(everyone, np.array(key), assume_unique=True)] for key in plan]
    step = batch or len(kept)
    losses = np.empty((len(seeds), len(kept), len(queries)))
    for s_row, s in enumerate(seeds):
        for start in range(0, len(kept), step):
            chunk = kept[start : start + step]
            losses[s_row, start : start + len(chunk)] = retrained_losses(train_fn, chunk, list(queries), s)
    mean_losses = losses.mean(0)  # [retrainings, queries]
    columns = np.arange(len(queries))
    random_loss = mean_losses[random_rows, columns[:, None]].mean(1)
    if not np.isfinite(random_loss).all():
        raise InvalidArgumentError("train_fn returned NaN or Inf losses for the random control")
    results = {}
    for label, rows in proponent_rows.items():
        proponent_loss = mean_losses[rows, columns]
        if not np.isfinite(proponent_loss).all():
            raise InvalidArgumentError(f"train_fn returned NaN or Inf losses without {label!r}'s proponents")
        per_query = proponent_loss - random_loss
        stderr = float(per_query.std(ddof=1) / np.sqrt(len(per_query))) if len(per_query) > 1 else float("nan")
        results[label] = QLDResult(
            label=label,
            value=float(per_query.mean()),
            stderr=stderr,
            per_query=per_query,
            proponent_loss=proponent_loss,
            random_loss=random_loss,
            removed=removed[label],
            random=random,
            subsets=len(set(rows.tolist()) | set(random_rows.ravel().tolist())),
            seeds=seeds,
            fraction=float(fraction),
            seed=int(seed),
        )
    return results


def qld(
    store: GradStore,
    run: str,
    train_fn: TrainFn | None = None,
    *,
    queries: Sequence[str],
    methods: Mapping[str, Mapping[str, Any]] | None = None,
    fraction: float = 0.1,
    seeds: Sequence[int] = (0,),
    seed: int = 0,
    draws: int = 3,
    batch: int | None = None,
    write: bool = True,
) -> pa.Table:
    """Query loss difference (QLD) of each scored variant on stored query ids ``queries``.

    For every query and method, retrain without the query's top ``fraction`` proponents by the method's scores
    (``store.attribute`` with that method's options; ``methods`` maps label -> options, default grad-dot and
    fisher) and, as the control, without ``draws`` random sets of the same size; ``QLD_q`` is the query's loss
    in the first retraining minus its mean loss in the controls (losses averaged over ``seeds``). The row's
    ``value`` is the mean over queries, ``stderr`` its standard error; **higher is better** (removing what a
    method calls support raises the query's loss), 0 is chance. This is the proponent QLD of bergson's
    leaderboard (EleutherAI/bergson, LEADERBOARD.md: the mean increase in a query's loss after retraining
    without its top 1% proponents, with a 95% CI over queries) less its matched random control: the same size
    of removal at random, which that leaderboard reports beside it, is subtracted per query here. No normalised
    form is in common use; the figure is in the units of the query loss, so compare methods on one model and
    query set (a 95% interval is about ``value +- 1.96 stderr``).

    All removals of all queries and methods go to ``train_fn`` (the LDS contract) in one call per seed (or
    calls of at most ``batch`` subsets), each a list of kept training ids, all of one length. Rows go to the
    ``evaluations`` table (``metric="qld"``, ``fraction``; ``subsets``: the distinct retrainings per seed the
    value rests on, ``queries`` proponent removals and ``queries * draws`` controls; ``noise_ceiling`` empty)
    unless ``write=False``, and are returned. Scores come first, so an unknown query or method fails before
    any retraining. :func:`qld_of_scores` takes precomputed score matrices instead.
    """
    if train_fn is None:
        raise InvalidArgumentError(
            "qld needs a train_fn: your retraining function f(subsets, queries, seed) -> losses [subsets, queries]"
        )
    queries = _check_queries(queries)
    chosen = check_methods(methods)
    train_ids = training_ids(store, run)
    removal_size(len(train_ids), fraction)  # argument errors before any scoring
    _check_seeds(seeds)
    _check_seed(seed)
    _check_count("draws", draws, "random removals per query in the control")
    _check_count("batch", batch, "subsets per train_fn call")
    if not callable(train_fn):
        raise InvalidArgumentError(
            f"train_fn must be your retraining function f(subsets, queries, seed), got {type(train_fn).__name__}"
        )
    scores = {label: scores_by_example(store, run, queries, train_ids, **options) for label, options in chosen.items()}
    results = qld_of_scores(
        scores,
        train_fn,
        train_ids,
        queries=queries,
        fraction=fraction,
        seeds=seeds,
        seed=seed,
        draws=draws,
        batch=batch,
    )
    rows = [
        evaluation_row(
            chosen[label],
            label=label,
            metric="qld",
            value=result.value,
            stderr=result.stderr,
            noise_ceiling=None,
            queries=len(queries),
            subsets=result.subsets,
            seeds=result.seeds,
            fraction=result.fraction,
            seed=result.seed,
        )
        for label, result in results.items()
    ]
    return record_evaluation(store, run, rows, write)
