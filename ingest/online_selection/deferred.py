"""Deferred weight gradients for online selection (:mod:`ingest.online_selection`): a selected step's Linear and
Conv1D weight gradients formed once, on the kept examples, at the decision.

Without deferral autograd forms every layer's ``dy^T x`` over the whole batch and the selector then subtracts the
dropped examples' terms: a GEMM over the dropped rows on top of the full one. Deferred, the layer runs on its
detached parameters (:func:`detached_gemm`: torch's own backward node gives only the input gradient), or through
:class:`DeferredGemm`, whose backward does the same, under saved-tensor hooks and for an input needing no gradient
without a bias; the selector keeps the layer's inputs and output gradients (it does anyway) and, at the decision,
forms ``(c * dy)^T x`` over the kept examples only, ``c`` their weights times the renormalisation. The step's GEMM
work then falls below a plain step's by the dropped share of the weight gradients, where subtracting added it.

Deferred only on one process (DDP reduces gradients as the backward forms them), for plain float GEMMs
(:func:`~ingest.fused.plain_gemm`) of modules whose forward nobody else replaced, while a batch is captured and
selected. A call of the module outside those (capture paused, a broadcast input, ``no_grad``, a recomputation in
the backward) runs :class:`DeferredGemm` with its weight gradients formed in the backward as torch's are, so a
forward and its gradient-checkpointing recomputation save the same tensors. Until the decision (the optimizer's
step pre-hook, or :meth:`OnlineSelector.apply`) a deferred weight's ``.grad`` is ``None``: what to call before
reading or clipping gradients is the same as without deferral, :meth:`~OnlineSelector.apply`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ingest.fused import plain_gemm

#: Marks an output whose layer's weight gradients the selector forms itself.
DEFERRED_MARK = "_gradstore_deferred"
#: Marks a deferred output computed from detached parameters (:func:`detached_gemm`): its nodes reach no parameter.
DETACHED_MARK = "_gradstore_detached"


class DeferredGemm(torch.autograd.Function):
    """``x W^T + b`` (``transposed``, ``nn.Linear``'s layout) or ``x W + b`` (HF ``Conv1D``), computed as the module
    computes it; the backward gives the input gradient and, unless ``defer``, the weight and bias gradients as
    torch's backward forms them."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed: bool, defer: bool):  # type: ignore[override]
        if transposed:
            out = torch.nn.functional.linear(x, weight, bias)
        else:
            x2d = x.reshape(-1, x.shape[-1])
            out = (x2d.mm(weight) if bias is None else torch.addmm(bias, x2d, weight)).view(*x.shape[:-1], -1)
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.defer, ctx.has_bias = transposed, defer, bias is not None
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1])
        grad_x = None
        if needs_x:
            grad_x = (dy2d.mm(weight) if ctx.transposed else dy2d.mm(weight.t())).view(x.shape)
        if ctx.defer:
            return grad_x, None, None, None, None
        x2d = x.reshape(-1, x.shape[-1])
        grad_weight = None
        if needs_weight:
            grad_weight = dy2d.t().mm(x2d) if ctx.transposed else x2d.t().mm(dy2d)
        grad_bias = dy2d.sum(0) if ctx.has_bias and needs_bias else None
        return grad_x, grad_weight, grad_bias, None, None


class DeferredForward:
    """A Linear or Conv1D module's forward replaced by one through :func:`detached_gemm` or :class:`DeferredGemm`
    (``should_defer(x)``: whether this call's weight gradients are left to the selector); :meth:`remove` gives the
    module its forward back."""

    def __init__(self, module: nn.Module, kind: str, should_defer: Callable[[torch.Tensor], bool]) -> None:
        self.module = module
        self.kind = kind
        self.should_defer = should_defer
        self.active = True
        self._original = module.forward
        self._forward = self._call  # one bound method, so remove() can tell whether it is still in place
        module.forward = self._forward

    def _call(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            not self.active
            or args
            or kwargs
            or not isinstance(x, torch.Tensor)
            or not plain_gemm(self.module, self.kind, x)
        ):
            return self._original(x, *args, **kwargs)
        weight, bias, transposed = self.module.weight, self.module.bias, self.kind == "linear"
        defer = self.should_defer(x)
        out = detached_gemm(x, weight, bias, transposed) if defer and not saved_tensor_hooks_active() else None
        if out is not None:
            setattr(out, DETACHED_MARK, True)
        else:
            out = DeferredGemm.apply(x, weight, bias, transposed, defer)
        if defer:
            setattr(out, DEFERRED_MARK, True)
        return out

    def remove(self) -> None:
        """Give the module its forward back (or, when another forward was put in front of this one since, pass
        every call through to the module's own)."""
        self.active = False
        if self.module.__dict__.get("forward") is self._forward:
            del self.module.forward


