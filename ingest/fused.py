"""Projections fused into a captured layer's own GEMMs (``CaptureConfig(fused=True)``).

Capture's hooks project a layer's inputs and output gradients with GEMMs of their own, which read every
activation and output gradient once more after the layer has (``docs/capture.md``). Fused, the input projection
rides as ``k_in`` extra columns on the layer's forward GEMM (``x [W | P_in^T]``, with ``P_in``'s bias column on
the bias) and the output-gradient projection as ``k_out`` extra columns on its input-gradient GEMM
(``dy [W^T | P_out^T]``), so each tensor is read once for both.

The layer's own columns come from the same GEMM calls, with operands in the same layouts, as torch's ``addmm``
(HF ``Conv1D``; ``nn.Linear`` on 2-D or contiguous 3-D inputs) and its backward, and the weight and bias
gradients are computed as torch's backward computes them; where the BLAS would sum the widened GEMM in another
order (checked once per shape, :func:`widening_is_exact`), that pass runs unfused. Training stays bit-identical
(tested). Only
``factorized`` slots on the ``project`` route of float inputs outside autocast are fused; every other call runs
the module's own forward and the hooks of :mod:`ingest.hooks`. A fused module runs fused whether or not a batch
is being captured, so a forward and its gradient-checkpointing recomputation save the same tensors.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ingest.per_example import choose_route

#: Output values a widening is checked on (see :func:`widening_is_exact`).
CHECKED_VALUES = 1 << 14
#: Marks an output made by a fused forward, so the layer's forward hook leaves it to :class:`FusedGemm`.
FUSED_MARK = "_gradstore_fused"


class FusedLayer(Protocol):
    """What :class:`FusedGemm` needs from a layer hook."""

    #: ``(pass, shape, threads, device type, dtype) -> whether that pass widens exactly`` (:func:`widening_is_exact`)
    fusion_checks: dict[tuple, bool]

    def operands(self, device: torch.device, dtype: torch.dtype) -> Any: ...

    def add_projected(self, generation: int, inputs: torch.Tensor, gradients: torch.Tensor) -> None: ...


class FusedGemm(torch.autograd.Function):
    """``x W + b`` (``transposed``: ``x W^T + b``, ``nn.Linear``'s layout) whose forward GEMM also projects the
    inputs and whose input-gradient GEMM also projects the output gradients; the backward hands both, per
    example, to the layer (``capture``: ``(generation, batch size)``, or ``None`` to compute only).

    The BLAS does not promise that extra columns leave the others' bits alone (a 5 -> 6 layer on 4 rows sums in
    another order), so each pass checks once per shape and thread count, on random operands of those shapes and
    layouts, that the widened GEMM gives the layer's own columns bit for bit (:func:`widening_is_exact`); where it
    does not, that pass runs unfused (the layer's own GEMM and a projection GEMM, as the hooks do) in the same
    autograd node, so a checkpointed forward and its recomputation save the same tensors."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, transposed: bool, layer: FusedLayer, capture):  # type: ignore[override]
        ops = layer.operands(x2d.device, x2d.dtype)
        in_weight = ops.in_t.T if transposed else ops.in_t
        key = ("forward", tuple(x2d.shape), torch.get_num_threads(), x2d.device.type, x2d.dtype)
        if key not in layer.fusion_checks:
            layer.fusion_checks[key] = widening_is_exact(x2d, weight, in_weight, transposed, bias is not None)
        if layer.fusion_checks[key]:
            wide = _product(x2d, _widened(weight, in_weight, transposed), _widened_bias(bias, ops.in_bias))
            d_out = weight.shape[0] if transposed else weight.shape[1]
            out, inputs = wide[:, :d_out], wide[:, d_out:].contiguous()  # kept alone: the output is not saved
        else:
            out = _product(x2d, weight.t() if transposed else weight, bias)
            inputs = _product(x2d, ops.in_t, ops.in_bias if bias is not None else None)
        ctx.save_for_backward(x2d, weight, inputs)
        ctx.transposed, ctx.has_bias, ctx.layer, ctx.capture = transposed, bias is not None, layer, capture
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2d, weight, inputs = ctx.saved_tensors
        ops = ctx.layer.operands(dy.device, dy.dtype)
        # torch's mm backward multiplies dy by nn.Linear's W as it is, and by Conv1D's W as a transposed view
        own = weight if ctx.transposed else weight.t()
        out_weight = ops.out_t if ctx.transposed else ops.out_t.T
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        key = ("backward", tuple(dy.shape), torch.get_num_threads(), dy.device.type, dy.dtype)
        if needs_x and key not in ctx.layer.fusion_checks:
            ctx.layer.fusion_checks[key] = widening_is_exact(dy, weight, out_weight, not ctx.transposed)
        if not needs_x:  # e.g. the first layer on raw inputs: torch's backward skips dy W, so only project
            grad_x, gradients = None, dy.mm(ops.out_t)
        elif ctx.layer.fusion_checks[key]:
            wide_dx = dy.mm(_widened(weight, out_weight, not ctx.transposed))
            grad_x, gradients = wide_dx[:, : own.shape[1]], wide_dx[:, own.shape[1] :]
        else:
            grad_x, gradients = dy.mm(own), dy.mm(ops.out_t)
        grad_weight = None
        if needs_weight:  # as torch's mm backward forms it
            grad_weight = dy.t().mm(x2d) if ctx.transposed else x2d.t().mm(dy)
        grad_bias = dy.sum(0) if ctx.has_bias and needs_bias else None
        if ctx.capture is not None:
            generation, batch_size = ctx.capture
            ctx.layer.add_projected(
                generation,
                inputs.view(batch_size, -1, inputs.shape[1]),
                gradients.reshape(batch_size, -1, gradients.shape[1]),
            )
        return grad_x, grad_weight, grad_bias, None, None, None


def _widened(weight: torch.Tensor, extra: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``weight`` (times ``x`` from the left) with ``extra`` as more output columns, in the layout torch multiplies
    ``weight`` in: ``transposed``, ``weight`` is ``[out, in]`` used as ``weight.t()`` (a column-major view), and
    ``extra`` is ``[k, in]``; else ``weight`` is ``[in, out]`` as it is and ``extra`` is ``[in, k]``."""
    return torch.cat([weight, extra], 0).t() if transposed else torch.cat([weight, extra], 1)


def _widened_bias(bias: torch.Tensor | None, extra: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else torch.cat([bias, extra])


def _product(x2d: torch.Tensor, operand: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2d @ operand (+ bias)``: ``addmm`` with a bias, ``mm`` without, as ``F.linear`` and ``Conv1D`` do."""
    return x2d.mm(operand) if bias is None else torch.addmm(bias, x2d, operand)


# Verdicts are kept per exact shape (the BLAS picks kernels by shape), so every new token count costs one check.
def widening_is_exact(
    x2d: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor, transposed: bool, with_bias: bool = False
) -> bool:
    """Whether ``x2d`` times the widened ``weight`` (:func:`_widened`; plus a widened bias) gives ``x2d`` times
    ``weight``'s own columns bit for bit at these shapes, layouts and thread count. Checked on standard normal
    operands, as many draws as give at least :data:`CHECKED_VALUES` output values: a GEMM that sums in another
    order rounds a good share of its outputs differently (13% in a 5 x 6 case), so agreement on thousands of them
    leaves no doubt."""
    generator = torch.Generator().manual_seed(0)

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device=x2d.device, dtype=x2d.dtype)

    d_out = weight.shape[0] if transposed else weight.shape[1]
    for _ in range(max(1, -(-CHECKED_VALUES // (x2d.shape[0] * d_out)))):
        x, w, more = draw(tuple(x2d.shape)), draw(tuple(weight.shape)), draw(tuple(extra.shape))
        bias, more_bias = (draw((d_out,)), draw((more.numel() // x2d.shape[1],))) if with_bias else (None, None)
        own = _product(x, w.t() if transposed else w, bias)
        if not torch.equal(_product(x, _widened(w, more, transposed), _widened_bias(bias, more_bias))[:, :d_out], own):
            return False
    return True


def plain_gemm(module: nn.Module, kind: str, x: torch.Tensor) -> bool:
    """Whether a call of the Linear or Conv1D ``module`` on ``x`` is one plain float GEMM a custom autograd
    function can take over with the module's own operands: no tensor-subclass weights, one float dtype, no
    autocast, one device, a batch with rows, no functorch transform, and (``nn.Linear``) a layout ``F.linear``
    folds into one ``addmm``/``mm``."""
    weight, bias = module.weight, module.bias
    plain = (torch.Tensor, nn.Parameter)
    if type(weight) not in plain or (bias is not None and type(bias) not in plain):
        return False  # tensor subclasses (DTensor, quantized weights) multiply their own way
    if not x.is_floating_point() or x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        return False
    if torch.is_autocast_enabled(x.device.type) or x.device != weight.device or x.dim() < 2 or x.numel() == 0:
        return False
    if getattr(torch._C, "_are_functorch_transforms_active", lambda: False)():  # vmap/grad: no setup_context
        return False
    d_in = weight.shape[1] if kind == "linear" else weight.shape[0]
    if x.shape[-1] != d_in:
        return False
    return kind != "linear" or x.dim() == 2 or (x.dim() == 3 and x.is_contiguous())  # F.linear's one addmm / mm


def fusable(module: nn.Module, kind: str, x: torch.Tensor, route: str, k_in: int, k_out: int) -> bool:
    """Whether a call of ``module`` on ``x`` can run fused with its outputs bit-identical to its own forward."""
    if not plain_gemm(module, kind, x):
        return False
    weight, bias = module.weight, module.bias
    d_in, d_out = (weight.shape[1], weight.shape[0]) if kind == "linear" else weight.shape
    if route == "auto":
        route = choose_route(x[0].numel() // d_in, d_in + (bias is not None), d_out, k_in, k_out)
    return route == "project"
