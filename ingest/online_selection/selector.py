"""The online selector (:mod:`ingest.online_selection`): keeps each captured forward's inputs and output gradients
per use, decides every optimizer step from the capture's rows, and removes the dropped or reweighted examples'
exact terms from ``.grad`` before the step."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ingest.capture import GradientCapture
from ingest.hooks import ActiveBatch, in_backward
from ingest.misuse import CaptureUsageError
from ingest.online_selection.collective import Group, is_ddp
from ingest.online_selection.decision import StepDecision
from ingest.online_selection.deferred import (
    DEFERRED_MARK,
    DETACHED_MARK,
    Coefficients,
    DeferredForward,
    add_weighted_product,
    deferrable,
    zero_missing,
)
from ingest.online_selection.policies import SelectionPolicy
from ingest.online_selection.removable import OutsideUses, refuse_sharded, removable_modules
from ingest.online_selection.target import Target
from ingest.output_hooks import on_gradient


@dataclass
class _Pending:
    """One captured backward of the current step: its rows and every use of every trainable module (``[module, kind,
    inputs, output gradients, deferred]``: whether the use's weight gradients are left to the decision)."""

    rows: torch.Tensor | None = None
    meta: dict[str, Any] | None = None
    scales: torch.Tensor | None = None
    uses: list[list[Any]] | None = None


class OnlineSelector:
    """Drop or reweight examples of every optimizer step before it runs, from the capture's per-example rows.

    ``capture``: the running :class:`GradientCapture` (its rows give the scores; every backward since the last
    step is decided together, so gradient accumulation selects over the whole step). ``policy``: a
    :class:`SelectionPolicy` (:class:`KeepTopFraction`, :class:`DropBelowThreshold`, :class:`LossBased`,
    :class:`RandomSelection` or your own). ``target``: a ``[dim]`` tensor (score = ``row . target``, or the
    cosine with ``similarity="cosine"``), or a function ``(rows [n, dim], losses [n] | None) -> [n]`` scores.
    ``renormalize``: see :mod:`ingest.online_selection`. ``optimizer``: whose step pre-hook applies the decision
    (default: the capture's; else any optimizer stepping this model's parameters). Call :meth:`apply` yourself
    before gradient clipping (the pre-hook then finds nothing left to do). ``on_decision(StepDecision)`` is told of
    every decision.
    ``collective``: decide over every rank's examples together and remove the dropped terms from DDP's all-reduced
    (averaged) gradient (default: ``True`` whenever ``torch.distributed`` runs more than one rank; pass ``False``
    for ranks that train independently). FSDP (sharded gradients) is refused.

    On one process the Linear and Conv1D weight gradients of a selected step are formed at the decision, over the
    kept examples only (:mod:`ingest.online_selection.deferred`): until then their ``.grad`` is ``None``.
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
        if not isinstance(renormalize, bool):
            raise CaptureUsageError(f"renormalize must be True or False, got {renormalize!r}")
        if collective is not None and not isinstance(collective, bool):
            raise CaptureUsageError(f"collective must be True, False or None (DDP detected), got {collective!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 1 << 64:
            raise CaptureUsageError(
                f"seed must be a whole number in [0, 2**64) (it seeds RandomSelection's draws), got {seed!r}"
            )
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
            if target.is_floating_point() and not bool(torch.isfinite(target).all()):
                raise CaptureUsageError(
                    "target has NaN or infinite entries (scores against it would keep an arbitrary subset): pass a "
                    "finite [dim] vector, e.g. the mean of finite stored query rows"
                )
        elif target is not None and not callable(target):
            raise CaptureUsageError(f"target must be a tensor, a function or None, got {type(target).__name__}")
        if getattr(policy, "needs_loss", False) and capture.per_example_loss is None:
            raise CaptureUsageError(
                f"{type(policy).__name__} ranks examples by loss: give the capture per_example_loss=... "
                "(e.g. ingest.losses.causal_lm_loss)"
            )
        if capture.config.example_dim != 0:
            raise CaptureUsageError(
                f"online selection removes examples' terms along dim 0 of each layer's input; this capture reads "
                f"the examples along dim {capture.config.example_dim}: select offline, or feed the model batch-first"
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
        self.renormalize = renormalize
        self.optimizer = optimizer or capture.optimizer
        self.on_decision = on_decision
        self.generator = torch.Generator().manual_seed(int(seed))
        self.model = capture.model
        self.collective = is_ddp(self.model) if collective is None else collective
        refuse_sharded(self.model)
        self.modules = removable_modules(self.model)
        self._params = list({id(p): p for m, _ in self.modules for p in m.parameters(recurse=False)}.values())
        self._param_ids = {id(p) for p in self._params}  # a tied weight (embedding and LM head) counted once
        self._outside = OutsideUses(self.model, self._params)
        self._pending: dict[int, _Pending] = {}
        self._handles: list[Any] = []
        self.last_decision: StepDecision | None = None
        self._target_cache: torch.Tensor | None = None
        self._ones_cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.steps_decided = 0
        self.examples_seen = 0
        self.examples_kept = 0

    # ------------------------------------------------------------------ context
    def __enter__(self) -> OnlineSelector:
        self._handles = [self.capture.add_row_listener(self._rows_arrived)]
        self._handles.append(self.model.register_forward_hook(self._forward_done, always_call=True))
        for module, kind in self.modules:
            self._handles.append(module.register_forward_hook(self._make_forward_hook(kind)))
            if kind != "embedding" and not self.collective and not self.capture.fused and deferrable(module):
                self._handles.append(DeferredForward(module, kind, self._defers))
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
        self._outside.clear()

    # ------------------------------------------------------------------ hooks
    def _defers(self, x: torch.Tensor) -> bool:
        """Whether a layer's call on ``x`` leaves its weight gradients to the decision: a captured, selected batch's
        forward (what the forward hook records as a use)."""
        batch = self.capture.batch
        return (
            batch is not None
            and not self.capture.is_paused
            and torch.is_grad_enabled()
            and not in_backward()
            and x.shape[0] == batch.size
        )

    def _make_forward_hook(self, kind: str) -> Callable[..., torch.Tensor | None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> torch.Tensor | None:
            batch = self.capture.batch
            if batch is None or self.capture.is_paused or not torch.is_grad_enabled() or in_backward():
                return
            if not isinstance(output, torch.Tensor) or not output.requires_grad or not args:
                return
            if not getattr(output, DETACHED_MARK, False):  # a detached GEMM's nodes reach no parameter
                self._outside.module_ran(module, args, output)
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
            use = [module, kind, x, None, getattr(output, DEFERRED_MARK, False)]
            self._pending_of(batch).uses.append(use)

            def grad_hook(dy: torch.Tensor) -> None:
                use[3] = dy.detach() if use[3] is None else use[3] + dy.detach()

            on_gradient(output, grad_hook)
            return replaced

        return hook

    def _forward_done(self, module: nn.Module, args: tuple, output: Any) -> None:
        """End of a forward of the model: a captured one must use every selected parameter through its module only
        (:class:`~ingest.online_selection.removable.OutsideUses`)."""
        batch = self.capture.batch
        if batch is None or self.capture.is_paused or not torch.is_grad_enabled() or in_backward():
            self._outside.clear()
            return
        self._outside.check(output)

    def _pending_of(self, batch: ActiveBatch) -> _Pending:
        """The pending record of ``batch``'s backward (created at its first use)."""
        pending = self._pending.get(batch.generation)
        if pending is None:
            pending = self._pending[batch.generation] = _Pending(uses=[])
        return pending

    def _rows_arrived(self, batch: ActiveBatch, rows: torch.Tensor) -> None:
        pending = self._pending_of(batch)
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
        pending = [p for p in self._pending.values() if p.rows is not None or p.uses]  # in generation order
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
        if len(pending) == 1:
            rows, scales = pending[0].rows, pending[0].scales
        else:
            rows, scales = torch.cat([p.rows for p in pending]), torch.cat([p.scales for p in pending])
        losses = None
        if all(p.meta.get("loss") is not None for p in pending):
            losses = torch.cat([p.meta["loss"].to(rows.device) for p in pending])
        scores = self._scores(rows, losses)
        # an example of scale 0 (no tokens) weighs 0
        weights_local = torch.reciprocal(scales.to(rows.device, torch.float64)).nan_to_num_(posinf=0.0)
        group = Group(self.collective)
        all_scores = group.gather(scores)
        all_losses = group.gather(losses)
        all_weights = group.gather(weights_local)
        decided = self.policy.decide(int(all_weights.shape[0]), all_scores, all_losses, self.generator)
        if not isinstance(decided, torch.Tensor) or decided.device.type != "cpu" or decided.dim() != 1:
            decided = torch.as_tensor(decided).cpu().reshape(-1)
        n_all = all_weights.shape[0]
        if decided.shape[0] != n_all:
            raise CaptureUsageError(f"the policy returned {decided.shape[0]} weights for {n_all} examples")
        if decided.dtype != torch.bool and not bool((torch.isfinite(decided) & (decided >= 0)).all()):
            raise CaptureUsageError("the policy returned a negative or non-finite weight")
        keep_or_drop = decided.dtype == torch.bool  # a mask: every changed example is dropped
        decided = decided.to(torch.float64)
        start = group.offset(rows.shape[0])
        local = decided if group.sizes is None else decided[start : start + rows.shape[0]]
        local = local.to(rows.device)
        factor = 1.0
        if self.renormalize and self.capture.config.loss_reduction != "sum":
            total, kept = torch.stack((all_weights.sum(), all_weights @ decided)).tolist()
            factor = total / kept if kept > 0 else 1.0
        scaled: set[int] = set()
        if self.collective or not all(use[4] for p in pending for use in p.uses):
            scaled = self._remove(pending, local, group, factor, keep_or_drop)
        if factor != 1.0:
            for p in self._params:
                if p.grad is not None and id(p) not in scaled:
                    p.grad.mul_(factor)
        self._form_deferred(pending, local, factor, keep_or_drop)
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
        self.examples_kept += int(torch.count_nonzero(local))
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
                scores.div_(torch.linalg.vector_norm(rows, dim=1).clamp_(min=1e-30))
            return scores.double()
        scores = torch.as_tensor(self.target(rows, losses)).to(torch.float64).reshape(-1)
        if scores.shape[0] != rows.shape[0]:
            raise CaptureUsageError(f"the target function returned {scores.shape[0]} scores for {rows.shape[0]} rows")
        return scores

    def _remove(
        self, pending: list[_Pending], weights: torch.Tensor, group: Group, factor: float, keep_or_drop: bool
    ) -> set[int]:
        """Add ``(w_b - 1)`` times each changed example's term to the gradients (all-reduced when collective);
        the gradients a pure drop subtracts from in place are also multiplied by the renormalisation ``factor`` in
        the same call: their ids are returned (the caller scales the others)."""
        corrections: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        scaled: set[int] = set()
        offset = 0
        for p in pending:
            size = p.rows.shape[0]
            w = weights[offset : offset + size]
            offset += size
            if all(use[4] for use in p.uses) and not self.collective:
                continue  # every use's weight gradients are formed at the decision (_form_deferred)
            changed = torch.nonzero(w == 0 if keep_or_drop else w != 1).flatten()
            if changed.numel() == 0 and not self.collective:
                continue
            dropping = not self.collective and (keep_or_drop or bool((w[changed] == 0).all()))
            for module, kind, x, dy, deferred in p.uses:
                if deferred:
                    continue
                idx = changed.to(x.device)
                if (
                    dropping
                    and kind != "embedding"
                    and self._subtract_in_place(module, kind, x, dy, idx, factor, scaled)
                ):
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
                if module.weight.requires_grad:
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
            else:  # a gradient scaled already takes its term scaled too
                param.grad.add_(term, alpha=factor if id(param) in scaled else 1.0)
        return scaled

    @staticmethod
    def _form_deferred(pending: list[_Pending], weights: torch.Tensor, factor: float, keep_or_drop: bool) -> None:
        """Add the deferred uses' weight gradients over their kept examples, each weighted by its decided weight
        times the renormalisation ``factor`` (after the other gradients are scaled by it). A mask keeping fewer
        than half of a backward's examples gathers the kept ones; otherwise every example's output gradient is
        multiplied by its coefficient (0 for a dropped one) in the same pass, without gathers."""
        offset = 0
        for p in pending:
            size = p.rows.shape[0]
            w = weights[offset : offset + size]
            offset += size
            deferred = [use for use in p.uses if use[4]]
            if not deferred:
                continue
            rows, coef = None, factor
            if keep_or_drop:
                kept = torch.nonzero(w).flatten()
                if kept.numel() == 0:
                    for module, *_ in deferred:
                        zero_missing(module)
                    continue
                if 2 * kept.numel() < size:
                    rows = kept
                elif kept.numel() < size:
                    coef = w * factor
            else:
                coef = w * factor
            coefs = Coefficients(coef)
            for module, kind, x, dy, _ in deferred:
                add_weighted_product(module, kind, x, dy, None if rows is None else rows.to(x.device), coefs.like(dy))

    def _subtract_in_place(
        self,
        module: nn.Module,
        kind: str,
        x: torch.Tensor,
        dy: torch.Tensor,
        idx: torch.Tensor,
        factor: float,
        scaled: set[int],
    ) -> bool:
        """Pure drop on one process: subtract the dropped examples' terms straight from ``.grad``, one ``addmm_``
        per weight and one ``addmv_`` per bias, each also applying the renormalisation ``factor`` the first time it
        touches a gradient (its id then joins ``scaled``); ``False`` when the gradients are missing or of another
        dtype (the general path then runs)."""
        weight, bias = module.weight, module.bias
        bias_grad = bias is not None and bias.requires_grad
        if weight.grad is None or (bias_grad and bias.grad is None):
            return False
        if not (x.dtype == dy.dtype == weight.grad.dtype) or (bias_grad and bias.grad.dtype != dy.dtype):
            return False
        d = dy.index_select(0, idx).reshape(-1, dy.shape[-1])
        xs = x.index_select(0, idx).reshape(-1, x.shape[-1])
        beta = 1.0 if id(weight) in scaled else factor
        if kind == "linear":
            weight.grad.addmm_(d.T, xs, beta=beta, alpha=-factor)
        else:  # conv1d: weight [d_in, d_out]
            weight.grad.addmm_(xs.T, d, beta=beta, alpha=-factor)
        scaled.add(id(weight))
        if bias_grad:
            ones = self._ones(d.shape[0], d.dtype, d.device)
            bias.grad.addmv_(d.T, ones, beta=1.0 if id(bias) in scaled else factor, alpha=-factor)
            scaled.add(id(bias))
        return True

    def _ones(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``n`` ones: a view of one kept vector per dtype and device, regrown when a step needs more (the biases'
        row sums take one per step and layer)."""
        ones = self._ones_cache.get((dtype, device))
        if ones is None or ones.shape[0] < n:
            ones = self._ones_cache[(dtype, device)] = torch.ones(
                max(n, 2 * (0 if ones is None else ones.shape[0])), dtype=dtype, device=device
            )
        return ones[:n]

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