_TOP_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (non-reentrant gradient checkpointing's): its recomputation, in the
    backward, runs :class:`DeferredGemm` undeferred, so the forward must save what that saves (assumed active
    where torch does not say)."""
    return _TOP_SAVED_TENSOR_HOOKS is None or _TOP_SAVED_TENSOR_HOOKS(False) is not None


def detached_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor | None:
    """A deferred call's output computed as :class:`DeferredGemm` computes it, with the weight and bias detached:
    torch's own backward node then gives the input gradient alone, without a Python function each way. When ``x``
    needs no gradient the output keeps a backward node (for the gradient hooks) through a throwaway leaf copy of
    the bias; ``None`` when there is no bias to do that with (:class:`DeferredGemm` then runs)."""
    if not x.requires_grad:
        if bias is None:
            return None
        bias = bias.detach().requires_grad_()
    elif bias is not None:
        bias = bias.detach()
    weight = weight.detach()
    if transposed:
        return torch.nn.functional.linear(x, weight, bias)
    x2d = x.reshape(-1, x.shape[-1])
    return (x2d.mm(weight) if bias is None else torch.addmm(bias, x2d, weight)).view(*x.shape[:-1], -1)


def deferrable(module: nn.Module) -> bool:
    """Whether ``module``'s forward can be replaced: nobody put an instance-level forward on it."""
    return "forward" not in module.__dict__


class Coefficients:
    """A backward's per-example coefficients (a number, or an ``[n]`` tensor converted once per dtype and device
    of the output gradients it weights)."""

    def __init__(self, coef: float | torch.Tensor) -> None:
        self.coef = coef
        self._converted: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def like(self, dy: torch.Tensor) -> float | torch.Tensor:
        """The coefficients as a number, or as a tensor of ``dy``'s dtype and device."""
        if not isinstance(self.coef, torch.Tensor):
            return self.coef
        key = (dy.dtype, dy.device)
        if key not in self._converted:
            self._converted[key] = self.coef.to(dy.device, dy.dtype)
        return self._converted[key]


def add_weighted_product(
    module: nn.Module, kind: str, x: torch.Tensor, dy: torch.Tensor, rows: torch.Tensor | None, coef: Any
) -> None:
    """Add ``coef`` times the layer's weight and bias gradients over the examples ``rows`` (``None``: all) to their
    ``.grad``; ``coef`` is a number or a per-example tensor of ``dy``'s dtype and device (then ``rows`` is
    ``None``). A per-example ``coef`` scales the narrower of ``x`` and ``dy`` (the product takes it either way);
    the bias then weighs ``dy``'s per-example sums by it."""
    if rows is not None:
        dy, x = dy.index_select(0, rows), x.index_select(0, rows)
    weight, bias = module.weight, module.bias
    alpha, bias_term = 1.0, None
    if isinstance(coef, torch.Tensor):
        column = coef.view(-1, *([1] * (dy.dim() - 1)))
        if x.shape[-1] < dy.shape[-1]:
            x = x * column
            if bias is not None and bias.requires_grad:
                sums = dy if dy.dim() == 2 else dy.reshape(dy.shape[0], -1, dy.shape[-1]).sum(1)
                bias_term = sums.t().mv(coef)
        else:
            dy = dy * column
    else:
        alpha = float(coef)
    d, xs = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    a, b = (d.t(), xs) if kind == "linear" else (xs.t(), d)
    if not weight.requires_grad:  # frozen (e.g. only the bias trains): no gradient, as the backward forms none
        pass
    elif weight.grad is None:
        weight.grad = a.mm(b) if alpha == 1.0 else torch.empty_like(weight).addmm_(a, b, beta=0.0, alpha=alpha)
    else:
        weight.grad.addmm_(a, b, alpha=alpha)
    if bias is not None and bias.requires_grad:
        term = d.sum(0) if bias_term is None else bias_term
        if bias.grad is None:
            bias.grad = term if alpha == 1.0 else term.mul_(alpha)
        else:
            bias.grad.add_(term, alpha=alpha)


def zero_missing(module: nn.Module) -> None:
    """Zero gradients where every example of a deferred layer was dropped (the optimizer still steps them, as it
    does a step on no examples)."""
    for param in (module.weight, module.bias):
        if param is not None and param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
