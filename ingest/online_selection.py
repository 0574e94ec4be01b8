"""Online data selection inside the training step: score the examples of each step from the per-example rows a
:class:`~ingest.capture.GradientCapture` already holds, and drop (or reweight) the chosen ones *before* the
optimizer step by removing their exact contribution from ``.grad``.

How the removal is exact without per-example gradients: the gradient a Linear layer's weight receives from a
backward is ``sum_b sum_t dy[b, t] x[b, t]^T`` (``dy`` the gradient of the loop's loss with respect to the layer's
output, ``x`` its input), so example ``b``'s term is ``dy[b]^T x[b]``. The selector keeps each captured forward's
``x`` (already held by autograd) and the ``dy`` autograd hands to the output, and at the step subtracts
``(1 - w_b) dy[b]^T x[b]`` of the examples it drops (``w_b = 0``) or reweights, for every use of every trainable
module. ``dy`` already carries the loop's loss reduction (``1/B`` of the example's own gradient for a batch mean),
so the removal needs no knowledge of it. Embeddings (a scatter of ``dy`` at the token ids) and Hugging Face
``Conv1D`` work alike; a model with any other trainable parameter (LayerNorm, Conv2d, a bare ``nn.Parameter``)
is refused with :class:`ExactRemovalError`: its examples' terms cannot be removed exactly from the saved factors.

``renormalize=True`` (the default) then scales the step's gradient so it equals the loop's loss *over the kept
examples only*: for a batch mean, ``B / |kept|``; for the causal-LM token mean, ``N_tokens / N_kept_tokens``;
for a sum, 1 (a sum over the kept examples). With it, a selected step equals a step on the kept examples alone
(the exactness guarantee tested in ``tests/capture/test_online_selection.py``); without it, dropped examples simply
contribute nothing and the gradient stays ``1/B``-scaled.

>>> selector = OnlineSelector(capture, KeepTopFraction(0.5), target=query_mean)
>>> with capture, selector:
...     loss.backward(); opt.step()      # the step pre-hook drops the low-scoring half first
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ingest.capture import GradientCapture
from ingest.hooks import ActiveBatch, in_backward
from ingest.ids import content_hashes
from ingest.layers import _conv1d_class
from ingest.misuse import CaptureUsageError


class ExactRemovalError(CaptureUsageError):
    """The model has trainable parameters whose per-example contributions cannot be removed exactly."""


class SelectionPolicy(Protocol):
    """Decides, for the ``n`` examples of one step, a weight per example: ``True``/1 keep, ``False``/0 drop, or any
    float (reweight). ``scores``: ``[n]`` float64 (``None`` when no target was given); ``losses``: ``[n]`` float32
    per-example losses (``None`` without ``per_example_loss``)."""

    needs_scores: bool
    needs_loss: bool

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor: ...


def _fraction(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise CaptureUsageError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _top(values: torch.Tensor, fraction: float, largest: bool) -> torch.Tensor:
    n = values.shape[0]
    count = max(1, round(fraction * n)) if n else 0
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.topk(values.double().cpu(), count, largest=largest, sorted=False).indices] = True
    return keep


@dataclass(frozen=True)
class KeepTopFraction:
    """Keep the ``fraction`` of the step's examples with the highest scores (at least one)."""

    fraction: float
    needs_scores: bool = True
    needs_loss: bool = False

    def __post_init__(self) -> None:
        _fraction(self.fraction, "KeepTopFraction.fraction")

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: the top ``fraction`` by score."""
        return _top(scores, self.fraction, largest=True)


@dataclass(frozen=True)
class DropBelowThreshold:
    """Drop the examples whose score is below ``threshold`` (all may be dropped: the step's gradient is then 0)."""

    threshold: float
    needs_scores: bool = True
    needs_loss: bool = False

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: score >= threshold."""
        return (scores >= self.threshold).cpu()


@dataclass(frozen=True)
class LossBased:
    """Baseline without gradients: keep the ``fraction`` of examples with the lowest loss (``keep="low"``, the
    small-loss rule against label noise) or the highest (``keep="high"``, hard-example mining). Needs the
    capture's ``per_example_loss``."""

    fraction: float
    keep: str = "low"
    needs_scores: bool = False
    needs_loss: bool = True

    def __post_init__(self) -> None:
        _fraction(self.fraction, "LossBased.fraction")
        if self.keep not in ("low", "high"):
            raise CaptureUsageError(f"LossBased.keep must be 'low' or 'high', got {self.keep!r}")

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: the ``fraction`` lowest (or highest) losses."""
        return _top(losses, self.fraction, largest=self.keep == "high")


@dataclass(frozen=True)
class RandomSelection:
    """Keep a uniformly random ``fraction`` of the step's examples (the comparison baseline); seeded by the
    selector's ``seed``."""

    fraction: float
    needs_scores: bool = False
    needs_loss: bool = False

    def __post_init__(self) -> None:
        _fraction(self.fraction, "RandomSelection.fraction")

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: a random ``fraction``."""
        return _top(torch.rand(n, generator=generator, dtype=torch.float64), self.fraction, largest=True)


@dataclass
class StepDecision:
    """What the selector decided at one optimizer step (this rank's examples, in batch order; ``example_ids``
    are the capture's ids, or content hashes computed when first read)."""

    step: int
    id_sources: list[Any]  # per captured backward: its ids, or the (inputs, mask) its hashes come from
    weights: torch.Tensor  # [n] float64: 1 kept, 0 dropped, else the weight applied
    scores: torch.Tensor | None  # [n] float64
    losses: torch.Tensor | None  # [n] float32
    renormalization: float  # the factor the step's gradient was multiplied by after the removal
    rank: int

    @functools.cached_property
    def example_ids(self) -> list[str]:
        """The examples' ids, in batch order."""
        ids: list[str] = []
        for source in self.id_sources:
            ids.extend(source if isinstance(source, list) else content_hashes(*source))
        return ids

    @property
    def kept(self) -> torch.Tensor:
        """``[n]`` bool: examples whose weight is not 0."""
        return self.weights != 0


@dataclass
class _Pending:
    """One captured backward of the current step: its rows and every use of every trainable module."""

    rows: torch.Tensor | None = None
    meta: dict[str, Any] | None = None
    scales: torch.Tensor | None = None
    uses: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]] | None = None


