"""Products no other rule splits, made exact by giving each example its own copy of the parameter operand: a
weight in ``torch.einsum``, a batched matrix product with a weight broadcast or expanded over the examples
(``torch.bmm(x, W.expand(B, ...))``, ``x @ W_heads``), ``F.linear`` or a convolution (transposed too) whose weight
is computed from parameters (``weight_norm``, parametrizations) or is a bare parameter (``F.conv2d(x, self.weight)``).

The parameter operand is expanded along a new dim of the examples (a *copy*: see
:meth:`~ingest.uses.rules.UseRules._copy`, which hooks it as a meeting) and the op rewritten so that example ``b``
meets copy ``b`` only: an einsum gains the examples' letter on the weight's term, a matrix product broadcasts over
the copies, a convolution runs the examples as groups. Autograd then hands each example its own gradient of its
copy, and a batched vector-Jacobian product through the parameter-only part gives each parameter's. The rewritten
op computes the same values; its cost is the per-example gradient it materialises (``[B, *weight.shape]``).

``copy(t, aligned, shape, at, owner)`` (the rule's) takes the operand ``t`` as the model gave it, ``aligned``: ``t``
as a view of the rewritten op's operand with a dim of size 1 at ``at``, the ``shape`` to expand it to, and ``owner``
where the copies are rows of the examples (an einsum over heads folded into the batch: each row's example); it returns
the expanded, hooked copy, ``t`` itself when ``t`` carries no captured parameter (nothing to split), or None when a
parameter behind ``t`` has no slot that can take it (the use is then reported)."""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import torch

from ingest.uses.batch_tracking import OWNER, batch_dim, einsum_terms, matmul_dim

Copy = Callable[[torch.Tensor, torch.Tensor, torch.Size, int, "torch.Tensor | None"], "torch.Tensor | None"]


def _examples_dim(x: Any) -> int | None:
    """The examples' dim of a batch operand whose rows are the examples in order (None otherwise)."""
    dim = batch_dim(x)
    return dim if dim is not None and dim >= 0 and getattr(x, OWNER, None) is None else None


def einsum_with_copies(args: tuple, copy: Copy) -> torch.Tensor | None:
    """``torch.einsum(equation, *operands)`` with each parameter operand given the examples' letter (the batch
    operands' letter at their examples' dim, kept in the output; one copy per row where those are rows of the
    examples). None for the sublist form, batch operands whose examples are unknown or lie under different letters
    or rows, an examples' letter summed over or on a parameter's own term."""
    spelled = einsum_terms(args)
    if spelled is None or not all(isinstance(t, torch.Tensor) for t in spelled[2]):
        return None
    terms, output, operands = spelled
    batched = [(term, t) for term, t in zip(terms, operands) if batch_dim(t) is not None]
    dims = [batch_dim(t) for _, t in batched]
    if not batched or min(dims) < 0 or any(d >= len(term) for d, (term, _) in zip(dims, batched)):
        return None
    letters = {term[d] for d, (term, _) in zip(dims, batched)}
    letter = letters.pop()
    owners = [getattr(t, OWNER, None) for _, t in batched]  # rows of the examples (heads or windows folded in)
    owner = owners[0]
    if letters or letter not in output or any(o is not owner and not _same(o, owner) for o in owners):
        return None
    rows = batched[0][1].shape[dims[0]]
    new_terms, new_operands, copied = [], [], False
    for term, t in zip(terms, operands):
        if batch_dim(t) is None and t.requires_grad:
            if letter in term:
                return None
            c = copy(t, t.unsqueeze(0), torch.Size((rows, *t.shape)), 0, owner)
            if c is None:
                return None
            if c is not t:
                term, t, copied = letter + term, c, True
        new_terms.append(term)
        new_operands.append(t)
    return torch.einsum(f"{','.join(new_terms)}->{output}", *new_operands) if copied else None


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two rows' owners (or their absence) name the same examples."""
    return a is None and b is None or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


def over_the_batch(t: torch.Tensor, at: int, size: int) -> tuple[torch.Tensor, torch.Size] | None:
    """``(aligned, shape)``: a parameter operand ``t`` whose dim ``at`` meets the examples as one row (broadcast),
    expanded over them (stride 0: its one row) or repeated (one per example already), and the shape its copies
    take there; None where that dim is another size."""
    if t.shape[at] == size and t.stride(at) == 0:
        t = t.narrow(at, 0, 1)  # expanded over the batch by the model: one copy per example
    if t.shape[at] not in (1, size):
        return None
    return t, torch.Size([size if d == at else n for d, n in enumerate(t.shape)])


