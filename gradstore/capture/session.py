"""``store.capture``: stream an unchanged training loop's per-example gradients into a store run.

A thin composition of :class:`ingest.GradientCapture` (hooks, per-example math, projection) and the
store's :class:`~gradstore.core.writer.GradientWriter` (buffered background commits). The run's projection
spec is recorded on first use and checked on every later capture into the same run (training rows,
checkpoint passes and query rows must share one projection).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradstore.capture.optimizer_state import (
    ParameterGroups,
    StepGradients,
    StepWeights,
    check_parameter,
    step_record,
    weights_fingerprint,
)
from gradstore.capture.resume import CommittedRows
from gradstore.core import GradientWriter, StoreCore, WriterConfig
from gradstore.core import schema as S
from gradstore.core.catalog import check_run_name
from gradstore.core.run_basis import run_basis, save_basis
from gradstore.errors import GradstoreError, InvalidArgumentError, InvalidNameError, NonFiniteGradientError, translated
from ingest import CaptureConfig, CapturedBatch, GradientCapture, ProjectionSpec
from ingest.capture import NonFiniteRowsError, SkippedBatch
from ingest.coverage import Coverage
from ingest.curvature import CURVATURE_SPLITS

#: Options that define a run's vectors (or how its loss was formed): later captures of the run reuse them.
RUN_OPTIONS = (
    "projection",
    "k_in",
    "k_out",
    "seed",
    "layer_types",
    "include",
    "exclude",
    "include_frozen",
    "route",
    "layer_sizes",
    "loss_reduction",
    "loss_scale",
)


@dataclass(frozen=True)
class StepRows:
    """One captured backward's rows as a per-step hook (:meth:`StoreCapture.on_rows`) sees them."""

    ids: list[Any] | None  # the examples' ids as set (None: content hashes, computed when written)
    step: int
    split: str
    rows: torch.Tensor  # [B, dim] float32 projected per-example gradients on the model's device (read only)


class RunDefault:
    """The default of a capture option that a run remembers: the run's own value, else the library default."""

    def __repr__(self) -> str:
        return "<the run's own>"


RUN_DEFAULT: Any = RunDefault()


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's parameter names, shapes and dtypes (its architecture, not its weights)."""
    text = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters())
    return f"{type(model).__name__}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def config_for_run(store: StoreCore, run: str, overrides: dict[str, Any]) -> CaptureConfig:
    """The capture config of ``run`` from flat options (:meth:`ingest.CaptureConfig.from_options`): the run's
    own :data:`RUN_OPTIONS` and basis (a new run: the defaults) with ``overrides`` applied; options given as
    :data:`RUN_DEFAULT` are not overrides."""
    overrides = {k: v for k, v in overrides.items() if v is not RUN_DEFAULT}
    saved: dict[str, Any] = {}
    if store.has_run(run):
        stored = store.run_config(run).get("capture", {})
        saved = {k: v for k, v in stored.items() if k in RUN_OPTIONS}
        saved["basis"] = run_basis(store, run)
    try:
        config = CaptureConfig.from_options(**{**saved, **overrides})
        config.validate()
    except TypeError as error:
        raise InvalidArgumentError(f"unknown capture option: {error}") from error
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from error
    return config


def capture_config(store: StoreCore, run: str, config: CaptureConfig | None, keywords: dict[str, Any]) -> CaptureConfig:
    """The config a capture of ``run`` runs with: ``config`` when the caller built one (a keyword among the flat
    ``keywords`` set away from its default to another value than ``config`` holds is an ``InvalidArgumentError``
    saying what to do), else the run's own options with ``keywords`` applied (:func:`config_for_run`)."""
    if config is None:
        return config_for_run(store, run, keywords)
    if not isinstance(config, CaptureConfig):
        raise InvalidArgumentError(f"capture takes config=ingest.CaptureConfig(...), got {type(config).__name__}")
    held = {**config.options(), "basis": config.projection.basis}
    defaults = CaptureConfig().options()
    for name, value in keywords.items():
        if value is RUN_DEFAULT or value is held[name]:
            continue
        if name != "basis" and (value == held[name] or value == defaults.get(name, value)):  # bases: by identity
            continue
        raise InvalidArgumentError(
            f"capture got config= and {name}={value!r}, which differs from the config's {held[name]!r}: give it "
            f"once, in the config (ingest.CaptureConfig) or as keywords only"
        )
    try:
        config.validate()
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from error
    return config


