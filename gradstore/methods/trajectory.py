"""Trajectory-aware attribution from the store's own training history.

A store that captured *during* training holds every recorded step's per-example gradients at the weights of that
step, with the step's learning rate, and checkpoint passes along the way. Two methods score from that history:

* ``tracin-steps``: TracIn over the recorded training steps,
  ``score(q, z) = sum_t lr_t * s_t / B_t * q_c(t) . g_{z,t}``, where ``B_t`` is the number of rows of step ``t``
  (the batch: the loss is a mean over it), ``s_t`` the optimizer steps until the next recorded step (1 when
  every step was captured; rows captured every ``s``-th step stand for ``s`` steps) and ``q_c(t)`` the query
  gradient at the first checkpoint holding query rows at or after step ``t`` (the last one for later steps).
  Optimizer-aware when the rows were captured with ``normalizer="adam_factored"``: the rows are then the Adam
  update directions.
* ``source``: SOURCE (Bae et al. 2024) over the checkpoint passes. Training is cut into segments ending at the
  checkpoints ``l`` (``K_l`` steps since the previous one, mean learning rate ``lr_l`` recorded on the
  checkpoint); within a segment the curvature ``F_l`` (the projected Fisher of the checkpoint's rows, per layer
  block; its true-Fisher rows where it has them) and the gradients are taken constant, which makes the effect
  of up-weighting ``z`` on the final weights closed form:
  ``score(q, z) = sum_l 1/N_l q^T (prod_{l' > l} exp(-lr_l' K_l' F_l')) (I - exp(-lr_l K_l F_l)) F_l^-1 g_{z,l}``
  with ``N_l`` the checkpoint's training rows (an example's expected share of a step's mean loss).
  Queries are final-model gradients. No damping is needed: ``(1 - exp(-c x)) / x`` is finite at ``x = 0``.
  ``source-ekfac`` takes each checkpoint's EK-FAC (Kronecker eigenbasis, eigenvalues refitted on its rows) as
  ``F_l`` instead.

``where`` selects the rows scored: ``tracin-steps``'s in-loop rows (``B_t`` stays the step's batch), SOURCE's
checkpoint-pass rows (``F_l`` and ``N_l`` stay the whole pass's, so a filter leaving a pass without rows still
scores); one that selects none of them is an ``InvalidArgumentError``. ``tracin-steps`` reads split ``"train"``
only (any other ``split`` is refused); ``source`` scores the passes' rows of ``split`` but never
``"true-fisher"`` rows, its curvature rows (refused).

Both are sums over several rows of an example, computed as per-example scans on an engine (in this process or
on Ray, :func:`gradstore.search.scan_tasks.tracin_top_k`): the query side is prepared once per checkpoint (SOURCE's
segment terms are spectral functions of the fitted Fisher, :meth:`indexers.FisherPreconditioner.apply_function`),
each stored row is read once. ``dvemb`` (:mod:`gradstore.methods.dvemb`) uses the same recorded steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from gradstore.core import StoreCore, gradient_filter
from gradstore.core.engine import Engine
from gradstore.errors import InvalidArgumentError, UnstableStepWarning
from gradstore.methods import dynamics
from gradstore.methods.queries import Queries, QueryInput, resolve_queries, stored_queries
from gradstore.methods.registry import TRUE_FISHER_SPLIT, Method, ScoreOptions, resolve_method
from gradstore.methods.results import ScoreMatrix
from gradstore.methods.rows import check_where, row_checkpoints, row_values
from gradstore.methods.summed import (
    history_aggregates,
    history_matrix,
    history_self_influence,
    history_top_k,
    refuse_checkpoints,
)
from gradstore.preconditioning import Preconditioning
from gradstore.preconditioning.fitting import FitCache, Selection, fit_spec

#: One entry of a per-example sum: (row filter, prepared queries [q, dim] float64, per-step weights or None).
WeightedRows = tuple[str, torch.Tensor, "StepWeights | None"]


@dataclass(frozen=True)
class StepWeights:
    """A weight per recorded step (sorted ``steps``), looked up for the rows of a block by their ``step``."""

    steps: np.ndarray  # int64, ascending
    weights: np.ndarray  # float64

    def of(self, steps: np.ndarray) -> np.ndarray:
        """The weight of each row's step (0 for a step not listed)."""
        where = np.clip(np.searchsorted(self.steps, steps), 0, len(self.steps) - 1)
        return np.where(self.steps[where] == steps, self.weights[where], 0.0)