def product_with_copies(func: Any, args: tuple, size: int, copy: Copy) -> torch.Tensor | None:
    """A matrix product ``x @ W`` / ``W @ x`` (``matmul``, ``bmm``) of a batch operand whose examples lie along a
    broadcast (leading) dim and a parameter operand broadcast over it, expanded or repeated to it (DETR's object
    queries): the operand's copies along that dim. None when the examples lie in the matrices' own dims."""
    if len(args) != 2 or not all(isinstance(t, torch.Tensor) for t in args):
        return None
    a, b = args
    x, t = (a, b) if batch_dim(b) is None else (b, a)
    dim, n = _examples_dim(x), max(a.dim(), b.dim())
    if dim is None or batch_dim(t) is not None or min(a.dim(), b.dim()) < 2:
        return None
    at = matmul_dim(args, x, dim, n)
    if at < 0:
        return None
    if at >= n - 2:  # the examples among the matrices' rows (columns): a matrix copy per example, by einsum
        return _matrix_product_with_copies(x, t, t is a, dim, size, copy)
    spread = over_the_batch(t.reshape((1,) * (n - t.dim()) + tuple(t.shape)), at, size)
    c = None if spread is None else copy(t, *spread, at, None)
    if c is None or c is t:
        return None
    return func(c, b) if t is a else func(a, c)


def _matrix_product_with_copies(
    x: torch.Tensor, t: torch.Tensor, t_first: bool, dim: int, size: int, copy: Copy
) -> torch.Tensor | None:
    """``x @ M`` or ``M @ x`` with ``M`` a 2-D parameter operand and the examples along a dim of ``x`` that the
    product keeps: ``M``'s copies met by einsum."""
    if t.dim() != 2 or x.dim() > 20:
        return None
    c = copy(t, t.unsqueeze(0), torch.Size((size, *t.shape)), 0, None)
    if c is None or c is t:
        return None
    term = string.ascii_lowercase[: x.dim()]
    if t_first:  # M @ x: M's columns meet x's dim -2
        return torch.einsum(f"{term[dim]}z{term[-2]},{term}->{term[:-2]}z{term[-1]}", c, x)
    return torch.einsum(f"{term},{term[dim]}{term[-1]}z->{term[:-1]}z", x, c)


def linear_with_copies(x: Any, weight: Any, bias: Any, size: int, copy: Copy) -> torch.Tensor | None:
    """``F.linear(x, W, b)`` with ``W`` and ``b`` computed from parameters (or bare ones no slot of a layer
    holds) as ``x @ W.T + b`` over per-example copies (examples along any dim of ``x`` but its features')."""
    dim = _examples_dim(x)
    if dim is None or dim == x.dim() - 1 or x.dim() > 20:
        return None
    weight_copy = copy(weight, weight.unsqueeze(0), torch.Size((size, *weight.shape)), 0, None)
    if weight_copy is None:
        return None
    if weight_copy is weight:
        out = torch.nn.functional.linear(x, weight)
    else:
        term = string.ascii_lowercase[: x.dim()]
        out = torch.einsum(f"{term},{term[dim]}z{term[-1]}->{term[:-1]}z", x, weight_copy)
    return _with_bias(out, bias, dim, out.dim() - 1, size, copy, weight_copy is not weight)


def conv_with_copies(
    func: Any, bound: dict[str, Any], size: int, copy: Copy, transposed: bool = False
) -> torch.Tensor | None:
    """``convNd(x, W, b, ...)`` or ``conv_transposeNd`` with ``W`` and ``b`` computed from parameters
    (``weight_norm``: HiFi-GAN's upsampling convolutions) or bare ones: each example convolved with its own copy of
    ``W``, the examples run as groups of one convolution."""
    x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
    if _examples_dim(x) != 0 or x.dim() != weight.dim():
        return None
    names = ("stride", "padding", "output_padding", "dilation") if transposed else ("stride", "padding", "dilation")
    options = {k: bound[k] for k in names if k in bound}
    groups = int(bound.get("groups", 1))
    weight_copy = copy(weight, weight.unsqueeze(0), torch.Size((size, *weight.shape)), 0, None)
    if weight_copy is None:
        return None
    if weight_copy is weight:
        out = func(x, weight, None, groups=groups, **options)
    else:
        flat = weight_copy.reshape(size * weight.shape[0], *weight.shape[1:])
        out = func(x.reshape(1, -1, *x.shape[2:]), flat, None, groups=groups * size, **options)
        out = out.reshape(size, -1, *out.shape[2:])
    return _with_bias(out, bias, 0, 1, size, copy, weight_copy is not weight)


def _with_bias(
    out: torch.Tensor, bias: Any, dim: int, channels: int, size: int, copy: Copy, copied: bool
) -> torch.Tensor | None:
    """``out`` plus ``bias`` along its dim ``channels``, the bias's copies along the examples' ``dim``; None where
    the bias cannot be copied, or where neither it nor the weight was (``copied``: nothing of the use split)."""
    if bias is None:
        return out if copied else None
    shape = [1] * out.dim()
    shape[channels] = bias.shape[0]
    aligned = bias.reshape(shape)
    shape[dim] = size
    bias_copy = copy(bias, aligned, torch.Size(shape), dim, None)
    if bias_copy is None or (bias_copy is bias and not copied):
        return None
    return out + (aligned if bias_copy is bias else bias_copy)