def explicit_options(config: CaptureConfig | None, keywords: dict[str, Any]) -> list[str]:
    """The :data:`RUN_OPTIONS` a capture's caller set (recorded with a new run: a later reader such as
    ``store.replay`` tells them from the library's defaults): the flat ``keywords`` not left at
    :data:`RUN_DEFAULT`, or, with a ``config`` built whole, those it holds away from ``CaptureConfig()``'s."""
    if config is None:
        return sorted(name for name in RUN_OPTIONS if keywords.get(name, RUN_DEFAULT) is not RUN_DEFAULT)
    held, defaults = config.options(), CaptureConfig().options()
    return sorted(name for name in RUN_OPTIONS if name in held and held[name] != defaults.get(name))


def check_learning_rate(learning_rate: float | None) -> float | None:
    """``learning_rate`` if it is ``None`` or a finite number >= 0."""
    if learning_rate is None:
        return None
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not learning_rate >= 0:
        raise InvalidArgumentError(f"learning_rate must be a finite number >= 0, got {learning_rate!r}")
    if not math.isfinite(learning_rate):
        raise InvalidArgumentError(f"learning_rate must be a finite number >= 0, got {learning_rate!r}")
    return float(learning_rate)


class StoreCapture:
    """Context manager returned by :meth:`GradStore.capture` (``explicit``: the run options its caller set,
    :func:`explicit_options`, recorded with a new run); forwards the controls of
    :class:`ingest.GradientCapture` (``set_ids``, ``set_epoch``, ``set_step``, ``set_checkpoint``,
    ``set_split``, ``pause``/``resume``/``paused``, ``flush``).

    Training batches whose gradients hold NaN/Inf, or whose step the ``grad_scaler`` skipped, are not written:
    each is a row of the store's ``skipped_steps`` table (``on_nonfinite="skip"``, the default) and the first
    one is warned about (:class:`ingest.capture.SkippedStepWarning`); ``steps_skipped``/``rows_dropped`` count
    them."""

    def __init__(
        self,
        store: StoreCore,
        model: nn.Module,
        run: str,
        config: CaptureConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        per_example_loss: Callable[..., torch.Tensor] | None = None,
        grad_scaler: Any | None = None,
        learning_rate: float | None = None,
        writer_config: WriterConfig | None = None,
        resume: bool = False,
        explicit: Sequence[str] | None = None,
    ) -> None:
        self.store = store
        self._explicit = None if explicit is None else sorted(explicit)
        self.run_id = check_run_name(run)
        self.learning_rate = check_learning_rate(learning_rate)
        self.capture = GradientCapture(
            model,
            self._write,
            config,
            optimizer=optimizer,
            per_example_loss=per_example_loss,
            grad_scaler=grad_scaler,
            on_skip=self._record_skip,
        )
        self.capture.skip_note = (
            f" (run {run!r}: they are listed in the store's skipped_steps table, "
            "store.sql('select * from skipped_steps'))."
        )
        self.spec: ProjectionSpec = self.capture.spec
        self._optimizer_rows: list[dict[str, Any]] = []  # optimizer_steps rows not written yet
        self.capture.add_step_listener(self._record_optimizer_step)
        self._grad_scaler = grad_scaler
        self._gradients: StepGradients | None = None  # checks each step's gradients (from the first step seen)
        self._step_hook: Any = None
        self._checked_parameter: torch.Tensor | None = None
        self._checked_optimizer: torch.optim.Optimizer | None = None
        self._model = model
        self._groups = ParameterGroups(model)
        self._weights = StepWeights()  # how each step weighted its training rows
        self.capture.add_row_listener(self._weigh_rows)
        self._initial_state: str | None = None  # whether the optimizer held state before the first step
        self._first_step_hook: Any = None
        self._initial_weights: str | None = None  # the weights' fingerprint before the first step, until recorded
        self._writer_config = writer_config
        self._writer = None
        self._seen: dict[str, dict[str, Any]] = {}  # checkpoint -> last step/epoch/lr of its training rows
        self._committed = CommittedRows(store, run) if resume else None
        self.rows_written = 0
        self.rows_skipped = 0  # rows of re-run steps already in the store (resume=True)
        self.steps_skipped = 0  # training batches not written: non-finite, or their step skipped by the scaler
        self.rows_dropped = 0  # their rows

    # ------------------------------------------------------------------ context
    def __enter__(self) -> StoreCapture:
        try:
            return self._enter()
        except Exception as error:
            ours = translated(error)
            if ours is None:
                raise
            raise ours from error

    def _enter(self) -> StoreCapture:
        basis = self.capture.config.projection.basis
        if basis is not None:
            save_basis(self.store, self.spec, basis)
        config: dict[str, Any] = {"capture": self.capture.config.options()}
        if self._explicit is not None:
            config["explicit_options"] = self._explicit
        self.store.catalog.ensure_run(self.run_id, self.spec, model_fingerprint(self._model), config)
        self._writer = self._open_writer()
        try:
            self.capture.__enter__()
        except BaseException:
            self._writer.close()
            raise
        self._watch_steps()
        self._first_step_hook = register_optimizer_step_pre_hook(self._before_first_step)
        return self

    def _before_first_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the first step of an optimizer of the model's parameters: the weights' fingerprint
        (:func:`~gradstore.capture.optimizer_state.weights_fingerprint`), recorded with the step's row."""
        ours = self.capture.optimizer
        if optimizer is ours or (ours is None and self._groups.trains(optimizer)):
            self._initial_weights = weights_fingerprint(self._model)
            held = any(optimizer.state.get(p) for p in self._groups.trained(optimizer))
            self._initial_state = "held" if held else "empty"
            self._first_step_hook.remove()
            self._first_step_hook = None

    def _watch_steps(self) -> None:
        """Check each optimizer step's gradients against the backward's (:class:`StepGradients`), from a step
        pre-hook: the capture's optimizer's, or, without one, every optimizer's until one steps over the checked
        parameter (that first step is not checked: the parameter's hook is set then). Not in a distributed capture
        (the optimizer steps on the ranks' averaged gradients)."""
        parameter = check_parameter(self.capture.layer_hooks)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if parameter is None or (distributed and torch.distributed.get_world_size() > 1):
            return
        self._checked_parameter = parameter
        optimizer = self.capture.optimizer
        if optimizer is None:
            self._step_hook = register_optimizer_step_pre_hook(self._before_step)
            return
        self._gradients = StepGradients(parameter, self._grad_scaler)
        self._checked_optimizer = optimizer
        self._step_hook = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._gradients is not None:
            if optimizer is self._checked_optimizer:
                self._gradients.before_step()
        elif any(p is self._checked_parameter for group in optimizer.param_groups for p in group["params"]):
            self._gradients = StepGradients(self._checked_parameter, self._grad_scaler)
            self._checked_optimizer = optimizer

    def _unwatch_steps(self) -> None:
        if self._first_step_hook is not None:
            self._first_step_hook.remove()
            self._first_step_hook = None
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._gradients is not None:
            self._gradients.remove()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._unwatch_steps()
        try:
            try:
                self.capture.__exit__(exc_type, exc, tb)  # drains every finished batch into the writer
            finally:
                self._writer.close()
        except Exception as error:
            ours = translated(error)
            if ours is None:
                raise
            raise ours from error
        self._record_run()
        if exc is None:
            self._record_coverage()  # a capture stopped by an error changes no table beyond the rows it wrote
        if exc is not None and (ours := _translated(exc)) is not None:
            raise ours from exc

    def _open_writer(self) -> GradientWriter:
        """The writer this capture's rows go to (distributed captures stage them instead of committing)."""
        return self.store.writer(self.run_id, self._writer_config)

    def _record_run(self) -> None:
        """Record the checkpoints seen (step, epoch, learning rate) and their curvature statistics (of the training
        rows and, apart, of the true-Fisher rows): added to the checkpoint's, or, where none are captured, the saved
        ones checked against its rows (:meth:`~gradstore.core.curvature_files.Curvature.record_capture`)."""
        self._write_optimizer_steps()
        for checkpoint, seen in self._seen.items():
            self.store.record_checkpoint(self.run_id, checkpoint, **seen)
        checkpoints = [*self._seen, self.capture.checkpoint]  # true-Fisher rows alone leave no checkpoint seen
        captured = {}
        if self.capture.config.curvature:
            captured = {(c, split): self.capture.curvature(c, split) for c in checkpoints for split in CURVATURE_SPLITS}
        committed = self._committed  # resume=True: the committed rows it replays
        self.store.curvature.record_capture(
            self.run_id,
            checkpoints,
            captured,
            trained=set(self._seen),
            resumed_from=None if committed is None else committed.from_step,
            committed=() if committed is None else committed.keys,
            skipped=self.rows_skipped,
        )

    def _record_optimizer_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step: what it applied (:mod:`gradstore.capture.optimizer_state`; whether its
        gradients were the backward's, :class:`StepGradients`), written with the checkpoints (and on :meth:`flush`)."""
        row = step_record(
            optimizer,
            self.capture.layer_hooks,
            self.run_id,
            self.capture.checkpoint,
            step,
            self.capture.config.labels.rank,
            self.capture.config.normalizer,
        )
        if self._gradients is not None:
            self._gradients.mark(row)
        self._groups.mark(row, optimizer)
        self._weights.mark(row)
        row["initial_weights"], self._initial_weights = self._initial_weights, None
        row["initial_state"], self._initial_state = self._initial_state, None
        self._optimizer_rows.append(row)

    def _weigh_rows(self, batch: Any, rows: torch.Tensor) -> None:
        """A captured backward's rows: a training batch's per-example scales count in its step's weights."""
        if batch.meta.get("split") == "train":
            self._weights.add(batch.scales)

    def _write_optimizer_steps(self) -> None:
        self._weights.resolve()
        if self._gradients is not None:
            self._gradients.resolve()
        if self._optimizer_rows:
            table = pa.Table.from_pylist(self._optimizer_rows, schema=S.OPTIMIZER_STEPS_SCHEMA)
            self.store.results.append_table(S.OPTIMIZER_STEPS, table)
            self._optimizer_rows = []

    def _record_coverage(self) -> None:
        """The capture's coverage: a row per trainable parameter in ``capture_coverage``."""
        now = datetime.now(timezone.utc)
        rows = [
            {
                "run_id": self.run_id,
                "checkpoint": self.capture.checkpoint,
                "split": self.capture.split,
                "rank": self.capture.config.labels.rank,
                "parameter": p.name,
                "numel": p.numel,
                "captured": p.captured,
                "slot": p.slot,
                "how": p.how,
                "reason": p.reason,
                "created_at": now,
            }
            for p in self.capture.coverage.parameters
        ]
        if rows:
            self.store.results.append_table(S.COVERAGE, pa.Table.from_pylist(rows, schema=S.COVERAGE_SCHEMA))

    @property
    def coverage(self) -> Coverage:
        """Which trainable parameters this capture records, how, and why the others are not
        (:class:`ingest.coverage.Coverage`; ``.summary()``, ``.parameters``, ``.fraction``)."""
        return self.capture.coverage

    def on_rows(self, hook: Callable[[StepRows], None]) -> Callable[[], None]:
        """Call ``hook(rows)`` with every captured backward's per-example rows (a :class:`StepRows`), on the
        training thread, before the optimizer step and before they are written: act on gradients during training
        (online data selection is built on it). Returns a function that removes the hook."""

        def listener(batch: Any, rows: torch.Tensor) -> None:
            meta = batch.meta
            ids = meta["ids"].tolist() if isinstance(meta["ids"], torch.Tensor) else meta["ids"]
            hook(StepRows(ids, meta["step"], meta["split"], rows))

        return self.capture.add_row_listener(listener)

    # ------------------------------------------------------------------ controls
    @property
    def step(self) -> int:
        """The step recorded on the next rows (optimizer steps counted so far, or as set)."""
        return self.capture.step

    def set_ids(self, ids: Sequence[Any] | torch.Tensor) -> None:
        """Example ids of the next forward (instead of an ``example_id`` batch entry or content hashes)."""
        self.capture.set_ids(ids)

    def set_epoch(self, epoch: int) -> None:
        """Epoch recorded on the following rows."""
        self.capture.set_epoch(epoch)

    def set_step(self, step: int) -> None:
        """Step recorded on the following rows (normally counted from the optimizer)."""
        self.capture.set_step(step)

    def set_checkpoint(self, name: str, learning_rate: float | None = None) -> None:
        """Checkpoint name (and, for checkpoint passes without an optimizer, its learning rate)."""
        if not isinstance(name, str) or not name:
            raise InvalidNameError(f"a checkpoint name must be a non-empty string, got {name!r}")
        self.capture.set_checkpoint(name)
        if learning_rate is not None:
            self.learning_rate = check_learning_rate(learning_rate)

    def set_split(self, split: str) -> None:
        """Split (``"train"``/``"query"``) recorded on the following rows."""
        if not isinstance(split, str) or not split:
            raise InvalidArgumentError(f"a split must be a non-empty string, got {split!r}")
        self.capture.set_split(split)

    def pause(self) -> None:
        """Stop capturing until :meth:`resume`."""
        self.capture.pause()

    def resume(self) -> None:
        """Capture again after :meth:`pause`."""
        self.capture.resume()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards/backwards inside this block are not captured."""
        with self.capture.paused():
            yield

    def flush(self) -> None:
        """Wait until every captured row is committed to the store."""
        self.capture.flush()
        self._writer.flush()
        self._write_optimizer_steps()

    # ------------------------------------------------------------------ sink
    def _record_skip(self, batch: SkippedBatch) -> None:
        """A training batch that is not written: one row of ``skipped_steps`` (committed now; skips are rare)."""
        row = {
            "run_id": self.run_id,
            "checkpoint": batch.checkpoint,
            "step": batch.step,
            "epoch": batch.epoch,
            "split": batch.split,
            "rank": batch.rank,
            "reason": batch.reason,
            "example_ids": [str(i) for i in batch.example_ids],
            "n_rows": len(batch.example_ids),
            "n_nonfinite": batch.nonfinite_rows,
            "created_at": datetime.now(timezone.utc),
        }
        self.store.results.append_table(S.SKIPPED_STEPS, pa.Table.from_pylist([row], schema=S.SKIPPED_STEPS_SCHEMA))
        self.steps_skipped += 1
        self.rows_dropped += len(batch.example_ids)

    def _write(self, batch: CapturedBatch) -> None:
        lr = self.learning_rate if self.learning_rate is not None else batch.learning_rate
        if self._committed is not None:
            fresh = self._committed.new_rows(batch)
            self.rows_skipped += len(batch.example_ids) - (0 if fresh is None else len(fresh.example_ids))
            if fresh is None:
                return
            batch = fresh
        self._writer.append(
            batch.grads.numpy(),
            batch.example_ids,
            checkpoint=batch.checkpoint,
            step=batch.step,
            epoch=batch.epoch,
            example_hash=batch.example_hash,
            split=batch.split,
            rank=batch.rank,
            loss=None if batch.loss is None else batch.loss.numpy(),
            num_tokens=batch.num_tokens.numpy(),
            learning_rate=lr,
        )
        self.rows_written += len(batch.example_ids)
        if batch.split == "train":  # query rows describe no checkpoint of training
            self._seen[batch.checkpoint] = {"step": batch.step, "epoch": batch.epoch, "learning_rate": lr}


def _translated(error: BaseException) -> GradstoreError | None:
    """The gradstore error for a lower layer's ``error`` (capture's non-finite rows included), or ``None``."""
    if isinstance(error, NonFiniteRowsError):
        return NonFiniteGradientError(*error.args)
    return translated(error)
