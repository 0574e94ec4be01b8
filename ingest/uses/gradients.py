"""The per-example gradient of each use the op-level capture (:mod:`ingest.uses`) takes: the output-gradient hooks
it registers (Linear rule, grouped and gathered MoE slices, convolutions, normalisations, parameter-only tensors
meeting the batch) and the pieces they need (im2col patches, an operand's gradient split per example, a
parameter's gradient in its slot's orientation)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ingest.hooks import LayerHook, RecomputationError, guarded
from ingest.per_example import embedding_exact


@guarded
def hook_backward(
    hook: LayerHook,
    generation: int,
    route: str,
    saved: torch.Tensor,
    layout: Callable[[torch.Tensor], torch.Tensor] | None,
    dy: torch.Tensor,
) -> None:
    hook._backward(generation, route, saved, dy if layout is None else layout(dy))


@guarded
def rows_backward(
    hook: LayerHook,
    generation: int,
    x: torch.Tensor,
    owner: torch.Tensor,
    widen: Callable[[torch.Tensor], torch.Tensor] | None,
    dy: torch.Tensor,
) -> None:
    hook.add_rows(generation, x, dy if widen is None else widen(dy), owner)


@guarded
def bias_backward(
    hook: LayerHook, generation: int, widen: Callable[[torch.Tensor], torch.Tensor], dy: torch.Tensor
) -> None:
    """A 1-D parameter ``hook`` holds, used as (a block of) a linear op's bias: each example's gradient is its
    output gradient summed over its positions, in the parameter's rows (``widen``: batch-first, zeros elsewhere)."""
    full = widen(dy.detach())
    hook.add_gradient(generation, full.reshape(full.shape[0], -1, full.shape[-1]).sum(1, keepdim=True))


@guarded
def matmul_backward(
    hook: LayerHook,
    generation: int,
    rows: torch.Tensor,
    owner: torch.Tensor,
    dim: int,
    x_first: bool,
    gradient_rows: bool,
    dy: torch.Tensor,
) -> None:
    """A use of a 2-D parameter in a matrix product with the batch's ``x`` (:meth:`UseRules._matmul`): ``rows``
    ``[N, d]`` are the rows (``x @ M``) or columns (``M @ x``) of ``x``, example ``owner[n]`` each, matched with the
    same rows or columns of ``dy``. ``gradient_rows``: the parameter's dim 0 is the output gradient's side."""
    dy = dy.detach().movedim(dim, 0)
    if not x_first:
        dy = dy.transpose(-1, -2)
    dy = dy.reshape(rows.shape[0], -1)
    if gradient_rows:
        hook.add_rows(generation, rows, dy, owner, bias=False)
    else:
        hook.add_rows(generation, dy, rows, owner, bias=False)


@guarded
def lookup_backward(
    hook: LayerHook,
    generation: int,
    idx: torch.Tensor,
    dim: int,
    num_embeddings: int,
    padding_idx: int | None,
    dy: torch.Tensor,
) -> None:
    """A lookup in a transposed parameter (:meth:`UseRules._transposed_lookup`): ``idx`` ``[B, T]`` batch-first,
    ``dy`` with the examples along ``dim``; each example's ``[d, num_embeddings]`` gradient, materialised."""
    dy = dy.detach() if dim == 0 else dy.detach().movedim(dim, 0)
    grad = embedding_exact(idx, dy.reshape(idx.shape[0], idx.shape[1], -1), num_embeddings, padding_idx)
    hook.add_gradient(generation, grad)


@guarded
def table_backward(
    hook: LayerHook,
    generation: int,
    index: torch.Tensor,
    owner: torch.Tensor,
    dim: int,
    rows: bool,
    padding_idx: int | None,
    dy: torch.Tensor,
) -> None:
    """A bare parameter used as a table (:meth:`UseRules._table_lookup`): ``index`` and ``owner`` the entry and the
    example of each lookup (the ids' examples' dim moved first, flattened), ``dy`` with the ids' examples along
    ``dim``; a lookup of ``padding_idx`` gets no gradient (``F.embedding``'s)."""
    dy = dy.detach().movedim(dim, 0)
    values = dy.reshape(len(index), -1) if rows else dy.reshape(len(index))
    if padding_idx is not None:
        values = values * (index != padding_idx).to(values.dtype).view(-1, *([1] * (values.dim() - 1)))
    hook.add_lookup(generation, index, values, owner, rows)