@dataclass(frozen=True)
class RecordedStep:
    """One optimizer step whose training rows were captured during training."""

    step: int
    rows: int  # B_t
    learning_rate: float
    span: int  # optimizer steps it stands for (until the next recorded step)
    coefficients: Any = None  # its optimizer's linearised dynamics (gradstore.methods.dynamics), None: lr x grad

    @property
    def weight(self) -> float:
        """``lr_t * s_t / B_t``: the first-order effect of one of its rows' loss weight on the weights."""
        return self.learning_rate * self.span / self.rows


# ---------------------------------------------------------------------------------------------- history
def in_loop_checkpoint(store: StoreCore, run: str, checkpoint: str | None = None) -> str:
    """The checkpoint label of ``run``'s training rows captured during training (``checkpoint`` when given): the
    label whose training rows span the most distinct steps, at least two."""
    steps = _step_counts(store, run)
    if checkpoint is not None:
        if steps.get(checkpoint, 0) < 2:
            raise InvalidArgumentError(
                f"checkpoint {checkpoint!r} of run {run!r} holds training rows of {steps.get(checkpoint, 0)} step(s); "
                "a trajectory method needs rows captured during training (two or more steps): "
                f"labels with their step counts: {steps}"
            )
        return checkpoint
    ranked = sorted(((n, str(c)) for c, n in steps.items() if c is not None and n >= 2), reverse=True)
    if not ranked:
        raise InvalidArgumentError(
            f"run {run!r} holds no training rows captured during training (two or more steps under one checkpoint "
            f"label; found {steps}): capture inside the training loop, e.g. `with store.capture(model, {run!r}, "
            "optimizer=optimizer):` around it, so each step's rows carry their step and learning rate"
        )
    return ranked[0][1]


def recorded_steps(store: StoreCore, run: str, label: str) -> list[RecordedStep]:
    """The steps of the in-loop rows under ``label``, in step order, with their row counts, learning rates and
    spans (the last step spans as many steps as the one before it)."""
    dynamics.check_descent(store, run)
    table = _train_rows(store, run, label)
    grouped = table.group_by("step").aggregate([("step", "count"), ("learning_rate", "mean")]).sort_by("step")
    steps = grouped.column("step").to_pylist()
    rates = grouped.column("learning_rate_mean").to_pylist()
    if any(step is None for step in steps):
        raise InvalidArgumentError(
            f"training rows of run {run!r} at {label!r} have no step: capture with the optimizer"
        )
    missing = [step for step, rate in zip(steps, rates) if rate is None]
    if missing:
        raise InvalidArgumentError(
            f"training rows of run {run!r} at {label!r} recorded no learning rate at steps {missing[:5]}: capture with "
            "optimizer=... (its learning rate is recorded on every row)"
        )
    spans = [b - a for a, b in zip(steps, steps[1:])]
    spans.append(spans[-1] if spans else 1)
    counts = grouped.column("step_count").to_pylist()
    return [RecordedStep(int(s), int(n), float(r), int(g)) for s, n, r, g in zip(steps, counts, rates, spans)]


def _train_rows(store: StoreCore, run: str, label: str | None) -> pa.Table:
    store.run(run)
    name = store.gradient_table_name(run)
    if not store.has_table(name):
        return pa.table({"checkpoint": pa.array([], pa.string()), "step": pa.array([], pa.int64())})
    return store.scan(name, ["checkpoint", "step", "learning_rate"], gradient_filter(run, label, "train"))


