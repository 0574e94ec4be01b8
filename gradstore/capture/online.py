"""Online data selection during a store capture: score each step's examples against a target (the mean of a run's
stored query rows, a vector, or a function), drop or reweight the chosen ones before the optimizer step by
removing their exact contribution from ``.grad`` (:mod:`ingest.online_selection`), and record every decision in
the store's ``online_selection`` table (one row per example and step, queryable with ``store.sql``).

>>> with store.capture(model, "run-1", optimizer=opt) as cap, \\
...         select_online(cap, KeepTopFraction(0.5), target=query_target(store, "run-1")):
...     for x, y in loader:
...         loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
>>> store.sql("select step, count(*) filter (where kept) from online_selection group by step")
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gradstore.capture.session import StoreCapture
from gradstore.core import schema as S
from gradstore.core.filters import gradient_filter
from gradstore.errors import (
    CaptureUsageError,
    GradstoreError,
    InvalidArgumentError,
    UnknownRunError,
    surface,
    translated,
)
from ingest import online_selection as ingest_online
from ingest.online_selection import (
    OnlineSelector,
    RefreshedTarget,
    SelectionPolicy,
    StepDecision,
    Target,
)

__all__ = [
    "ONLINE_SELECTION",
    "DropBelowThreshold",
    "ExactRemovalError",
    "KeepTopFraction",
    "LossBased",
    "OnlineSelection",
    "RandomSelection",
    "RefreshedTarget",
    "SelectionPolicy",
    "StepDecision",
    "query_target",
    "select_online",
]

#: The table of decisions: one row per example and optimizer step (schema in :mod:`gradstore.core.schema`).
ONLINE_SELECTION = S.ONLINE_SELECTION


class ExactRemovalError(CaptureUsageError, ingest_online.ExactRemovalError):
    """The model has trainable parameters (LayerNorm, Conv2d, a bare ``nn.Parameter``) whose per-example
    contributions cannot be removed exactly: freeze them or select offline."""


def _translated(error: BaseException) -> GradstoreError | None:
    if isinstance(error, ingest_online.ExactRemovalError) and not isinstance(error, GradstoreError):
        return ExactRemovalError(*error.args)
    return translated(error)


def _checked(post_init: Any) -> None:
    """Run an ingest policy's ``__post_init__``: a refused argument raises gradstore's ``CaptureUsageError``."""
    try:
        post_init()
    except Exception as error:
        ours = _translated(error)
        if ours is None:
            raise
        raise ours from error


class KeepTopFraction(ingest_online.KeepTopFraction):
    """Keep the ``fraction`` (in ``(0, 1]``) of the step's examples with the highest scores (at least one)."""

    def __post_init__(self) -> None:
        _checked(super().__post_init__)


class DropBelowThreshold(ingest_online.DropBelowThreshold):
    """Drop the examples whose score is below ``threshold`` (a number, not NaN; ``-inf`` keeps every example)."""

    def __post_init__(self) -> None:
        _checked(super().__post_init__)


class LossBased(ingest_online.LossBased):
    """Keep the ``fraction`` of examples with the lowest loss (``keep="low"``) or the highest (``keep="high"``)."""

    def __post_init__(self) -> None:
        _checked(super().__post_init__)


class RandomSelection(ingest_online.RandomSelection):
    """Keep a uniformly random ``fraction`` of the step's examples (seeded by ``select_online(..., seed=)``)."""

    def __post_init__(self) -> None:
        _checked(super().__post_init__)


def query_target(
    store: Any, run: str, *, split: str = "query", checkpoint: str | None = None, where: str | None = None
) -> torch.Tensor:
    """The mean of run ``run``'s stored rows of ``split`` (default the query rows; ``checkpoint``/``where``
    narrow them) as a float64 ``[dim]`` target for :func:`select_online`."""
    core = getattr(store, "core", store)
    if not core.has_run(run):
        raise UnknownRunError(f"the store holds no run {run!r}: capture its query rows first (split='query')")
    block = core.read_gradients(run, split=split, checkpoint=checkpoint, where=where)
    if len(block) == 0:
        unfiltered = (
            0
            if where is None
            else core.tables.count(core.gradient_table_name(run), gradient_filter(run, checkpoint, split))
        )
        if unfiltered:
            raise InvalidArgumentError(
                f"where={where!r} matched none of run {run!r}'s {unfiltered} rows of split {split!r}"
                f"{'' if checkpoint is None else f' at {checkpoint!r}'}: loosen the filter, or pass target= a vector"
            )
        raise InvalidArgumentError(
            f"run {run!r} has no rows of split {split!r}{'' if checkpoint is None else f' at {checkpoint!r}'}: "
            "capture the target examples with store.capture(..., split='query') first, or pass target= a vector"
        )
    return torch.from_numpy(np.asarray(block.vectors, dtype=np.float64).mean(axis=0))


def _policy_text(policy: Any) -> str:
    if is_dataclass(policy):
        fields = {k: v for k, v in asdict(policy).items() if k not in ("needs_scores", "needs_loss")}
        return f"{type(policy).__name__}({json.dumps(fields, sort_keys=True, default=str)})"
    return type(policy).__name__