@guarded
def bag_backward(
    hook: LayerHook, generation: int, entries: torch.Tensor, owner: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
) -> None:
    """``F.embedding_bag`` of one bag per example (:meth:`UseRules._bag_lookup`): entry ``r`` of bag ``owner[r]``
    gets the bag's output gradient times its weight in the bag."""
    values = dy.detach().float().index_select(0, owner) * weight.unsqueeze(1)
    hook.add_lookup(generation, entries, values, owner, True)


@guarded
def bag_max_backward(
    hook: LayerHook,
    generation: int,
    entries: torch.Tensor,
    owner: torch.Tensor,
    inverse: torch.Tensor,
    bags: torch.Tensor,
    dims: torch.Tensor,
    dy: torch.Tensor,
) -> None:
    """``F.embedding_bag`` in ``max`` mode (:meth:`UseRules._bag_maxima`): ``(entries, owner)`` the distinct
    ``(entry, example)`` maxima, ``inverse`` which of them each ``(bags, dims)`` pair's maximum is; that pair's
    output gradient goes to that row's dim."""
    values = dy.new_zeros(entries.shape[0], dy.shape[1], dtype=torch.float32)
    values[inverse, dims] = dy.detach().float()[bags, dims]
    hook.add_lookup(generation, entries, values, owner, True)


@guarded
def slope_backward(
    hook: LayerHook, param: torch.Tensor, generation: int, negative: torch.Tensor, channels: int, dy: torch.Tensor
) -> None:
    """``nn.PReLU``'s slopes (:meth:`UseRules._prelu`): each example's ``dy * min(x, 0)`` summed over its
    positions, per channel of dim 1 (``channels`` 1: over everything)."""
    with torch.no_grad():
        term = dy.detach().float() * negative.float()
        size = term.shape[0]
        grad = term.reshape(size, -1).sum(1, keepdim=True) if channels == 1 else term.movedim(1, -1)
        if channels > 1:
            grad = grad.reshape(size, -1, channels).sum(1)
        hook.add_gradient(generation, slot_gradient(hook, param, grad))