def checkpoint_steps(store: StoreCore, run: str) -> dict[str, tuple[int | None, float | None]]:
    """``checkpoint -> (step, learning rate)`` as recorded in the ``checkpoints`` table."""
    table = store.checkpoints(run)
    return {
        c: (s, r)
        for c, s, r in zip(
            table.column("checkpoint").to_pylist(),
            table.column("step").to_pylist(),
            table.column("learning_rate").to_pylist(),
        )
    }


def checkpoint_step_of(store: StoreCore, run: str, checkpoints: Sequence[str]) -> dict[str, int | None]:
    """Each of ``checkpoints``' step: the one recorded in the ``checkpoints`` table, else the one step its rows
    carry (a capture of query rows only, ``cap.set_step(step)`` given, records no checkpoint), else ``None``
    (rows of no step, or of several)."""
    recorded = {c: s for c, (s, _) in checkpoint_steps(store, run).items() if s is not None}
    missing = [c for c in checkpoints if c not in recorded]
    name = store.gradient_table_name(run)
    if missing and store.has_table(name):
        pairs = store.scan(name, ["checkpoint", "step"], gradient_filter(run, missing)).group_by(["checkpoint", "step"])
        carried: dict[str, set[int | None]] = {}
        for row in pairs.aggregate([]).to_pylist():
            carried.setdefault(row["checkpoint"], set()).add(row["step"])
        recorded.update({c: steps.pop() for c, steps in carried.items() if len(steps) == 1 and None not in steps})
    return {c: recorded.get(c) for c in checkpoints}


def record_steps_hint(run: str, checkpoints: Sequence[str]) -> str:
    """What to do about ``checkpoints`` of ``run`` that have no step (:func:`checkpoint_step_of`)."""
    return (
        f"record the step of each of {list(checkpoints)} with store.record_checkpoint({run!r}, checkpoint, "
        "step=...) (their rows carry no step, or several)"
    )


def final_query_checkpoint(store: StoreCore, run: str) -> str | None:
    """The checkpoint final-model queries are read at when no ``query_checkpoint`` is given: the checkpoint
    holding query rows with the largest step (``None`` when the run has no query rows: queries must be vectors)."""
    found = [c for c in row_checkpoints(store, run, "query") if c is not None]
    if len(found) < 2:
        return found[0] if found else None
    steps = _query_steps(store, run, found)
    return max(found, key=lambda c: (steps[c], c))


def _known_steps(store: StoreCore, run: str, checkpoints: list[str], holding: str, why: str) -> dict[str, int]:
    """The step of each of ``checkpoints`` (:func:`checkpoint_step_of`); ``InvalidArgumentError`` naming those
    without one: the run ``holding`` them, ``why`` a step is needed and what else to do."""
    steps = checkpoint_step_of(store, run, checkpoints)
    unknown = [c for c in checkpoints if steps[c] is None]
    if unknown:
        raise InvalidArgumentError(
            f"run {run!r} holds {holding} at {checkpoints}, {unknown} with no step: {why}"
            f"{record_steps_hint(run, unknown)}"
        )
    return {c: int(s) for c, s in steps.items() if s is not None}


def _query_steps(store: StoreCore, run: str, stored: list[str]) -> dict[str, int]:
    """The step of each of the checkpoints ``stored`` holding query rows (:func:`_known_steps`)."""
    return _known_steps(store, run, stored, "query rows", "pass query_checkpoint= (the final model's) or ")


def final_queries(store: StoreCore, queries: QueryInput, run: str, query_checkpoint: str | None) -> Queries:
    """The final-model queries of a trajectory method: stored queries at ``query_checkpoint`` when given (refused,
    as by every method, when it selects no stored query rows or the queries are vectors), else at
    :func:`final_query_checkpoint`."""
    if query_checkpoint is not None:
        return resolve_queries(store, queries, run, None, query_checkpoint)
    return resolve_queries(store, queries, run, final_query_checkpoint(store, run))


