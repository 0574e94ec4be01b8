"""GradientCapture: per-example (projected) gradients from every backward of an unchanged loop.

Usage::

    with GradientCapture(model, sink, CaptureConfig(), optimizer=opt) as cap:
        for batch in loader:
            loss = model(**batch).loss     # batch may carry `example_id`, removed before the model sees it
            loss.backward()                 # -> sink(CapturedBatch) on a background thread
            opt.step(); opt.zero_grad()

See ``docs/capture.md`` for the hooks, the row layout, the cost rule, scaling and ids.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace, TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_post_hook

from ingest.bags import bag_modules, other_values, packed_bags
from ingest.capture_config import (
    SKIP_GRAD_SCALER,
    SKIP_NONFINITE,
    CaptureConfig,
    CapturedBatch,
    CaptureLabels,
    ProjectionConfig,
    SkippedBatch,
    build_spec,
    check_label,
)
from ingest.coverage import Coverage, CoverageWarning
from ingest.curvature import CURVATURE_SPLITS, CurvatureStats
from ingest.delivery import Delivery
from ingest.hooks import ActiveBatch, LayerHook, in_backward, in_functorch
from ingest.ids import content_hashes, find_inputs, find_mask, normalize_ids
from ingest.layers import clean_name, fsdp1_wrapped, left_out_ops, select_layers
from ingest.misuse import CaptureUsageError
from ingest.normalizers import NORMALIZER_POWERS, adam_factored_scales
from ingest.output_hooks import on_gradient
from ingest.scaling import example_scales, example_token_counts, examples_first, shifts_labels
from ingest.uses import ACROSS, OWNER, ParameterUses, batch_dim, mark_batched, mark_owned_rows

# Deferred batches (with a GradScaler) waiting for the scaler's decision beyond this many are delivered
# undecided (the capture never saw an optimizer step: memory stays bounded).
MAX_HELD_BATCHES = 256
ID_KWARG = "example_id"


__all__ = [
    "CaptureConfig",
    "CaptureLabels",
    "CapturedBatch",
    "GradientCapture",
    "NonFiniteRowsError",
    "ProjectionConfig",
    "SkippedBatch",
    "SkippedStepWarning",
    "build_spec",
    "check_label",
    "nonfinite_rows",
]

log = logging.getLogger(__name__)


class NonFiniteRowsError(ValueError):
    """A captured batch's rows hold NaN/Inf (``on_nonfinite="raise"``), raised from the ``backward()`` that
    produced them."""


class SkippedStepWarning(UserWarning):
    """Capture skipped a training batch whose gradients were non-finite or whose step the GradScaler skipped
    (warned once per capture)."""


#: After the first captured forwards (1, 2, 4, ..., 64), one in this many probes for hooked weights used outside
#: their modules (a use that starts later in training: a branch taken from some step on).
PROBE_EVERY = 256


def probe_due(generation: int) -> bool:
    """Whether captured forward number ``generation`` runs the op-level capture to look for hooked weights used
    outside their modules: the first ones at powers of two up to 64, then every :data:`PROBE_EVERY`-th."""
    if generation <= 64:
        return generation & (generation - 1) == 0
    return generation % PROBE_EVERY == 0


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's output that a backward can reach: the output itself, or the entries of a tuple,
    list or dict (a ``ModelOutput``) one level down."""
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    return [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]


def _reached(batch: ActiveBatch, grad: torch.Tensor) -> None:
    batch.output_reached = True