def widen_rows(
    start: int, stop: int, size: int, layout: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output gradient of a use of rows ``start:stop`` of a weight (after ``layout``) as the whole weight's
    output gradient: zeros in the other rows, which this use does not touch."""

    def widen(dy: torch.Tensor) -> torch.Tensor:
        dy = dy if layout is None else layout(dy)
        out = dy.new_zeros(*dy.shape[:-1], size)
        out[..., start:stop] = dy
        return out

    return widen


@guarded
def grouped_mm_backward(
    hooks: dict[int, LayerHook],
    generation: int,
    x: torch.Tensor,
    owner: torch.Tensor,
    ends: list[int],
    transposed: bool,
    dy: torch.Tensor,
) -> None:
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            rows = slice(start, end)
            if transposed:
                hooks[e].add_rows(generation, x[rows], dy[rows], owner[rows])
            else:
                hooks[e].add_rows(generation, dy[rows], x[rows], owner[rows])
        start = end


@guarded
def gathered_backward(
    hooks: dict[int, LayerHook],
    generation: int,
    x: torch.Tensor,
    owner: torch.Tensor,
    ids: torch.Tensor,
    left: bool,
    dy: torch.Tensor,
) -> None:
    dy = dy.reshape(dy.shape[0], -1)
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().flatten()
        if left:  # W [out, in] @ x: the slice's gradient dy x^T
            hooks[e].add_rows(generation, x[rows], dy[rows], owner[rows])
        else:  # x @ W [in, out]: x^T dy, in the parameter's own layout
            hooks[e].add_rows(generation, dy[rows], x[rows], owner[rows])


@guarded
def normalization_backward(
    hooks: list[tuple[torch.Tensor, LayerHook | None]],
    scale: torch.Tensor | None,
    generation: int,
    x_hat: torch.Tensor,
    dims: int,
    layout: Callable[[torch.Tensor], torch.Tensor],
    dy: torch.Tensor,
) -> None:
    with torch.no_grad():
        dy = layout(dy.detach()).float()
        size = dy.shape[0]
        for param, hook in hooks:
            if hook is None:
                continue  # a scale or shift the selection leaves out
            term = dy * x_hat.float() if param is scale else dy
            grad = term.reshape(size, -1, *term.shape[term.dim() - dims :]).sum(dim=1)
            hook.add_gradient(generation, slot_gradient(hook, param, grad))


def channels_last(dy: torch.Tensor) -> torch.Tensor:
    """A convolution's output gradient ``[B, C_out, *spatial]`` as ``[B, positions, C_out]``."""
    return dy.flatten(2).transpose(1, 2)


@guarded
def transposed_conv_backward(
    hook: LayerHook, generation: int, x: torch.Tensor, geometry: tuple[Any, ...], groups: int, dy: torch.Tensor
) -> None:
    """A transposed convolution's weight (:meth:`UseRules._transposed_convolution`): the patches of ``dy`` under
    the convolution it is the adjoint of (``geometry``: kernel, stride, padding, dilation) line up with the input
    ``x``'s positions; each example's gradient ``[C_in, C_out/groups x kernel]`` sums ``x ⊗ patches`` over them,
    group by group (group ``g``'s input channels with its output channels' patches)."""
    inputs = channels_last(x).flatten(0, 1)  # [B x positions, C_in]
    size, positions = x.shape[0], inputs.shape[0] // x.shape[0]
    owner = torch.arange(size, device=x.device).repeat_interleave(positions)
    per_in, per_out = x.shape[1] // groups, dy.shape[1] // groups
    for g in range(groups):
        patches = conv_patches(dy.detach()[:, g * per_out : (g + 1) * per_out], *geometry).flatten(0, 1)
        group = inputs if groups == 1 else torch.zeros_like(inputs)
        if groups > 1:
            group[:, g * per_in : (g + 1) * per_in] = inputs[:, g * per_in : (g + 1) * per_in]
        hook.add_rows(generation, patches, group, owner)


@guarded
def grouped_conv_backward(
    hook: LayerHook, generation: int, patches: torch.Tensor, groups: int, size: int, dy: torch.Tensor
) -> None:
    """A grouped convolution's per-example gradient ``[B, C_out, C_in/groups x kernel (+1)]``, materialised (the
    input's rows the examples', or ``k`` rows of each in order: windows)."""
    with torch.no_grad():
        x = patches.reshape(size, -1, groups, patches.shape[-1] // groups).float()
        g = channels_last(dy.detach())
        g = g.reshape(size, -1, groups, g.shape[-1] // groups).float()
        grad = torch.einsum("blgo,blgi->bgoi", g, x).reshape(size, -1, x.shape[-1])
        if hook.slot.has_bias:
            grad = torch.cat([grad, g.sum(dim=1).reshape(size, -1, 1)], dim=-1)
    hook.add_gradient(generation, grad)


@guarded
def meeting_backward(
    operand: torch.Tensor,
    params: list[torch.Tensor],
    hooks: list[LayerHook | list[LayerHook]],
    generation: int,
    at: int,
    grad: torch.Tensor,
    *,
    rows: tuple[torch.Tensor, int] | None = None,
) -> None:
    """The per-example (per-token, for a per-token capture's hooks) gradients of ``params`` from the gradient of
    their batch-expanded ``operand`` (the examples along dim ``at`` of ``grad``); a stacked parameter's hooks are
    a list, one per entry of its leading dim. ``rows``: ``(owner, B)`` where ``grad``'s dim 0 holds rows of the
    examples (example ``owner[r]`` each), whose gradients each example sums."""
    positions = grad.shape[1] if first_hook(hooks[0]).PER_POSITION and grad.dim() > 1 else None
    with torch.no_grad():
        if at:  # split along dim ``at`` as along dim 0, then put the dims back in the operand's order
            aligned = [1] * (grad.dim() - operand.dim()) + list(operand.shape)
            aligned.insert(0, aligned.pop(at))
            moved = split_operand(grad.detach().movedim(at, 0), torch.Size(aligned))
            per_row = moved.movedim(1, at + 1).reshape(grad.shape[at], *operand.shape)
        else:
            per_row = split_operand(grad.detach(), operand.shape, 1 if positions is None else 2)
        if rows is not None:
            owner, size = rows
            per_row = per_row.new_zeros((size, *per_row.shape[1:])).index_add_(0, owner, per_row)
    if len(params) == 1 and params[0] is operand:
        grads = [per_row]
    else:
        grads = torch.autograd.grad(
            operand, params, per_row, retain_graph=True, is_grads_batched=True, allow_unused=True
        )
    for param, hook, g in zip(params, hooks, grads):
        if g is None:
            continue
        if isinstance(hook, list):  # a stacked parameter: entry e of its leading dim is slot e's
            for e, entry in enumerate(hook):
                part = g[:, e].reshape(g.shape[0], entry.slot.d_out, entry.slot.d_in)
                entry.add_gradient(generation, part, positions)
        else:
            hook.add_gradient(generation, slot_gradient(hook, param, g), positions)


def first_hook(target: LayerHook | list[LayerHook]) -> LayerHook:
    """A meeting's target hook, or a stacked parameter's first slot's."""
    return target[0] if isinstance(target, list) else target


def refuse_recomputation(name: str, grad: torch.Tensor) -> None:
    raise RecomputationError(
        f"capture: parameter {name!r} was used in a recomputation backpropagated inside backward (reentrant "
        "gradient checkpointing, reversible layers such as Reformer's, or a custom autograd.Function that reruns it "
        "in its backward). Use non-reentrant checkpointing (use_reentrant=False), disable gradient checkpointing "
        "while capturing, or leave the parameter out of the capture (exclude=...: reversible layers recompute their "
        "forward in backward by design)."
    )


def conv_patches(x: torch.Tensor, kernel: tuple[int, ...], stride: Any, padding: Any, dilation: Any) -> torch.Tensor:
    """The input patches of a convolution, ``[B, positions, C_in x prod(kernel)]`` in the weight's
    ``(channel, *kernel)`` order (im2col; ``padding`` as the op takes it: ints or ``"same"``/``"valid"``)."""
    dims = len(kernel)
    stride, dilation = _tuple(stride, dims), _tuple(dilation, dims)
    if padding == "valid":
        pads = [(0, 0)] * dims
    elif padding == "same":
        pads = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
    else:
        pads = [(p, p) for p in _tuple(padding, dims)]
    flat = [side for pair in reversed(pads) for side in pair]  # F.pad takes the last dim first
    if any(flat):
        x = F.pad(x, flat)
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]
    # [B, C, *positions, *kernel] -> [B, *positions, C, *kernel]
    size, channels = x.shape[:2]
    order = [0, *range(2, 2 + dims), 1, *range(2 + dims, 2 + 2 * dims)]
    x = x.permute(order)
    return x.reshape(size, -1, channels * torch.Size(kernel).numel())


def _tuple(value: Any, dims: int) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),) * dims