def final_training_checkpoint(store: StoreCore, run: str, split: str) -> str:
    """The checkpoint pass holding ``split`` rows with the largest step (the only one, step or not): the final
    model's gradients of the training examples, what trajectory self-influence scores."""
    in_loop = _in_loop_labels(store, run)
    passes = [c for c in row_checkpoints(store, run, split) if c is not None and c not in in_loop]
    if len(passes) == 1:
        return passes[0]
    if not passes:
        raise InvalidArgumentError(
            f"run {run!r} has no checkpoint pass of {split!r} rows: trajectory self-influence scores each example's "
            "final-model gradient; capture a checkpoint pass of the training set at the end of training "
            "(store.capture(model, run, checkpoint='final') with cap.set_step(step))"
        )
    why = "trajectory self-influence scores each example's row at the last one; "
    steps = _known_steps(store, run, passes, f"checkpoint passes of {split!r} rows", why)
    return max(passes, key=lambda c: (steps[c], c))


def refuse_split(method: str, split: str) -> None:
    """``InvalidArgumentError`` unless ``split`` is ``"train"``: ``method`` (``tracin-steps``, ``dvemb``) sums the
    rows captured during training, which are the run's ``"train"`` rows (the steps, their batch sizes and learning
    rates come from them; a step's true-Fisher rows are its curvature, used without asking)."""
    if split == "train":
        return
    fisher = (
        f"; {TRUE_FISHER_SPLIT!r} rows are curvature rows, which it reads for each step's curvature where a step "
        "has them, without split="
        if method == "dvemb"
        else f"; {TRUE_FISHER_SPLIT!r} rows are curvature rows, never scored"
    )
    raise InvalidArgumentError(
        f"method={method!r} scores the training rows captured during training, split 'train', and does not use "
        f"split={split!r}{fisher}: drop split= (to score other rows, use a single-checkpoint method such as "
        "'fisher' with split=...)"
    )


def require_in_loop_rows(store: StoreCore, method: str, selection: Selection) -> None:
    """``InvalidArgumentError`` naming the user's run, label and filter when the in-loop rows ``selection`` (of
    ``method``'s sum) match nothing: an empty selection is refused, never an empty answer."""
    if selection.where is None or selection.count(store):
        return
    raise InvalidArgumentError(
        f"where={selection.where!r} matches none of the {selection.split!r} rows of run {selection.run!r} captured "
        f"during training (checkpoint label {selection.checkpoint!r}), the rows method={method!r} sums: widen the "
        "filter or drop where="
    )


def _in_loop_labels(store: StoreCore, run: str) -> set[str]:
    """Checkpoint labels whose training rows span two or more steps (rows captured during training)."""
    return {c for c, n in _step_counts(store, run).items() if n > 1}


def _step_counts(store: StoreCore, run: str) -> dict[str | None, int]:
    """``checkpoint label -> distinct steps`` of the run's training rows."""
    counts = _train_rows(store, run, None).group_by("checkpoint").aggregate([("step", "count_distinct")])
    return {row["checkpoint"]: row["step_count_distinct"] or 0 for row in counts.to_pylist()}


# ---------------------------------------------------------------------------------------------- tracin-steps
@dataclass
class History:
    """A per-example sum over stored history: the query ids, its terms, the rows it reads (their first
    selection sizes the scan's shards), the metadata columns its scan needs and the checkpoints it used."""

    query_ids: list[str]
    entries: list[WeightedRows]
    selection: Selection
    columns: tuple[str, ...]
    checkpoints: list[str]


def history(store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, run: str) -> History:
    """The per-example sum of a ``tracin-steps`` or ``source`` call (``options`` checked by the caller)."""
    method = resolve_method(options.method)
    if method.trajectory == "steps":
        label = in_loop_checkpoint(store, run, options.checkpoint)
        selection = Selection(run, label, options.split, options.where)
        ids, entries = tracin_steps_entries(store, queries, selection, options.query_checkpoint)
        return History(ids, entries, selection, ("example_id", "step"), [label])
    segments = source_segments(store, run, options.checkpoints, options.split)
    ids, entries = source_entries(store, fits, queries, segments, options, run)
    first = Selection(run, segments[0].checkpoint, options.split, options.where)
    return History(ids, entries, first, ("example_id",), [s.checkpoint for s in segments])


