"""Optimizer-aware rows (LESS): gradients normalised by Adam's second moments, in a projection-compatible form.

LESS scores training examples with Adam's update direction, roughly ``G / sqrt(v)`` elementwise, where ``v`` is
Adam's (bias-corrected) second moment of the weight. An elementwise division does not commute with a
Kronecker projection, so we use an **Adafactor-style factored** second moment: for the layer's
``[d_out, d_in (+1 bias column)]`` matrix ``V``, ``V ~= r c^T / sum(r)`` with row sums ``r`` and column sums
``c``. Then

    G / sqrt(V) ~= D_out G D_in,   D_out = diag((r / sum(r))^-1/2),   D_in = diag(c^-1/2)

and the projected row is ``P_out D_out G D_in P_in^T = (P_out D_out) G (P_in D_in)^T``: the normalisation is
folded into the projection matrices (or applied to the materialised gradient for exact/dense slots), so the
factorized route keeps its cost. The factors are refreshed from the optimizer by the first captured forward
after each optimizer step.

``"adam_sqrt"`` divides by ``V^1/4`` instead (the square roots of the same factors): rows in the coordinates
``u = V^1/4 theta`` where an Adam step (without momentum) is a plain gradient step at the learning rate,
``du = -lr V^-1/4 g``. Captured on every side (training rows, queries, true-Fisher rows), they make the
trajectory methods' ``lr x curvature`` dynamics (``source``, ``dvemb``) Adam's linearised ones, and inner
products ``q . g`` the first-order effect of an Adam step (``q^T V^-1/2 g``). Its factors are floored at
:data:`SQRT_FLOOR` of their mean.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NORMALIZERS = (None, "adam_factored", "adam_sqrt")
#: The power of the factored second moment each normaliser divides by: ``G / V^power``.
NORMALIZER_POWERS = {"adam_factored": 0.5, "adam_sqrt": 0.25}
#: ``adam_sqrt`` floors each factor of ``V`` at this share of its mean: Adam's ``eps`` in relative form. The
#: capture divides by the moments of the steps before (Adam's own step includes the current gradient), so a
#: coordinate first reached now (a rare token's embedding row early in training) would be divided by about 0.
SQRT_FLOOR = 1e-2


def factored_scales(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_scale [d_out], in_scale [d_in])`` with ``out_o * in_i = (r_o c_i / sum(r))^-1/2`` for a
    non-negative ``v: [d_out, d_in]`` (row sums ``r``, column sums ``c``); float32."""
    v = v.detach().double().clamp(min=0)
    return scales_from_sums(v.sum(dim=1), v.sum(dim=0))


def scales_from_sums(rows: torch.Tensor, cols: torch.Tensor, floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`factored_scales` from the row sums ``[d_out]`` and column sums ``[d_in]`` (float64) of ``v``;
    ``floor``: each factor at least that share of its mean (0: none)."""
    tiny = torch.finfo(torch.float32).tiny
    out_factor = rows / rows.sum().clamp(min=tiny)
    return _floored(out_factor, floor, tiny).rsqrt().float(), _floored(cols, floor, tiny).rsqrt().float()


def _floored(factor: torch.Tensor, floor: float, tiny: float) -> torch.Tensor:
    return factor.clamp(min=max(tiny, floor * float(factor.mean()))) if floor else factor.clamp(min=tiny)


def adam_factored_scales(
    optimizer: torch.optim.Optimizer, module: nn.Module, kind: str, has_bias: bool, power: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``factored_scales(adam_second_moment(...))`` without building ``v``: the row and column sums are reduced
    straight from the optimizer's ``exp_avg_sq`` (float64 accumulation) and bias-corrected afterwards. Adam's
    second moments are non-negative, so no entry needs the clamp. ``None`` while the optimizer holds no state.
    ``power``: the scales of ``V^-power`` (``NORMALIZER_POWERS``; 0.5: Adam's update direction)."""
    weight = _moment(optimizer, module.weight)
    bias = _moment(optimizer, module.bias) if has_bias else None
    if weight is None or (has_bias and bias is None):
        return None
    v, correction = weight
    v = as_matrix(v, kind)
    out_dim = 1 if kind in ("conv1d", "embedding") else 0  # Conv1D weights are [in, out]; embeddings [num, dim]
    rows = v.sum(dim=1 - out_dim, dtype=torch.float64) / correction
    cols = v.sum(dim=out_dim, dtype=torch.float64) / correction
    if bias is not None:
        v_b = bias[0].reshape(-1).double() / bias[1]
        rows = rows + v_b
        cols = torch.cat([cols, v_b.sum().reshape(1)])
    if power == 0.5:
        return scales_from_sums(rows, cols)
    out_scale, in_scale = scales_from_sums(rows, cols, SQRT_FLOOR)
    return out_scale.pow(2 * power), in_scale.pow(2 * power)


def as_matrix(v: torch.Tensor, kind: str) -> torch.Tensor:
    """A layer's weight-shaped tensor as the 2-D matrix of its slot (a convolution's ``[C_out, C_in x kernel]``, a
    bare parameter's ``[-1, last dim]``); 2-D weights as they are."""
    if v.dim() == 2:
        return v
    return v.reshape(v.shape[0], -1) if kind == "conv" else v.reshape(-1, v.shape[-1] if v.dim() else 1)


def _moment(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """``(exp_avg_sq, bias correction)`` of ``param``, or None without optimizer state."""
    state = optimizer.state.get(param, {})
    moment = raw_second_moment(state)
    if moment is None:
        return None
    return _full(moment).detach(), bias_correction(optimizer, param, state)


def raw_second_moment(state: dict[str, Any]) -> torch.Tensor | None:
    """The second moment an Adam step divides by, before bias correction, from one parameter's optimizer
    ``state``: ``max_exp_avg_sq`` under ``amsgrad=True`` (the running maximum the step uses), else
    ``exp_avg_sq``; ``None`` without state."""
    moment = state.get("max_exp_avg_sq")
    return moment if moment is not None else state.get("exp_avg_sq")


def adam_second_moment(
    optimizer: torch.optim.Optimizer, module: nn.Module, kind: str, has_bias: bool
) -> torch.Tensor | None:
    """Bias-corrected Adam second moment ``v_hat`` of a layer in ``[d_out, d_in (+1)]`` orientation (bias as
    the last column), or ``None`` while the optimizer holds no state for its weight."""
    weight = module.weight
    state = optimizer.state.get(weight, {})
    moment = raw_second_moment(state)
    if moment is None:
        return None
    v = _full(moment) / bias_correction(optimizer, weight, state)
    v = as_matrix(v, kind)
    v = v.T if kind in ("conv1d", "embedding") else v  # Conv1D weights are [in, out]; embeddings [num, dim]
    if has_bias:
        bias_state = optimizer.state.get(module.bias, {})
        bias_moment = raw_second_moment(bias_state)
        if bias_moment is None:
            return None
        v_b = _full(bias_moment) / bias_correction(optimizer, module.bias, bias_state)
        v = torch.cat([v, v_b.reshape(-1, 1)], dim=1)
    return v


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 DTensor state (collective)


def bias_correction(optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict[str, Any]) -> float:
    """Adam's bias correction ``1 - beta2^step`` of ``param``'s second moment (``state``: its optimizer state)."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    beta2 = group.get("betas", (0.9, 0.999))[1]
    step = float(state.get("step", 1))
    return 1.0 - beta2 ** max(step, 1.0)