def split_operand(grad: torch.Tensor, shape: torch.Size, splits: int = 1) -> torch.Tensor:
    """``[N, *shape]``: the gradient of an operand of ``shape`` through each index of the first ``splits`` dims of
    the result whose gradient is ``grad`` (the operand broadcast to it): per example (``splits=1``, ``N = B``) or
    per example and position (``splits=2``, ``N = B x T``). Where the operand spans a split dim (a position table
    over the positions) each row holds its own slice, zeros elsewhere; where it is broadcast, the sum."""
    lead = tuple(grad.shape[:splits])
    aligned = (1,) * (grad.dim() - len(shape)) + tuple(shape)
    reduced = grad.sum_to_size((*lead, *aligned[splits:]))
    rows = math.prod(lead)
    out = grad.new_zeros((rows, *aligned))
    grid = torch.meshgrid(*(torch.arange(n, device=grad.device) for n in lead), indexing="ij")
    index = [torch.arange(rows, device=grad.device)]
    index += [g.reshape(-1) if aligned[j] > 1 else 0 for j, g in enumerate(grid)]
    out[tuple(index)] = reduced.reshape(rows, *aligned[splits:])
    return out.reshape(rows, *shape)


def slot_gradient(hook: LayerHook, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Per-example gradients ``[B, *param.shape]`` of one of ``hook``'s parameters in the slot's orientation
    ``[B, d_out, d_in (+1)]`` (a weight's gradient with a zero bias column, or a bias's in that column)."""
    s = hook.slot
    size = grad.shape[0]
    if param is hook.bias:
        out = grad.new_zeros(size, s.d_out, s.d_in_eff)
        out[:, :, -1] = grad.reshape(size, s.d_out)
        return out
    weight = grad.transpose(1, 2) if s.kind in ("embedding", "conv1d") else grad.reshape(size, s.d_out, s.d_in)
    if s.has_bias:
        weight = torch.cat([weight, weight.new_zeros(size, s.d_out, 1)], dim=-1)
    return weight