Target = torch.Tensor | Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None


class RefreshedTarget:
    """A target that follows training: the mean captured row of ``loss_fn(model, batch)`` over ``batches`` (a
    validation or trusted set; a sequence, or a function returning an iterable of batches), recomputed every
    ``every`` decisions, with the capture's own projection. Pass it as ``target=``.

    The pass uses ``torch.autograd.grad`` (the training gradient in ``.grad`` is not touched) under a second
    capture while ``capture`` is paused; ``loss_reduction`` says how ``loss_fn`` reduces its batch (rows are
    per-example gradients either way). ``similarity``: ``"dot"`` or ``"cosine"`` (each row normalised).
    ``refreshes`` counts the passes. One process: under DDP give it the unwrapped module's loss.
    """

    def __init__(
        self,
        capture: GradientCapture,
        batches: Any,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        every: int = 10,
        loss_reduction: str = "mean",
        similarity: str = "dot",
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CaptureUsageError(f"RefreshedTarget.every must be a positive integer, got {every!r}")
        if similarity not in ("dot", "cosine"):
            raise CaptureUsageError(f"similarity must be 'dot' or 'cosine', got {similarity!r}")
        self.capture = capture
        self.batches = batches
        self.loss_fn = loss_fn
        self.every = every
        self.loss_reduction = loss_reduction
        self.similarity = similarity
        self.vector: torch.Tensor | None = None
        self.refreshes = 0
        self._calls = 0

    def refresh(self) -> torch.Tensor:
        """Recompute the target now: the ``[dim]`` float32 mean row of the batches."""
        from ingest.capture import CaptureConfig

        rows: list[torch.Tensor] = []
        model = self.capture.model
        params = [p for p in model.parameters() if p.requires_grad]
        config = CaptureConfig(projection=self.capture.config.projection, loss_reduction=self.loss_reduction)
        batches = self.batches() if callable(self.batches) else self.batches
        with self.capture.paused(), GradientCapture(model, lambda b: rows.append(b.grads), config):
            for batch in batches:
                torch.autograd.grad(self.loss_fn(model, batch), params, allow_unused=True)
        if not rows:
            raise CaptureUsageError("RefreshedTarget: the batches produced no captured rows (empty batches?)")
        self.vector = torch.cat(rows).mean(0)
        self.refreshes += 1
        return self.vector

    def __call__(self, rows: torch.Tensor, losses: torch.Tensor | None) -> torch.Tensor:
        """Scores of ``rows`` against the target (refreshed first when due)."""
        if self.vector is None or self._calls % self.every == 0:
            self.refresh()
        self._calls += 1
        target = self.vector.to(rows.device, rows.dtype)
        scores = rows @ target
        if self.similarity == "cosine":
            scores = scores / rows.norm(dim=1).clamp(min=1e-30)
        return scores


def removal_kind(module: nn.Module) -> str | None:
    """How a module's per-example contributions are removed (``"linear"``, ``"conv1d"``, ``"embedding"``), or
    ``None`` when they cannot be removed exactly."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding) and not module.sparse and module.max_norm is None:
        return "embedding"
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    return None


class OnlineSelector:
    """Drop or reweight examples of every optimizer step before it runs, from the capture's per-example rows.

    ``capture``: the running :class:`GradientCapture` (its rows give the scores; every backward since the last
    step is decided together, so gradient accumulation selects over the whole step). ``policy``: a
    :class:`SelectionPolicy` (:class:`KeepTopFraction`, :class:`DropBelowThreshold`, :class:`LossBased`,
    :class:`RandomSelection` or your own). ``target``: a ``[dim]`` tensor (score = ``row . target``, or the
    cosine with ``similarity="cosine"``), or a function ``(rows [n, dim], losses [n] | None) -> [n]`` scores.
    ``renormalize``: see the module doc. ``optimizer``: whose step pre-hook applies the decision (default: the
    capture's; else any optimizer stepping this model's parameters). Call :meth:`apply` yourself before gradient
    clipping (the pre-hook then finds nothing left to do). ``on_decision(StepDecision)`` is told of every decision.
    ``collective``: decide over every rank's examples together and remove the dropped terms from DDP's all-reduced
    (averaged) gradient (default: ``True`` whenever ``torch.distributed`` runs more than one rank; pass ``False``
    for ranks that train independently). FSDP (sharded gradients) is refused.
    """

    def __init__(
        self,
        capture: GradientCapture,
        policy: SelectionPolicy,
        target: Target = None,
        *,
        similarity: str = "dot",
        renormalize: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
        on_decision: Callable[[StepDecision], None] | None = None,
        collective: bool | None = None,
        seed: int = 0,
    ) -> None:
        if not isinstance(capture, GradientCapture):
            raise CaptureUsageError(f"OnlineSelector needs a GradientCapture, got {type(capture).__name__}")
        if not callable(getattr(policy, "decide", None)):
            raise CaptureUsageError(f"policy must have a decide(n, scores, losses, generator) method, got {policy!r}")
        if similarity not in ("dot", "cosine"):
            raise CaptureUsageError(f"similarity must be 'dot' or 'cosine', got {similarity!r}")
        if getattr(policy, "needs_scores", False) and target is None:
            raise CaptureUsageError(
                f"{type(policy).__name__} ranks examples by score: pass target= (a [dim] gradient, e.g. the mean "
                "of stored query rows, or a scoring function)"
            )
        if isinstance(target, torch.Tensor):
            if target.dim() != 1 or target.shape[0] != capture.spec.dim:
                raise CaptureUsageError(
                    f"target must be a [dim] = [{capture.spec.dim}] vector in the capture's projected space, got "
                    f"shape {tuple(target.shape)}"
                )
        elif target is not None and not callable(target):
            raise CaptureUsageError(f"target must be a tensor, a function or None, got {type(target).__name__}")
        if getattr(policy, "needs_loss", False) and capture.per_example_loss is None:
            raise CaptureUsageError(
                f"{type(policy).__name__} ranks examples by loss: give the capture per_example_loss=... "
                "(e.g. ingest.losses.causal_lm_loss)"
            )
        if capture.grad_scaler is not None:
            raise CaptureUsageError(
                "online selection with a GradScaler is not supported (its unscale would mix scaled and unscaled "
                "terms): train in float32 or bfloat16 without a scaler"
            )
        self.capture = capture
        self.policy = policy
        self.target = target
        self.similarity = similarity
        self.renormalize = bool(renormalize)
        self.optimizer = optimizer or capture.optimizer
        self.on_decision = on_decision
        self.generator = torch.Generator().manual_seed(int(seed))
        self.model = capture.model
        self.collective = _is_ddp(self.model) if collective is None else bool(collective)
        _refuse_sharded(self.model)
        self.modules = self._removable_modules(self.model)
        self._params = list({id(p): p for m, _ in self.modules for p in m.parameters(recurse=False)}.values())
        self._param_ids = {id(p) for p in self._params}  # a tied weight (embedding and LM head) counted once
        self._pending: dict[int, _Pending] = {}
        self._handles: list[Any] = []
        self.last_decision: StepDecision | None = None
        self._target_cache: torch.Tensor | None = None
        self.steps_decided = 0
        self.examples_seen = 0
        self.examples_kept = 0

    # ------------------------------------------------------------------ context
    @staticmethod
    def _removable_modules(model: nn.Module) -> list[tuple[nn.Module, str]]:
        found, refused = [], []
        for name, module in model.named_modules():
            own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            kind = removal_kind(module)
            if kind is None or any(n not in ("weight", "bias") for n in own):
                refused.append(f"{name or '<root>'} ({type(module).__name__})")
            else:
                found.append((module, kind))
        if refused:
            raise ExactRemovalError(
                "online selection removes dropped examples' exact contributions from Linear, Embedding (dense, no "
                f"max_norm) and Conv1D layers only; these modules have other trainable parameters: {refused[:8]}"
                f"{' ...' if len(refused) > 8 else ''}. Freeze them (requires_grad_(False)) or select offline"
            )
        if not found:
            raise ExactRemovalError("online selection: the model has no trainable parameters")
        return found

    def __enter__(self) -> OnlineSelector:
        self._handles = [self.capture.add_row_listener(self._rows_arrived)]
        for module, kind in self.modules:
            self._handles.append(module.register_forward_hook(self._make_forward_hook(kind)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._before_step))
        else:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handles.append(register_optimizer_step_pre_hook(self._before_step))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            if hasattr(handle, "remove"):
                handle.remove()
            else:
                handle()
        self._handles = []
        self._pending = {}

    # ------------------------------------------------------------------ hooks
    def _make_forward_hook(self, kind: str) -> Callable[..., torch.Tensor | None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> torch.Tensor | None:
            batch = self.capture.batch
            if batch is None or self.capture.is_paused or not torch.is_grad_enabled() or in_backward():
                return
            if not isinstance(output, torch.Tensor) or not output.requires_grad or not args:
                return
            x = args[0].detach()
            replaced = None
            if x.shape[0] != batch.size:
                if x.shape[0] == 1 and output.shape[0] in (1, batch.size):
                    # a batch-1 input broadcast later (position embeddings): per-example output gradients need the
                    # output expanded (a view; expand's backward sums exactly as the broadcast would)
                    x = x.expand(batch.size, *x.shape[1:])
                    if output.shape[0] == 1:
                        output = replaced = output.expand(batch.size, *output.shape[1:])
                else:
                    raise CaptureUsageError(
                        f"online selection: a {type(module).__name__} got a batch of {x.shape[0]} in a forward of "
                        f"{batch.size} examples; it needs batch-first inputs"
                    )
            pending = self._pending.setdefault(batch.generation, _Pending(uses=[]))
            use = [module, kind, x, None]
            pending.uses.append(use)

            def grad_hook(dy: torch.Tensor) -> None:
                use[3] = dy.detach() if use[3] is None else use[3] + dy.detach()

            output.register_hook(grad_hook)
            return replaced

        return hook

    def _rows_arrived(self, batch: ActiveBatch, rows: torch.Tensor) -> None:
        pending = self._pending.setdefault(batch.generation, _Pending(uses=[]))
        pending.rows = rows
        pending.meta = batch.meta
        pending.scales = batch.scales

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.optimizer is None:
            if not any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
                return
        elif optimizer is not self.optimizer:
            return
        self.apply()

    # ------------------------------------------------------------------ the decision
    def apply(self) -> StepDecision | None:
        """Decide over every captured backward since the last decision and fix ``.grad`` accordingly; returns the
        decision (``None`` when no backward was captured). Runs by itself before the optimizer step; call it
        earlier yourself when the loop clips or inspects gradients before stepping."""
        pending = [p for _, p in sorted(self._pending.items()) if p.rows is not None or p.uses]
        self._pending = {}
        if not pending:
            return None
        for p in pending:
            if p.rows is None:
                raise CaptureUsageError(
                    "online selection: a backward of this step produced no captured rows (its forward ran with the "
                    "capture paused, or the backward did not reach a captured layer); cannot score its examples"
                )
            if any(use[3] is None for use in p.uses):
                raise CaptureUsageError(
                    "online selection: a captured forward's output got no gradient before the optimizer step "
                    "(backward not run on it, or a second forward without backward)"
                )
        rows = pending[0].rows if len(pending) == 1 else torch.cat([p.rows for p in pending])
        scales = torch.cat([p.scales.to(rows.device, torch.float64) for p in pending])
        losses = None
        if all(p.meta.get("loss") is not None for p in pending):
            losses = torch.cat([p.meta["loss"].to(rows.device) for p in pending])
        scores = self._scores(rows, losses)
        weights_local = torch.where(scales > 0, 1.0 / scales.clamp(min=1e-300), torch.zeros_like(scales))
        group = _Group(self.collective)
        all_scores = group.gather(scores)
        all_losses = group.gather(losses)
        all_weights = group.gather(weights_local)
        decided = self.policy.decide(int(all_weights.shape[0]), all_scores, all_losses, self.generator)
        decided = torch.as_tensor(decided).to(torch.float64).cpu().reshape(-1)
        n_all = all_weights.shape[0]
        if decided.shape[0] != n_all:
            raise CaptureUsageError(f"the policy returned {decided.shape[0]} weights for {n_all} examples")
        if not bool(torch.isfinite(decided).all()) or bool((decided < 0).any()):
            raise CaptureUsageError("the policy returned a negative or non-finite weight")
        start = group.offset(rows.shape[0])
        local = decided[start : start + rows.shape[0]].to(rows.device)
        factor = 1.0
        if self.renormalize and self.capture.config.loss_reduction != "sum":
            total = float(all_weights.sum())
            kept = float((all_weights.cpu() * decided).sum())
            factor = total / kept if kept > 0 else 1.0
        self._remove(pending, local, group)
        if factor != 1.0:
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        sources = [p.meta["ids"] if p.meta.get("ids") is not None else p.meta["hash_source"] for p in pending]
        decision = StepDecision(
            step=int(pending[0].meta.get("step", self.capture.step)),
            id_sources=sources,
            weights=local.cpu(),
            scores=None if scores is None else scores.cpu(),
            losses=None if losses is None else losses.cpu(),
            renormalization=factor,
            rank=self.capture.config.labels.rank,
        )
        self.last_decision = decision
        self.steps_decided += 1
        self.examples_seen += int(local.shape[0])
        self.examples_kept += int(decision.kept.sum())
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

    def _scores(self, rows: torch.Tensor, losses: torch.Tensor | None) -> torch.Tensor | None:
        if self.target is None:
            return None
        if isinstance(self.target, torch.Tensor):  # float32 GEMV (the rows are float32), scores as float64
            if self._target_cache is None or self._target_cache.device != rows.device:
                target = self.target.to(rows.device, torch.float64)
                if self.similarity == "cosine":
                    target = target / target.norm().clamp(min=1e-30)
                self._target_cache = target.to(rows.dtype)
            scores = rows @ self._target_cache
            if self.similarity == "cosine":
                scores = scores / rows.norm(dim=1).clamp(min=1e-30)
            return scores.double()
        scores = torch.as_tensor(self.target(rows, losses)).to(torch.float64).reshape(-1)
        if scores.shape[0] != rows.shape[0]:
            raise CaptureUsageError(f"the target function returned {scores.shape[0]} scores for {rows.shape[0]} rows")
        return scores

    def _remove(self, pending: list[_Pending], weights: torch.Tensor, group: _Group) -> None:
        """Add ``(w_b - 1)`` times each changed example's term to the gradients (all-reduced when collective)."""
        corrections: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        offset = 0
        for p in pending:
            size = p.rows.shape[0]
            w = weights[offset : offset + size]
            offset += size
            changed = torch.nonzero(w != 1).flatten()
            if changed.numel() == 0 and not self.collective:
                continue
            dropping = not self.collective and bool((w[changed] == 0).all())
            for module, kind, x, dy in p.uses:
                idx = changed.to(x.device)
                if dropping and kind != "embedding" and self._subtract_in_place(module, kind, x, dy, idx):
                    continue
                coef = (w[changed] - 1).to(dy.device, dy.dtype)
                d = (dy.index_select(0, idx.to(dy.device)) * coef.view(-1, *([1] * (dy.dim() - 1)))).reshape(
                    -1, dy.shape[-1]
                )
                xs = x.index_select(0, idx)
                if kind == "embedding":
                    tokens = xs.reshape(-1)
                    if module.padding_idx is not None:
                        d = d * (tokens != module.padding_idx).unsqueeze(1).to(d.dtype)
                    term = torch.zeros_like(module.weight).index_add_(0, tokens, d.to(module.weight.dtype))
                    self._accumulate(corrections, module.weight, term)
                    continue
                xs = xs.reshape(-1, xs.shape[-1]).to(d.dtype)
                term = d.T @ xs if kind == "linear" else xs.T @ d
                self._accumulate(corrections, module.weight, term.to(module.weight.dtype))
                if module.bias is not None and module.bias.requires_grad:
                    self._accumulate(corrections, module.bias, d.sum(0).to(module.bias.dtype))
        if self.collective:
            for param in self._params:  # every rank all-reduces the same parameters in the same order
                if param.requires_grad:
                    corrections.setdefault(id(param), (param, torch.zeros_like(param)))
        for key in sorted(corrections, key=lambda k: self._order(corrections[k][0])):
            param, term = corrections[key]
            term = group.average(term)
            if param.grad is None:
                param.grad = term.clone()
            else:
                param.grad.add_(term)

    @staticmethod
    def _subtract_in_place(module: nn.Module, kind: str, x: torch.Tensor, dy: torch.Tensor, idx: torch.Tensor) -> bool:
        """Pure drop on one process: subtract the dropped examples' terms straight from ``.grad`` (one ``addmm_``
        per weight); ``False`` when the gradients are missing or of another dtype (the general path then runs)."""
        weight, bias = module.weight, module.bias
        bias_grad = bias is not None and bias.requires_grad
        if weight.grad is None or (bias_grad and bias.grad is None):
            return False
        if not (x.dtype == dy.dtype == weight.grad.dtype) or (bias_grad and bias.grad.dtype != dy.dtype):
            return False
        d = dy.index_select(0, idx).reshape(-1, dy.shape[-1])
        xs = x.index_select(0, idx).reshape(-1, x.shape[-1])
        if kind == "linear":
            weight.grad.addmm_(d.T, xs, alpha=-1.0)
        else:  # conv1d: weight [d_in, d_out]
            weight.grad.addmm_(xs.T, d, alpha=-1.0)
        if bias_grad:
            bias.grad.sub_(d.sum(0))
        return True

    def _order(self, param: torch.Tensor) -> int:
        if not hasattr(self, "_param_order"):
            self._param_order = {id(p): i for i, p in enumerate(self.model.parameters())}
        return self._param_order.get(id(param), math.inf)

    @staticmethod
    def _accumulate(corrections: dict, param: torch.Tensor, term: torch.Tensor) -> None:
        key = id(param)
        if key in corrections:
            corrections[key][1].add_(term)
        else:
            corrections[key] = (param, term)


def _is_ddp(model: nn.Module) -> bool:
    """Whether several ranks run (their gradients then are DDP's average: decide and remove collectively)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _refuse_sharded(model: nn.Module) -> None:
    """FSDP shards parameters and gradients: the saved factors' terms do not fit the local gradient shard."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return
    for module in model.modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            raise ExactRemovalError(
                "online selection removes examples' terms from full gradients; FSDP shards them: train with "
                "DistributedDataParallel (or one process), or select offline"
            )


class _Group:
    """The collective side of a decision: gather every rank's values (in rank order), average corrections."""

    def __init__(self, collective: bool) -> None:
        dist = torch.distributed
        self.active = collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.sizes: list[int] | None = None

    def gather(self, values: torch.Tensor | None) -> torch.Tensor | None:
        if not self.active:
            return None if values is None else values.cpu()
        dist = torch.distributed
        present = torch.tensor([0 if values is None else 1])
        dist.all_reduce(present, op=dist.ReduceOp.MIN)
        if not bool(present.item()):
            return None
        values = values.detach().cpu().to(torch.float64)
        if self.sizes is None:
            size = torch.tensor([values.shape[0]])
            sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
            dist.all_gather(sizes, size)
            self.sizes = [int(s) for s in sizes]
        padded = torch.zeros(max(self.sizes), dtype=torch.float64)
        padded[: values.shape[0]] = values
        parts = [torch.zeros_like(padded) for _ in self.sizes]
        dist.all_gather(parts, padded)
        return torch.cat([part[:n] for part, n in zip(parts, self.sizes)])

    def offset(self, local_size: int) -> int:
        if not self.active:
            return 0
        return sum(self.sizes[: torch.distributed.get_rank()])

    def average(self, term: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return term
        dist = torch.distributed
        dist.all_reduce(term)
        return term / dist.get_world_size()