class GradientCapture:
    """Context manager that hooks ``model`` and sends a :class:`CapturedBatch` to ``sink`` per backward.

    ``optimizer``: counts steps (step post-hook) and gives the learning rate; when omitted, the
    first optimizer that steps over this model's parameters is used. ``per_example_loss(outputs,
    args, kwargs) -> [B]`` fills ``CapturedBatch.loss``. ``grad_scaler``: an AMP ``GradScaler`` whose
    scale is divided out of the rows; training batches are held on the sink thread until the scaler's
    decision on their step is known (the step's optimizer step ran: delivered; the scale dropped without
    one: skipped), or until :meth:`flush`/exit. ``on_skip(SkippedBatch)`` is told of every training batch
    not delivered (see ``CaptureConfig.on_nonfinite``); ``skip_note`` ends the one warning about them.
    """

    hook_class: type[LayerHook] = LayerHook  # what each captured module gets (per-token capture uses its own)

    def __init__(
        self,
        model: nn.Module,
        sink: Callable[[CapturedBatch], None],
        config: CaptureConfig | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        per_example_loss: Callable[[Any, tuple, dict[str, Any]], torch.Tensor] | None = None,
        grad_scaler: Any | None = None,
        on_skip: Callable[[SkippedBatch], None] | None = None,
    ) -> None:
        self.config = config or CaptureConfig()
        self.config.validate()
        projection = self.config.projection
        self.model = model
        self.sink = sink
        self.optimizer = optimizer
        self.per_example_loss = per_example_loss
        self.grad_scaler = grad_scaler
        if self.config.normalizer is not None and optimizer is None:
            raise CaptureUsageError(
                f"normalizer={self.config.normalizer!r} normalises rows by the optimizer's second moments: pass "
                "optimizer=... (the training loop's Adam), or capture raw rows (normalizer=None)"
            )
        if fsdp1_wrapped(model) and (self.config.normalizer is not None or self.config.fused):
            raise CaptureUsageError(
                "capture: normalizer= and fused=True read each layer's weight (and the optimizer's state per "
                "weight), which FSDP1 (FullyShardedDataParallel) keeps flattened and sharded: capture with "
                "normalizer=None and fused=False, or wrap the model with FSDP2 (fully_shard)"
            )
        layers = select_layers(
            model, tuple(projection.layer_types), projection.include, projection.exclude, projection.include_frozen
        )
        if not layers:
            raise CaptureUsageError(
                "capture: no supported layer (Linear, Conv1D, Embedding, ConvNd, attention, recurrent, parameter) "
                "matches the layer selection: the model has none, layer_types=/include=/exclude= leave none, or every "
                "layer's weight is frozen (only biases train, BitFit: pass include_frozen=True)"
            )
        op_level = sorted({info.kind for info in layers if not info.hooked})
        self.coverage = Coverage.of(
            model, layers, tuple(projection.layer_types), projection.include, projection.exclude, self.config.coverage
        )
        self.coverage.check()
        self.spec = build_spec(layers, projection)
        self.layer_hooks = [
            self.hook_class(
                slot,
                info.module,
                self,
                projection.seed,
                None if projection.basis is None else projection.basis.tensors(slot.name),
                (info.parameter, info.bias) if info.weight is not None else None,
            )
            for slot, info in zip(self.spec.layers, layers)
        ]
        for hook, info in zip(self.layer_hooks, layers):
            hook.index = info.index
        self._hooked = [info.hooked for info in layers]
        self._uses = ParameterUses(
            self,
            self.layer_hooks,
            {id(info.module) for info in layers if info.hooked},
            {id(p): n for n, p in model.named_parameters()},
            left_out_ops(model, layers),
        )
        # else probing forwards check for uses outside hooks (probe_due); inputs that are not batch-first are split at
        # the ops on every forward (a hook takes dim 0 of its input for the examples)
        self._uses_needed = bool(op_level) or self.config.example_dim != 0
        self._uses_probe = True
        self._uses_active = False
        self._ambiguity_warned = False  # an input whose examples' dim is ambiguous (example_dim), warned once
        self.statistics_input: torch.Tensor | None = None  # see ingest.uses.rules.UseOwner
        self._bag_modules = bag_modules(model)  # a model with nn.EmbeddingBag may be given packed bags (ingest.bags)
        self._shifted_labels = shifts_labels(model)  # a "token_mean" loss over shifted labels (a causal LM)
        self._outside_known: set[str] = set()  # hooked parameters the probes saw used outside their modules
        self._last_probe = 0  # the captured forward that probed last
        self._scope_handles: list[Any] = []
        self._normalized = self.config.normalizer is None  # False until the optimizer holds second moments
        self._moments_stale = self.config.normalizer is not None  # the optimizer stepped since the last refresh
        self.batch: ActiveBatch | None = None
        self.is_paused = False
        self.route = self.config.route
        self.fused = self.config.fused
        self.step = 0
        self.epoch = 0
        self.checkpoint = self.config.labels.checkpoint
        self.split = self.config.labels.split
        self._generation = 0
        self._parameter_names: dict[int, str] | None = None  # id(parameter) -> name, for missed()
        self._coverage_check_queued = False
        self._next_ids: list[str] | None = None
        self._param_ids = {id(p) for p in model.parameters()}
        # parameters whose training the coverage accounts for: a later one (unfrozen, added) is reported
        self._accounted = {id(p) for p in model.parameters() if p.requires_grad}
        self._accounted |= {id(p) for h in self.layer_hooks for p in (h.parameter, h.bias) if p is not None}
        self._curvature: dict[tuple[str, str], CurvatureStats] = {}  # by (checkpoint, split)
        self._handles: list[Any] = []
        self._delivery: Delivery | None = None
        self.on_skip = on_skip
        self.skip_note = ""
        self.skipped_batches = 0  # training batches not delivered (non-finite, or their step skipped)
        self.skipped_rows = 0
        # with an enabled GradScaler, training batches wait (on the sink thread) for the scaler's decision
        self._defer = grad_scaler is not None and bool(getattr(grad_scaler, "is_enabled", lambda: True)())
        self._held: list[tuple[dict[str, Any], int]] = []  # sink thread only: (item, non-finite rows)
        self._skip_notice: str | None = None  # set by the sink thread, warned once by the training thread
        self._warned = False
        self._row_listeners: list[Callable[[ActiveBatch, torch.Tensor], None]] = []
        self._step_listeners: list[Callable[[int, torch.optim.Optimizer], None]] = []

    # context -----------------------------------------------------------------------------------

    def __enter__(self) -> GradientCapture:
        self._delivery = Delivery(self._deliver, self.config.max_pending_batches)
        self._handles = [h.attach() for h, hooked in zip(self.layer_hooks, self._hooked) if hooked]
        self._handles.append(self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._after_forward, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._leave_uses, always_call=True))
        if self._uses_needed or self._uses_probe:
            self._attach_scopes()
        for name, module in self.model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                hook = functools.partial(self._batch_statistics, clean_name(name))
                self._handles.append(module.register_forward_pre_hook(hook))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(self._after_step))
        else:
            self._handles.append(register_optimizer_step_post_hook(self._after_step))
        self._refresh_normalizer()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for handle in self._handles + self._scope_handles:
            handle.remove()
        self._handles, self._scope_handles = [], []
        self._leave_uses()
        self._check_rowless(self.batch)
        self.batch = None
        delivery = self._delivery
        try:
            if delivery is not None and exc_type is None:
                self._submit_decision()  # held batches of the last step: decided by the scale now
        finally:
            self._delivery = None
            if delivery is not None:
                delivery.close()
        if delivery is not None and exc_type is None:
            delivery.raise_error()
        self._warn_skips()
        if exc_type is None:  # after the rows are delivered: coverage="strict" may raise here
            self._account_for_new_parameters()

    # controls ----------------------------------------------------------------------------------

    def set_ids(self, ids: Sequence[Any] | torch.Tensor) -> None:
        """Example ids for the next (grad-enabled) forward of the model."""
        self._next_ids = normalize_ids(ids)

    def set_epoch(self, epoch: int) -> None:
        """Epoch recorded on the following rows."""
        self.epoch = int(epoch)

    def set_step(self, step: int) -> None:
        """Override the optimizer-step counter recorded on the following rows."""
        self.step = int(step)

    def set_checkpoint(self, name: str) -> None:
        """Checkpoint name for the following rows (and curvature statistics)."""
        self.checkpoint = check_label("checkpoint", name)

    def set_split(self, split: str) -> None:
        """Split (``"train"``/``"query"``) recorded on the following rows."""
        self.split = check_label("split", split)

    def pause(self) -> None:
        """Stop capturing (hooks stay registered; ``example_id`` is still removed from kwargs)."""
        self.is_paused = True

    def resume(self) -> None:
        """Capture again after :meth:`pause`."""
        self.is_paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Context manager form of :meth:`pause` / :meth:`resume`."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def add_row_listener(self, listener: Callable[[ActiveBatch, torch.Tensor], None]) -> Callable[[], None]:
        """Call ``listener(batch, rows)`` on the training thread at the end of every captured backward, before the
        rows go to the sink: ``rows`` are the batch's ``[B, dim]`` float32 per-example rows on the model's device
        (scaled like the delivered ones; do not modify them). Used by online data selection
        (:mod:`ingest.online_selection`). Returns a function that removes the listener."""
        self._row_listeners.append(listener)
        return lambda: self._row_listeners.remove(listener) if listener in self._row_listeners else None

    def add_step_listener(self, listener: Callable[[int, torch.optim.Optimizer], None]) -> Callable[[], None]:
        """Call ``listener(step, optimizer)`` after every step of the capture's optimizer (its post-hook: the
        optimizer's state is the one the step left), with the step recorded on that step's rows. Used to record
        the optimizer's hyper-parameters and state per step. Returns a function that removes the listener."""
        self._step_listeners.append(listener)
        return lambda: self._step_listeners.remove(listener) if listener in self._step_listeners else None

    def flush(self) -> None:
        """Wait until every finished batch reached the sink (with a ``grad_scaler``, batches still waiting for
        the scaler's decision are decided by its scale now: call it between steps)."""
        if self._delivery is not None:
            self._submit_decision()
            self._delivery.flush()
        self._warn_skips()

    def curvature(
        self, checkpoint: str | None = None, split: str = "train"
    ) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
        """Per layer ``(A [k_in, k_in], S [k_out, k_out], tokens)`` of a checkpoint (default: current), over the
        rows of ``split``: ``"train"`` (the empirical Fisher's factors) or ``"true-fisher"`` (labels sampled from
        the model: the true Fisher's), kept apart (:data:`ingest.curvature.CURVATURE_SPLITS`)."""
        if not self.config.curvature:
            raise RuntimeError("curvature statistics were not requested (CaptureConfig.curvature=False)")
        if split not in CURVATURE_SPLITS:
            raise ValueError(f"curvature statistics are kept for the splits {CURVATURE_SPLITS}, not {split!r}")
        stats = self._curvature.get((self.checkpoint if checkpoint is None else checkpoint, split))
        return {} if stats is None else stats.result()

    # hook owner interface ----------------------------------------------------------------------

    def rows(self, batch: ActiveBatch, device: torch.device) -> torch.Tensor:
        """The batch's ``[B, dim]`` float32 row buffer (zeros at first use)."""
        if batch.rows is None:
            batch.rows = torch.zeros(batch.size, self.spec.dim, dtype=torch.float32, device=device)
        return batch.rows

    def curvature_stats(self) -> CurvatureStats | None:
        """Accumulator of the current checkpoint and split, or None when curvature is off or the rows are neither
        training nor true-Fisher rows (query rows describe no curvature of the training loss). Training and
        true-Fisher rows accumulate separately."""
        if not self.config.curvature or self.split not in CURVATURE_SPLITS:
            return None
        return self._curvature.setdefault((self.checkpoint, self.split), CurvatureStats())

    def gradient_arrived(self, batch: ActiveBatch) -> None:
        """Arrange for ``batch`` to be finished when the running backward ends."""
        if not batch.finalize_queued:
            batch.finalize_queued = True
            Variable._execution_engine.queue_callback(lambda: self._finish(batch))

    # internals ---------------------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        kwargs = dict(kwargs)
        kwarg_ids = kwargs.pop(ID_KWARG, None)
        if self.is_paused or not torch.is_grad_enabled() or in_backward() or in_functorch():
            return args, kwargs  # a torch.func transform (vmap/grad of a functional_call): not a training backward
        if self._skip_notice is not None and not self._warned:
            self._warn_skips()
        if self._moments_stale:
            self._refresh_normalizer()
        if not self._normalized:
            return args, kwargs
        self._check_rowless(self.batch)
        set_ids, self._next_ids = self._next_ids, None
        if kwarg_ids is not None and set_ids is not None:
            raise CaptureUsageError(f"capture: ids were given both as `{ID_KWARG}` and through set_ids(); give one")
        inputs = main = find_inputs(args, kwargs)
        given = kwarg_ids if kwarg_ids is not None else set_ids
        if inputs is None and given is None:
            raise CaptureUsageError(
                f"capture: cannot identify the examples: pass `{ID_KWARG}=...` to the model, call "
                "set_ids(), or give the model a tensor input to hash"
            )
        dim = self.config.example_dim
        if inputs is not None and dim:
            if inputs.dim() <= dim:
                raise CaptureUsageError(
                    f"capture: example_dim={dim} but the model's input has shape {tuple(inputs.shape)}: give the "
                    "dim of the input that indexes the examples (0 for batch-first inputs)"
                )
            inputs = inputs.movedim(dim, 0)  # [B, ...]: the ids' hashes, token counts and mask read it so
        bags = packed_bags(self._bag_modules, args, kwargs, main) if not dim else None
        size = bags.size if bags is not None else inputs.shape[0] if inputs is not None else len(given)
        if size == 0:  # an empty batch has no rows to capture
            self.batch = None
            return args, kwargs
        ids = normalize_ids(given, size) if given is not None else None
        mask = find_mask(kwargs, inputs) if bags is None else None
        hashed, hashed_mask = (inputs, mask) if bags is None else bags.padded()
        device = inputs.device if inputs is not None else next(self.model.parameters()).device
        self._generation += 1
        if probe_due(self._generation):  # and at exit: the run's coverage says so either way, no scan per step
            self._account_for_new_parameters()
        self.batch = ActiveBatch(
            generation=self._generation,
            size=size,
            scales=example_scales(
                self.config.loss_reduction,
                size,
                examples_first(kwargs, dim),
                self.config.loss_scale,
                device,
                self._shifted_labels,
            ),
            token_mask=None if mask is None else mask.bool(),
            bags=bags,
            meta={
                "ids": ids,
                "hash_source": None
                if ids is not None
                else (hashed.detach().clone(), None if hashed_mask is None else hashed_mask.detach().clone()),
                "num_tokens": example_token_counts(inputs, mask, size)
                if bags is None
                else bags.lengths.to(torch.int32),
                "step": self.step,
                "epoch": self.epoch,
                "checkpoint": self.checkpoint,
                "split": self.split,
                "loss": None,
            },
        )
        if not self._uses_needed and not self._uses_probe and probe_due(self._generation):
            self._uses_probe = True  # look again: a hooked weight may be used outside its module from now on
            self._attach_scopes()
            if any(h.module is module for h, hooked in zip(self.layer_hooks, self._hooked) if hooked):
                self._uses.enter_module(module, args)  # the model is a hooked layer: its pre-hook came too late
        if self._uses_needed or self._uses_probe or bags is not None:
            if bags is not None:  # the flat ids: rows owned by their examples (the embedding_bag rule splits them)
                mark_owned_rows(bags.tokens, bags.owner)
                args_seen, kwargs_seen, main = other_values(args, bags), other_values(kwargs.values(), bags), None
            else:
                args_seen, kwargs_seen = args, kwargs.values()
            ambiguous = mark_batched(args_seen, size, dim, main) + mark_batched(kwargs_seen, size, dim, main)
            if ambiguous and not self._ambiguity_warned:
                self._ambiguity_warned = True
                warnings.warn(
                    f"capture (example_dim={dim}): model inputs of shape {ambiguous[0]} have the batch's size "
                    f"({size}) along dim 0 and dim {dim}, so which one indexes their examples is ambiguous; the "
                    "parameters their values reach are reported not captured. Give such inputs a size other than "
                    "the batch's along the other dim (or the model batch-first inputs)",
                    CoverageWarning,
                    stacklevel=2,
                )
            self._uses.__enter__()
            self._uses_active = True
        return args, kwargs

    def _account_for_new_parameters(self) -> None:
        """Record the trainable parameters that no layer selection saw (frozen then, or not yet in the model): on
        probing forwards (:func:`probe_due`) and when the capture ends, before its coverage is written."""
        if all(id(p) in self._accounted for p in self.model.parameters() if p.requires_grad):
            return
        new = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in self._accounted:
                self._accounted.add(id(p))
                new[clean_name(name)] = p.numel()
        self.coverage.appeared(new, f"captured forward {self._generation}")

    def _batch_statistics(self, name: str, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of a BatchNorm: normalising a captured batch by its own statistics (training mode, or
        no running statistics) couples the examples, which the coverage records (once)."""
        self.statistics_input = None
        if self.batch is None or self.batch.size < 2 or not torch.is_grad_enabled() or in_backward():
            return
        if module.training or module.running_mean is None:
            self.statistics_input = args[0] if args else None  # its F.batch_norm is reported here, not again
            self.coverage.mixed(
                name,
                "BatchNorm normalises by the batch's statistics (training mode): each row is the example's share "
                "of the batch gradient, not the gradient of its own loss; for per-example gradients capture with "
                "the norm layers in eval mode, or use GroupNorm/LayerNorm",
            )

    def _attach_scopes(self) -> None:
        """Tell the op-level capture when a hooked module's own forward runs (its own op is its hook's)."""
        if self._scope_handles:
            return
        for h, hooked in zip(self.layer_hooks, self._hooked):
            if hooked:
                self._scope_handles.append(h.module.register_forward_pre_hook(self._uses.enter_module))
                self._scope_handles.append(h.module.register_forward_hook(self._uses.leave_module, always_call=True))

    def _leave_uses(self, *_: Any) -> None:
        """End the op-level capture of a forward; after a probing forward (the first, then :func:`probe_due`'s),
        keep it only where it is needed (op-level layers, or hooked parameters used outside their modules)."""
        if not self._uses_active:
            return
        self._uses_active = False
        self._uses.__exit__(None, None, None)
        if self._uses_probe:
            self._uses_probe = False
            outside = set(self._uses.outside)
            late = outside - self._outside_known
            if late and self._generation - self._last_probe > 1:
                self.coverage.uncovered(
                    late,
                    "",
                    reason=f"used outside its module from a captured forward between {self._last_probe + 1} and "
                    f"{self._generation - 1}, which the check for such uses did not watch: those rows miss that use "
                    f"(captured from forward {self._generation} on)",
                )
            self._outside_known, self._last_probe = outside, self._generation
            unsafe = not all(self._uses.broadcasts.values())  # a single-row output the model does not broadcast
            self._uses_needed = self._uses_needed or bool(outside) or unsafe
            if not self._uses_needed:
                for handle in self._scope_handles:
                    handle.remove()
                self._scope_handles = []

    def uncovered(self, names: Any, how: str) -> None:
        """A use of parameters ``names`` that capture cannot split per example (from :mod:`ingest.uses`)."""
        self.coverage.uncovered(set(names), how)

    def mixed(self, where: str, how: str) -> None:
        """The forward combines each example with statistics over the batch (from :mod:`ingest.uses`)."""
        self.coverage.mixed(where, how)

    def missed(self, hook: LayerHook, how: str) -> None:
        """``hook``'s slot misses a gradient that reached it (``how``, from :meth:`LayerHook.live_batch`): its
        parameters turn "not captured"; one coverage warning when the running backward ends, however many slots
        it reached."""
        if self._parameter_names is None:
            self._parameter_names = {id(p): clean_name(n) for n, p in self.model.named_parameters()}
        names = {self._parameter_names.get(id(p)) for p in (hook.parameter, hook.bias) if p is not None}
        self.coverage.uncovered(names - {None}, how, warn=False)
        if not in_backward():
            self.coverage.check()
        elif not self._coverage_check_queued:
            self._coverage_check_queued = True
            Variable._execution_engine.queue_callback(self._check_coverage)

    def _check_coverage(self) -> None:
        self._coverage_check_queued = False
        self.coverage.check()

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        batch = self.batch
        if batch is None or self.is_paused or not torch.is_grad_enabled() or in_backward() or in_functorch():
            return
        for out in _output_tensors(output):  # a backward through the output must bring this batch rows
            on_gradient(out, functools.partial(_reached, batch))
            order = getattr(out, OWNER, None)
            shuffled = order is not None and order.shape[0] == batch.size and batch_dim(out) == 0
            if shuffled and not torch.equal(order.cpu(), torch.arange(batch.size)):  # h[perm] returned as the rows
                self.coverage.mixed(
                    "the model's output",
                    "the forward returns its rows in another order than the examples' (rows chosen by an index "
                    "along the batch, not put back): each row's loss is another example's",
                )
            if getattr(out, ACROSS, False):
                self.coverage.mixed(
                    "the model's output",
                    "the forward ends in an op across the examples (a softmax or a normalisation over the batch): "
                    "each example's loss depends on the others', so each row is the example's share of the batch "
                    "gradient, not the gradient of its own loss",
                )
        if self.per_example_loss is None or batch.meta["loss"] is not None:
            return
        with torch.no_grad():
            loss = self.per_example_loss(output, args, kwargs).detach().float().reshape(-1)
        if loss.shape[0] != batch.size:
            raise CaptureUsageError(f"per_example_loss returned {loss.shape[0]} values for {batch.size} examples")
        batch.meta["loss"] = loss

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.optimizer is None and any(
            id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]
        ):
            self.optimizer = optimizer
        if optimizer is self.optimizer:
            for listener in self._step_listeners:
                listener(self.step, optimizer)
            self.step += 1
            # refreshed by the next captured forward, so paused steps do not pay for it
            self._moments_stale = self.config.normalizer is not None
            if self._defer and self._delivery is not None:  # the step ran (or a fused optimizer skipped it)
                self._submit_marker("step", optimizer)

    def _refresh_normalizer(self) -> None:
        """Fold the optimizer's current second moments into the layers (``normalizer`` set)."""
        if self.config.normalizer is None or self.optimizer is None:
            return
        scales = []
        for h in self.layer_hooks:
            layer = adam_factored_scales(
                self.optimizer,
                SimpleNamespace(weight=h.parameter, bias=h.bias),
                h.slot.kind,
                h.slot.has_bias,
                NORMALIZER_POWERS[self.config.normalizer],
            )
            if layer is None:
                return  # no state yet (before the first step): keep not capturing
            scales.append(layer)
        for hook, layer in zip(self.layer_hooks, scales):
            hook.set_scales(layer)
        self._normalized = True
        self._moments_stale = False

    def _learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def _scale_tensor(self) -> torch.Tensor | float:
        """The grad scaler's current scale: its own tensor (on the device, no sync) or a float."""
        scale = getattr(self.grad_scaler, "_scale", None)
        return scale if isinstance(scale, torch.Tensor) else float(self.grad_scaler.get_scale())

    def _scale_copy(self, optimizer: torch.optim.Optimizer | None = None) -> tuple[torch.Tensor, Any]:
        """A host copy of the scaler's scale now (the scaler updates its tensor in place), with ``optimizer``
        the scaler's found-inf count of its step after it, and the event that marks the copy done (``None`` off
        CUDA); the copy is not awaited."""
        scale = self._scale_tensor()
        scale = scale.detach().reshape(()).float() if isinstance(scale, torch.Tensor) else torch.tensor(scale)
        values = [scale]
        if optimizer is not None:
            states = getattr(self.grad_scaler, "_per_optimizer_states", None)
            state = states.get(id(optimizer)) if isinstance(states, dict) else None
            found = [
                t.reshape(()).float().to(scale.device) for t in (state or {}).get("found_inf_per_device", {}).values()
            ]
            values.append(torch.stack(found).sum() if found else torch.zeros((), device=scale.device))
        return Delivery.to_host(torch.stack(values))

    def _submit_marker(self, kind: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Queue a decision point for the held batches: ``"step"`` (``optimizer.step()`` ran: a fused optimizer
        runs it also when the scaler found inf, which the marker carries) or ``"decide"`` (flush/exit), with the
        scale at that moment."""
        values, event = self._scale_copy(optimizer)
        self._delivery.submit({"kind": kind, "scale": values}, event)

    def _submit_decision(self) -> None:
        if self._defer and self._delivery is not None:
            self._submit_marker("decide")

    def _warn_skips(self) -> None:
        """Warn (once per capture, on the training thread) that training batches were skipped."""
        notice = self._skip_notice
        if notice is not None and not self._warned:
            self._warned = True
            warnings.warn(notice + self.skip_note, SkippedStepWarning, stacklevel=3)

    def _check_rowless(self, batch: ActiveBatch | None) -> None:
        """A batch whose backward reached the model's output but brought no captured layer a gradient of its
        examples (the model's inputs not recognised as the batch, a packed sequence built outside the forward):
        its rows are missing, which the coverage records and warns about."""
        if batch is not None and batch.output_reached and not batch.finalize_queued and self.layer_hooks:
            self.coverage.rowless(
                "a backward reached the model's output but no captured layer got a gradient of the batch's examples: "
                "this step has no rows (are the model's inputs the batch's? a tensor with the examples along dim 0, "
                "not packed or wrapped before the forward)"
            )

    def _finish(self, batch: ActiveBatch) -> None:
        if self.batch is batch:
            self.batch = None
        if self._delivery is None or batch.rows is None:
            return
        factor = batch.scales.to(batch.rows.device)
        if self.grad_scaler is not None:  # divided first: a large loss scale times B must not overflow
            scale = self._scale_tensor()
            factor = factor / (scale.to(factor.device) if isinstance(scale, torch.Tensor) else scale)
        rows = batch.rows * factor.unsqueeze(1)
        for listener in self._row_listeners:
            listener(batch, rows)
        meta = dict(batch.meta, learning_rate=self._learning_rate())
        if self.config.on_nonfinite == "raise" and not bool(torch.isfinite(rows).all()):
            bad = torch.nonzero(~torch.isfinite(rows).all(dim=1)).flatten().tolist()
            ids = meta["ids"]
            which = f"example ids {[ids[i] for i in bad[:5]]}" if ids is not None else f"batch positions {bad[:5]}"
            raise NonFiniteRowsError(
                f"capture: {len(bad)} gradient row(s) of the batch at step {meta['step']} hold NaN/Inf ({which}); "
                "the loss or the gradients of this step are not finite. Capture with on_nonfinite='skip' to skip "
                "such steps (they are recorded) instead of stopping."
            )
        deferred = self._defer and meta["split"] == "train"
        meta["scale"] = self._scale_copy()[0][0] if deferred else None  # before the rows: their event covers it
        if meta["loss"] is not None:
            meta["loss"], _ = Delivery.to_host(meta["loss"])  # copied before the rows: their event covers it
        host, event = Delivery.to_host(rows)
        self._delivery.submit({"kind": "rows", "grads": host, **meta}, event)

    def _deliver(self, item: dict[str, Any]) -> None:
        """Sink thread: deliver or skip a batch, holding a GradScaler loop's training batches until their
        step's fate is known (a later scale below theirs: the scaler skipped their step)."""
        if item["kind"] != "rows":  # a step ran (its batches are good) / flush or exit: decide by the scale
            values = item["scale"].tolist()
            if len(values) > 1 and values[1] > 0:  # a fused optimizer's step, skipped by the scaler
                self._release(-math.inf, final=True)
            else:
                self._release(values[0], final=True)
            return
        nonfinite = int(nonfinite_rows(item["grads"]).sum())
        if item["scale"] is None:
            self._emit(item, nonfinite, SKIP_NONFINITE if nonfinite and item["split"] == "train" else None)
            return
        self._release(float(item["scale"]), final=False)
        self._held.append((item, nonfinite))
        if len(self._held) > MAX_HELD_BATCHES:
            held, nonfinite = self._held.pop(0)
            log.warning(
                "capture: no optimizer step seen for %d batches; delivering without the scaler's decision",
                MAX_HELD_BATCHES,
            )
            self._emit(held, nonfinite, SKIP_NONFINITE if nonfinite else None)

    def _release(self, scale: float, final: bool) -> None:
        """Skip the held batches recorded at a scale above ``scale`` (the scaler backed off: their step was
        skipped); with ``final`` also deliver the others (their step ran, or it is decided now)."""
        keep = []
        for item, nonfinite in self._held:
            recorded = float(item["scale"])
            if recorded > scale or math.isnan(scale):
                self._emit(item, nonfinite, SKIP_GRAD_SCALER)
            elif final or recorded < scale:  # a larger scale now: the scaler grew after their step ran
                self._emit(item, nonfinite, SKIP_NONFINITE if nonfinite else None)
            else:
                keep.append((item, nonfinite))
        self._held = keep

    def _emit(self, item: dict[str, Any], nonfinite: int, reason: str | None) -> None:
        """Hand one batch to the sink, or (``reason``) report it skipped."""
        ids, hashes = item["ids"], None
        if ids is None:
            hashes = content_hashes(*item["hash_source"])
            ids = hashes
        if reason is not None:
            self._skip(item, ids, nonfinite, reason)
            return
        self.sink(
            CapturedBatch(
                grads=item["grads"],
                example_ids=ids,
                example_hash=hashes,
                step=item["step"],
                epoch=item["epoch"],
                checkpoint=item["checkpoint"],
                split=item["split"],
                rank=self.config.labels.rank,
                learning_rate=item["learning_rate"],
                loss=item["loss"],
                num_tokens=item["num_tokens"].cpu().to(torch.int32),
            )
        )

    def _skip(self, item: dict[str, Any], ids: list[str], nonfinite: int, reason: str) -> None:
        self.skipped_batches += 1
        self.skipped_rows += len(ids)
        if self._skip_notice is None:
            why = (
                "the GradScaler found inf/NaN gradients and skipped the optimizer step"
                if reason == SKIP_GRAD_SCALER
                else f"{nonfinite} of its rows hold NaN/Inf (a non-finite loss or gradients)"
            )
            self._skip_notice = (
                f"gradient capture skipped the {len(ids)} row(s) of a training batch at step {item['step']}: {why}. "
                "Rows of such steps are not captured; this warning is shown once per capture"
            )
        if self.on_skip is not None:
            self.on_skip(
                SkippedBatch(
                    example_ids=list(ids),
                    step=item["step"],
                    epoch=item["epoch"],
                    checkpoint=item["checkpoint"],
                    split=item["split"],
                    rank=self.config.labels.rank,
                    reason=reason,
                    nonfinite_rows=nonfinite,
                )
            )


def nonfinite_rows(grads: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: the rows of ``grads`` (``[n, dim]``, on the host) holding NaN/Inf, or whose float32 norm
    overflows. In numpy, single-threaded: on the sink thread, torch's reductions would start a second OpenMP team
    that competes with the training thread's for the same cores (on 2 cores that doubled a captured step)."""
    if grads.numel() == 0:
        return torch.zeros(grads.shape[0], dtype=torch.bool)
    grads = grads.detach().cpu()
    values = (grads if grads.dtype in (torch.float16, torch.float32, torch.float64) else grads.float()).numpy()
    peaks = np.maximum(values.max(axis=1), -values.min(axis=1)).astype(np.float64)
    bad = ~np.isfinite(peaks)
    limit = float(np.finfo(np.float32).max)
    suspect = ~bad & (peaks * math.sqrt(values.shape[1]) > limit)
    if suspect.any():
        bad |= suspect & (np.linalg.norm(values.astype(np.float64), axis=1) > limit)
    return torch.from_numpy(bad)