def tracin_steps_entries(
    store: StoreCore, queries: QueryInput, selection: Selection, query_checkpoint: str | None
) -> tuple[list[str], list[WeightedRows]]:
    """The per-example sum of ``tracin-steps`` over the in-loop rows ``selection``: query ids and one entry per
    checkpoint whose queries score the steps up to it (every step when the queries are vectors)."""
    run = selection.run
    steps = recorded_steps(store, run, selection.checkpoint)
    where = selection.filter
    stored = [c for c in row_checkpoints(store, run, "query") if c is not None]
    if query_checkpoint is not None or len(stored) < 2 or not stored_queries(queries):
        resolved = final_queries(store, queries, run, query_checkpoint)
        return resolved.ids, [(where, _float64(resolved), _weights(steps))]
    bounds = _query_checkpoints(store, run, stored)
    entries, ids, low = [], None, None
    for position, (name, step) in enumerate(bounds):
        last = position == len(bounds) - 1
        chosen = [s for s in steps if (low is None or s.step > low) and (last or s.step <= step)]
        low = step
        if not chosen:
            continue
        resolved = resolve_queries(store, queries, run, name)
        resolved = _same_order(resolved, ids)
        ids = resolved.ids
        entries.append((where, _float64(resolved), _weights(chosen)))
    return ids or [], entries


def _query_checkpoints(store: StoreCore, run: str, stored: list[str]) -> list[tuple[str, int]]:
    """Checkpoints holding query rows, by their step (the last one scores every later step)."""
    steps = _query_steps(store, run, stored)
    return [(c, steps[c]) for c in sorted(stored, key=lambda c: (steps[c], c))]


def _same_order(resolved: Queries, ids: list[str] | None) -> Queries:
    if ids is None or resolved.ids == ids:
        return resolved
    position = {q: i for i, q in enumerate(resolved.ids)}
    missing = [q for q in ids if q not in position]
    if missing:
        raise InvalidArgumentError(f"queries {missing[:5]} have no rows at every query checkpoint")
    return Queries(ids, resolved.vectors[[position[q] for q in ids]])


def _weights(steps: Sequence[RecordedStep]) -> StepWeights:
    return StepWeights(np.array([s.step for s in steps], np.int64), np.array([s.weight for s in steps], np.float64))


def _float64(resolved: Queries) -> torch.Tensor:
    return torch.from_numpy(np.asarray(resolved.vectors, np.float64))


# ---------------------------------------------------------------------------------------------- source
@dataclass(frozen=True)
class Segment:
    """SOURCE's segment ending at ``checkpoint``: ``steps`` optimizer steps at mean learning rate ``learning_rate``."""

    checkpoint: str
    end: int
    steps: int
    learning_rate: float


def source_segments(store: StoreCore, run: str, checkpoints: Sequence[str] | None, split: str) -> list[Segment]:
    """The segments of ``run``: ``checkpoints`` (default: every checkpoint with a recorded step and learning rate
    and training rows of one step, not in-loop rows) in step order, each from the previous one's step."""
    recorded = checkpoint_steps(store, run)
    with_rows = set(row_checkpoints(store, run, split))
    if checkpoints is None:
        in_loop = _in_loop_labels(store, run)
        chosen = [
            c
            for c, (step, rate) in recorded.items()
            if step is not None and rate is not None and c in with_rows and c not in in_loop
        ]
        if not chosen:
            passes = [
                c for c, (step, rate) in recorded.items() if step is not None and rate is not None and c not in in_loop
            ]
            if passes:
                held = row_values(store, run, "split", passes)
                raise InvalidArgumentError(
                    f"run {run!r} holds no {split!r} rows at its checkpoint passes {sorted(passes)}: source scores "
                    f"each pass's rows of split={split!r} (they hold {held}); pass one of those splits (the default, "
                    "'train': the training examples)"
                )
            raise InvalidArgumentError(
                f"run {run!r} has no checkpoint pass with a recorded step and learning rate: capture checkpoint "
                "passes (store.capture(model, run, checkpoint=..., learning_rate=...) with cap.set_step(step)) or "
                "give checkpoints="
            )
    else:
        chosen = list(checkpoints)
        bad = [c for c in chosen if recorded.get(c, (None, None))[0] is None or recorded[c][1] is None]
        if bad:
            raise InvalidArgumentError(f"checkpoints {bad} of run {run!r} have no recorded step and learning rate")
        missing = [c for c in chosen if c not in with_rows]
        if missing:
            raise InvalidArgumentError(f"checkpoints {missing} of run {run!r} hold no {split!r} rows")
    ordered = sorted(chosen, key=lambda c: (recorded[c][0], c))
    segments, previous = [], 0
    for name in ordered:
        end = int(recorded[name][0])
        segments.append(Segment(name, end, max(0, end - previous), float(recorded[name][1])))
        previous = end
    return segments