class OnlineSelection:
    """Context manager returned by :func:`select_online`: the running :class:`~ingest.online_selection.OnlineSelector`
    (``selector``) and the decision rows, committed to ``online_selection`` every ``commit_every`` steps,
    at :meth:`flush` and on exit. ``last_decision``, ``examples_seen`` and ``examples_kept`` report progress."""

    def __init__(self, capture: StoreCapture, selector: OnlineSelector, commit_every: int) -> None:
        self.capture = capture
        self.selector = selector
        self.commit_every = commit_every
        self._rows: list[dict[str, Any]] = []
        self._steps = 0
        self._policy = _policy_text(selector.policy)
        selector.on_decision = self._record

    @property
    def last_decision(self) -> StepDecision | None:
        """The latest step's decision."""
        return self.selector.last_decision

    @property
    def examples_seen(self) -> int:
        """Examples decided on so far (this rank)."""
        return self.selector.examples_seen

    @property
    def examples_kept(self) -> int:
        """Examples kept (weight not 0) so far (this rank)."""
        return self.selector.examples_kept

    def apply(self) -> StepDecision | None:
        """Decide now (before gradient clipping); see :meth:`ingest.online_selection.OnlineSelector.apply`."""
        try:
            return self.selector.apply()
        except Exception as error:
            ours = _translated(error)
            if ours is None:
                raise
            raise ours from error

    def __enter__(self) -> OnlineSelection:
        self.selector.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.selector.__exit__(*exc)
        self.flush()
        if exc and exc[1] is not None and (ours := _translated(exc[1])) is not None:
            raise ours from exc[1]

    def _record(self, decision: StepDecision) -> None:
        now = datetime.now(timezone.utc)
        n = len(decision.example_ids)
        scores = [None] * n if decision.scores is None else decision.scores.tolist()
        losses = [None] * n if decision.losses is None else decision.losses.tolist()
        for i, example_id in enumerate(decision.example_ids):
            weight = float(decision.weights[i])
            self._rows.append(
                {
                    "run_id": self.capture.run_id,
                    "step": decision.step,
                    "rank": decision.rank,
                    "example_id": str(example_id),
                    "kept": weight != 0,
                    "weight": weight,
                    "score": scores[i],
                    "loss": losses[i],
                    "renormalization": decision.renormalization,
                    "policy": self._policy,
                    "created_at": now,
                }
            )
        self._steps += 1
        if self._steps % self.commit_every == 0:
            self.flush()

    def flush(self) -> None:
        """Commit the buffered decision rows to the ``online_selection`` table."""
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        self.capture.store.results.append_table(
            ONLINE_SELECTION, pa.Table.from_pylist(rows, schema=S.ONLINE_SELECTION_SCHEMA)
        )


@surface
def select_online(
    capture: StoreCapture,
    policy: SelectionPolicy,
    target: Target = None,
    *,
    similarity: str = "dot",
    renormalize: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    collective: bool | None = None,
    seed: int = 0,
    commit_every: int = 50,
) -> OnlineSelection:
    """Select examples online in the training loop captured by ``capture`` (a running ``store.capture(...)``).

    At every optimizer step the step's examples are scored from their captured rows against ``target`` (a
    ``[dim]`` vector in the run's projected space, e.g. :func:`query_target`; or ``f(rows, losses) -> scores``),
    ``policy`` (:class:`KeepTopFraction`, :class:`DropBelowThreshold`, :class:`LossBased`,
    :class:`RandomSelection`, or any object with ``decide(n, scores, losses, generator)``) gives each a weight,
    and the dropped (weight 0) or reweighted examples' exact terms are removed from ``.grad`` before the step.
    ``renormalize=True``: the step equals one on the kept examples only (a mean over them for mean/token-mean
    losses); ``False``: dropped examples contribute nothing and the rest keep their ``1/B`` weight. The captured
    rows themselves are written as usual (every example's, dropped or not). Decisions go to the
    ``online_selection`` table every ``commit_every`` steps and on exit. Layers other than Linear, Embedding and
    Conv1D with trainable parameters are refused (:class:`ExactRemovalError`, a ``CaptureUsageError``); so are
    a capture with a ``grad_scaler`` and a ``target`` of the wrong dimension. Any other keyword, or a flag
    (``renormalize``, ``collective``) given anything but ``True``/``False`` (``None`` for ``collective``), is an
    ``InvalidArgumentError``.
    """
    if not isinstance(capture, StoreCapture):
        raise InvalidArgumentError(
            f"select_online needs the running store.capture(...) context, got {type(capture).__name__}"
        )
    if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
        raise InvalidArgumentError(f"commit_every must be a positive integer, got {commit_every!r}")
    try:
        selector = OnlineSelector(
            capture.capture,
            policy,
            target,
            similarity=similarity,
            renormalize=renormalize,
            optimizer=optimizer,
            collective=collective,
            seed=seed,
        )
    except Exception as error:
        ours = _translated(error)
        if ours is None:
            raise
        raise ours from error
    return OnlineSelection(capture, selector, commit_every)