def source_entries(
    store: StoreCore,
    fits: FitCache,
    queries: QueryInput,
    segments: Sequence[Segment],
    options: ScoreOptions,
    run: str,
) -> tuple[list[str], list[WeightedRows]]:
    """SOURCE's per-example sum: query ids and, per segment, the prepared queries
    ``(I - E_l) F_l^-1 E_{l+1} ... E_L q`` scoring its checkpoint's training rows."""
    resolved = final_queries(store, queries, run, options.query_checkpoint)
    carried = _float64(resolved)
    moment = None  # the momentum's row of the carried product, once a segment with momentum was recorded
    recorded = dynamics.segment_coefficients(store, run, [(s.end - s.steps, s.end) for s in segments])
    entries: list[WeightedRows] = []
    clipped: list[str] = []
    for segment, co in zip(reversed(segments), reversed(recorded)):
        selection = Selection(run, segment.checkpoint, options.split, options.where)
        whole = Selection(run, segment.checkpoint, options.split)  # where picks the scored rows, not the dynamics
        curvature = fits.get(fit_spec(store, whole, resolve_method(options.method), options.blocks))
        examples = whole.count(store)  # N_l: one step's share is 1/N_l
        if co is None and moment is None:
            horizon = segment.learning_rate * segment.steps
            prepared = curvature.apply_function(carried, _segment_term(horizon)) / examples
            entries.append((selection.filter, prepared, None))
            carried = curvature.apply_function(carried, lambda values, c=horizon: torch.exp(-c * values))
            continue
        # the optimizer's discrete dynamics over the segment (gradstore.methods.dynamics.SegmentFunctions)
        functions = dynamics.SegmentFunctions(co or dynamics.Coefficients.plain(segment.learning_rate), segment.steps)
        prepared = -curvature.apply_function(carried, functions.entry(4))
        following = curvature.apply_function(carried, functions.entry(0))
        new_moment = curvature.apply_function(carried, functions.entry(1))
        if moment is not None:
            prepared -= curvature.apply_function(moment, functions.entry(5))
            following += curvature.apply_function(moment, functions.entry(2))
            new_moment += curvature.apply_function(moment, functions.entry(3))
        entries.append((selection.filter, prepared / examples, None))
        carried, moment = following, new_moment
        if functions.clipped:
            clipped.append(
                f"{segment.checkpoint} (largest eigenvalue {functions.largest:.4g}, bound {functions.bound:.4g})"
            )
    if clipped:
        warnings.warn(
            f"source on run {run!r}: the curvature of segment(s) {clipped[::-1]} makes the linearised recursion expand "
            "beyond what training did (the step operator's eigenvalues leave the unit disc); those eigenvalues were "
            "clipped to the stable bound (docs/concepts.md, 'Optimizer dynamics and stability')",
            UnstableStepWarning,
            stacklevel=2,
        )
    return resolved.ids, entries[::-1]


def _segment_term(horizon: float):
    """``x -> (1 - exp(-c x)) / x`` (``c`` at ``x = 0``), elementwise on float64 eigenvalues."""

    def term(values: torch.Tensor) -> torch.Tensor:
        scaled = horizon * values
        safe = torch.where(scaled > 1e-12, values, torch.ones_like(values))
        return torch.where(scaled > 1e-12, -torch.expm1(-scaled) / safe, torch.full_like(values, horizon))

    return term


# ---------------------------------------------------------------------------------------------- the family
HISTORY_OPERATIONS = frozenset({"attribute", "score_matrix", "self_influence", "select"})


class HistorySum(Method):
    """A method whose scores sum per example over the run's training history (:meth:`history`): its
    self-influence and its selection are those sums', whatever builds them (:class:`Trajectory`, and
    :class:`gradstore.methods.dvemb.Embeddings` over the embeddings it keeps)."""

    @property
    def reads_history(self) -> bool:
        return True

    def check_selection(self, store: StoreCore, options: ScoreOptions, run: str) -> None:
        """``InvalidArgumentError`` for a ``split`` the method does not read or a ``where`` that selects none of
        the rows it sums (checked once per call, on the caller's selection: not per chunk of a scan)."""
        check_where(store, run, options.where)

    def history(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, run: str
    ) -> History:
        """The per-example sums of ``queries`` over the history, ready to scan."""
        raise NotImplementedError

    def self_influence(
        self, store: StoreCore, fits: FitCache, options: ScoreOptions, *, run: str, engine: Engine
    ) -> pa.Table:
        self.check_selection(store, options, run)
        return history_self_influence(
            store,
            lambda store, queries, options, run: self.history(store, fits, queries, options, run),
            options,
            final=final_training_checkpoint(store, run, options.split),
            method=self.name,
            run=run,
            engine=engine,
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
        refuse_checkpoints(self, options)
        self.check_selection(store, options, run)
        return history_aggregates(store, self.history(store, fits, target, options, run), aggregate, engine)


@dataclass(frozen=True)
class Trajectory(Preconditioning, HistorySum):
    """A method summing per example over the run's training history: over the recorded training steps
    (``trajectory="steps"``: ``tracin-steps``) or over the segments between checkpoint passes (``"segments"``:
    ``source``, ``source-ekfac``), as :func:`history` computes. Its :class:`~gradstore.preconditioning.Preconditioning`
    is the curvature each segment fits (identity for the steps)."""

    summary: str = ""
    requires: str = ""
    operations: frozenset[str] = HISTORY_OPERATIONS
    trajectory: Literal["steps", "segments"] = field(default="steps", kw_only=True)

    @property
    def uses(self) -> frozenset[str]:
        used = {"checkpoint" if self.trajectory == "steps" else "checkpoints", "query_checkpoint"}
        if self.damped:
            used.add("damping")
        if self.blocked:
            used.add("blocks")
        return frozenset(used)

    def check_selection(self, store: StoreCore, options: ScoreOptions, run: str) -> None:
        check_where(store, run, options.where)
        if self.trajectory == "steps":
            refuse_split(self.name, options.split)
            label = in_loop_checkpoint(store, run, options.checkpoint)
            require_in_loop_rows(store, self.name, Selection(run, label, options.split, options.where))
            return
        if options.split == TRUE_FISHER_SPLIT:
            raise InvalidArgumentError(
                f"method={self.name!r} does not score split={TRUE_FISHER_SPLIT!r}: those rows (labels sampled from "
                "the model) are curvature rows, which it fits each segment's curvature on where a checkpoint pass "
                "has them, without split=; drop split= to score the training rows ('train')"
            )
        segments = source_segments(store, run, options.checkpoints, options.split)
        if options.where is None:
            return
        if not any(Selection(run, s.checkpoint, options.split, options.where).count(store) for s in segments):
            raise InvalidArgumentError(
                f"where={options.where!r} matches none of the {options.split!r} rows of run {run!r} at its checkpoint "
                f"passes {[s.checkpoint for s in segments]}, the rows method={self.name!r} scores: widen the filter "
                "or drop where="
            )

    def history(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, run: str
    ) -> History:
        return history(store, fits, queries, options, run)

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
        self.check_selection(store, options, run)
        summed = history(store, fits, queries, options, run)
        return history_top_k(store, summed, method=self.name, run=run, k=k, opponents=opponents, engine=engine)

    def matrix(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
    ) -> ScoreMatrix:
        self.check_selection(store, options, run)
        return history_matrix(store, history(store, fits, queries, options, run))
