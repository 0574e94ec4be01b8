"""Which tensors come from the batch, and along which dim: the taint the op-level capture (:mod:`ingest.uses`)
carries from the model's inputs through every op (transposes, permutes, reshapes, indexing, reductions, tokens
flattened across the batch), and the attributes it marks tensors with."""

from __future__ import annotations

import math
import string
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ingest.hooks import TAKEN_MARK
from ingest.uses.ops import CHANNEL_NORMALIZATIONS, ELEMENTWISE, MATMULS, NORMALIZATIONS, REDUCTIONS, RESHAPES

#: Batched matrix products ``(a, b)``, read as :data:`~ingest.uses.ops.MATMULS` are.
BATCHED_MATMULS = frozenset([torch.bmm, torch.Tensor.bmm])
#: Ops that may move dims while keeping the rank, whose outputs' examples' dim is not followed (unknown).
REORDERS = frozenset(
    ["rot90", "mT", "mH", "adjoint", "as_strided", "tensordot", "movedim", "moveaxis", "t", "t_", "T", "H"]
)
#: Attribute set on tensors computed from the batch's inputs: the dim that indexes the examples (-1: unknown).
BATCHED = "_gradstore_batched"
TAKEN = TAKEN_MARK
#: Attribute set on a batch tensor whose dim 0 mixes the examples (tokens flattened across the batch, then
#: gathered): a long tensor, the example of each entry along dim 0.
OWNER = "_gradstore_owner"
#: Attribute set on an :data:`OWNER` tensor whose rows are all one example's (``x[i]`` in a loop over the
#: examples): that example.
EXAMPLE = "_gradstore_example"
#: Attribute cached on an :data:`OWNER` tensor: whether its rows are other than each example's in order
#: (:func:`irregular_rows`).
IRREGULAR = "_gradstore_irregular"
#: Attribute set on a slice ``param[e]`` of a captured stacked parameter: ``(param, e)``.
SLICE = "_gradstore_slice"
#: Attribute set on ``param[ids]`` of a captured stacked parameter gathered per row (``ids`` a 1-D long tensor,
#: transformers' batched-mm experts): ``(param, ids)``.
GATHER = "_gradstore_gather"
#: Attribute set on the output of a hooked module run on a single row (position ids ``[1, T]``) and on what is
#: computed from it alone while it keeps that single row: the module's id (see :attr:`ParameterUses.broadcasts`).
BROADCAST = "_gradstore_broadcast"
#: Attribute set on that output itself: ``(hook, input)``, so where it meets the batch by broadcasting, the hook
#: captures it as it would have (its input and output expanded over the batch there, not under the model's feet).
BROADCAST_HOOK = "_gradstore_broadcast_hook"
#: Attribute set on a tensor computed across the examples (a reduction over them, a softmax or a sort along them):
#: combined with a batch tensor in an elementwise op it makes each example's output depend on the others.
POOLED = "_gradstore_pooled"
#: Attribute set on the output of an op that computes each example's entries across the examples and keeps one
#: entry per example (a softmax or a normalisation over the batch, a permutation of it): as the model's output,
#: every example's loss depends on the others' (:meth:`ingest.capture.GradientCapture` reports it).
ACROSS = "_gradstore_across"
#: Attribute set on a batch tensor whose examples lie along one dim in another order (a packed sequence's sorted
#: order): ``(dim, order)``, position ``j`` holding example ``order[j]``. Its :data:`BATCHED` is -1 (no rule reads
#: the order); the packing ops follow it (:func:`mark_packing`), and an ``index_select`` restoring the examples'
#: order makes the dim theirs again.
ORDER = "_gradstore_order"
#: Attribute set on batch-free tensors computed from captured parameters: the parameters (a tuple).
SOURCES = "_gradstore_sources"
#: Attribute set on a block of rows of a captured weight or bias, a view ``param[start:stop]`` (``split``,
#: ``chunk``, ``narrow``, slicing: MultiheadAttention's cross-attention splits its packed in-projection):
#: ``(param, start, stop)``.
ROWS = "_gradstore_rows"


def tensors_in(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def mark_batched(
    values: Iterable[Any], size: int, dim: int = 0, main: torch.Tensor | None = None
) -> list[tuple[int, ...]]:
    """Mark the tensors among ``values`` (and inside lists, tuples and dicts one level down) that have the batch's
    ``size`` along dim 0 or along ``dim`` (the model's input's examples' dim) as the batch's, examples along that
    dim; ``main`` (the model's input) along ``dim`` (a shared ``[T, d]`` table passed beside the batch is not:
    where ``T == B`` it cannot be told from a batch tensor by its shape, see docs/capture.md). A tensor with the
    batch's size along both (``dim`` not 0: a batch-first side input ``[B, N]`` with ``N == B``, or a sequence-first
    one with ``T == B``) is marked batched along an unknown dim (-1: its uses are not split, so reported); their
    shapes are returned."""
    ambiguous = []
    for value in values:
        if isinstance(value, dict):
            ambiguous += mark_batched(value.values(), size, dim, main)
        for t in tensors_in([value]):
            along = [dim] if t is main else [d for d in dict.fromkeys((dim, 0)) if t.dim() > d and t.shape[d] == size]
            if len(along) > 1:
                ambiguous.append(tuple(t.shape))
            if along:
                setattr(t, BATCHED, along[0] if len(along) == 1 else -1)
    return ambiguous


def mark_owned_rows(t: torch.Tensor, owner: torch.Tensor) -> None:
    """Mark ``t`` as rows of the batch along dim 0, ``owner`` the example of each (packed bags' flat ids)."""
    setattr(t, BATCHED, 0)
    setattr(t, OWNER, owner)


def _in_order(owner: torch.Tensor, size: int, k: int = 1) -> bool:
    """Whether rows of the examples named by ``owner`` are each example's ``k`` rows in order, one block after
    another (``arange(B).repeat_interleave(k)``; ``k = 1``: the examples themselves, in order)."""
    if owner.numel() != size * k:
        return False
    return torch.equal(owner, torch.arange(size, device=owner.device).repeat_interleave(k))


def irregular_rows(t: Any, size: int) -> bool:
    """Whether ``t`` holds rows of the examples along another dim than 0, or along dim 0 other than each example's
    rows in order, one block after another (``arange(B).repeat_interleave(k)``: tokens flattened across the batch):
    rows chosen by an index or a mask, a packed sequence's time-major rows, packed bags' ids. Only rules that read
    :data:`OWNER` split them."""
    owner = getattr(t, OWNER, None) if isinstance(t, torch.Tensor) else None
    if owner is None:
        return False
    if batch_dim(t) != 0:
        return True  # rows of the examples along another dim (Swin's windows inside attention)
    cached = getattr(owner, IRREGULAR, None)
    if cached is None:
        rows = owner.numel()
        cached = rows == 0 or rows % size != 0 or not _in_order(owner, size, rows // size)
        setattr(owner, IRREGULAR, cached)
    return cached


def row_block(piece: torch.Tensor, param: torch.Tensor) -> tuple[int, int] | None:
    """``(start, stop)`` when ``piece`` is the view ``param[start:stop]`` (every other dim whole), else None."""
    if piece.dim() != param.dim() or piece.dim() == 0 or piece.shape[1:] != param.shape[1:]:
        return None
    if piece.stride() != param.stride() or piece.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        return None
    start, rest = divmod(piece.storage_offset() - param.storage_offset(), param.stride(0))
    if rest or start < 0 or start + piece.shape[0] > param.shape[0]:
        return None
    return start, start + piece.shape[0]


def batch_dim(t: Any) -> int | None:
    """The dim of ``t`` that indexes the examples (-1: from the batch, dim unknown; None: not from the batch)."""
    return getattr(t, BATCHED, None) if isinstance(t, torch.Tensor) else None


def batch_operand(operands: list[torch.Tensor]) -> torch.Tensor | None:
    """The operand whose examples' dim the outputs follow: one with a known dim, else any from the batch."""
    dims = [(batch_dim(t), t) for t in operands]
    first = next((t for d, t in dims if d is not None and d >= 0), None)
    return first if first is not None else next((t for d, t in dims if d is not None), None)


#: Ops that move entries along one dim (reorder, gather, scatter, accumulate or normalise along it), by name:
#: ``(position of the dim argument, its keyword, default)``; ``None`` default: every dim (flattened).
ALONG_A_DIM = {
    **{name: (1, "dim", 0) for name in ("index_select", "gather", "index_copy", "index_add")},
    **{name: (1, "dim", 0) for name in ("scatter", "scatter_add", "scatter_reduce", "index_reduce")},
    **{name: (1, "dim", -1) for name in ("sort", "argsort", "cumsum", "cumprod", "cummax", "cummin")},
    **{name: (1, "dim", -1) for name in ("logcumsumexp", "softmax", "log_softmax")},
    **{name: (2, "dim", -1) for name in ("topk_", "diff", "kthvalue")},
    **{name: (1, "dim", None) for name in ("median", "nanmedian", "mode")},
    **{name: (2, "dim", None) for name in ("quantile", "nanquantile")},
    "normalize": (2, "dim", 1),
    "take_along_dim": (2, "dim", None),
    "msort": (None, None, 0),
    "flipud": (None, None, 0),
    "fliplr": (None, None, 1),
}


def mixed_dims(func: Any, args: tuple, kwargs: dict, n: int) -> set[int] | None:
    """The dims of an ``n``-dim operand along which ``func`` moves or combines entries (an example's row taken
    from, or made of, other rows: ``index_select``, ``gather``, ``flip``, ``roll``, ``sort``, ``cumsum``,
    ``softmax`` along a dim, a median, the statistics of a normalisation, ...), every dim when it flattens; None
    for any other op."""
    if func in STATISTICS:
        return normalized_dims(func, args, kwargs, n)
    name = getattr(func, "__name__", "").rstrip("_") or ""
    if name == "topk":
        name = "topk_"
    if name in ("flip", "roll"):
        spelled = (args[2] if len(args) > 2 else kwargs.get("dims")) if name == "roll" else None
        if name == "flip":
            spelled = args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else kwargs.get("dims"))
        if spelled is None:
            return set(range(n))
        spelled = spelled if isinstance(spelled, (tuple, list)) else (spelled,)
        return {int(d) % n for d in spelled} if n else set()
    if name not in ALONG_A_DIM:
        return None
    position, keyword, default = ALONG_A_DIM[name]
    given = args[position] if position is not None and len(args) > position else kwargs.get(keyword, default)
    if given is None or not isinstance(given, int) or not n:
        return set(range(n))
    return {int(given) % n}


#: Normalisations whose statistics combine entries along some dims (:func:`normalized_dims`).
STATISTICS = {**CHANNEL_NORMALIZATIONS, **NORMALIZATIONS}


def normalized_dims(func: Any, args: tuple, kwargs: dict, n: int) -> set[int] | None:
    """The dims whose entries a normalisation's statistics combine: batch norm's every dim but the channels' 1
    (in training, or without running statistics; None with fixed ones), instance norm's spatial dims, group
    norm's every dim but 0, layer and RMS norm's ``normalized_shape`` dims."""
    bound = {**dict(zip(STATISTICS[func], args)), **kwargs}
    if func is F.batch_norm:
        batch_stats = bool(bound.get("training", False)) or bound.get("running_mean") is None
        return {d for d in range(n) if d != 1} if batch_stats else None
    if func is F.instance_norm:
        own_stats = bool(bound.get("use_input_stats", True)) or bound.get("running_mean") is None
        return set(range(2, n)) if own_stats else None
    if func is F.group_norm:
        return set(range(1, n))
    shape = bound.get("normalized_shape")
    count = 1 if isinstance(shape, int) else len(shape) if shape is not None else n
    return set(range(max(n - count, 0), n))


def op_attribute(func: Any) -> str:
    """``func``'s name; a property's (``x.T``, ``x.mT`` reach the mode as their descriptor's ``__get__``)."""
    name = getattr(func, "__name__", "")
    return getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" else name


def matmul_dim(args: tuple, source: torch.Tensor, dim: int, out_dims: int) -> int:
    """Where dim ``dim`` of ``source``, an operand of the matrix product ``args[0] @ args[1]``, lands in its
    ``out_dims``-dim output (-1: contracted)."""
    a, b = args[0], args[1]
    if source is a:
        if a.dim() == 1 or dim == a.dim() - 1:
            return -1
        return dim if b.dim() == 1 else out_dims - (a.dim() - dim)
    if b.dim() == 1 or dim == b.dim() - 2:
        return -1
    if a.dim() == 1:  # a vector on the left: the output drops b's dim -2, and only it
        return out_dims - (b.dim() - dim) + (1 if dim < b.dim() - 1 else 0)
    return out_dims - (b.dim() - dim)


def landings(func: Any, args: tuple, out: torch.Tensor) -> list[int | None] | None:
    """Where each batch operand's examples land in ``out`` for a product of operands (``a @ b``, ``bmm``,
    ``einsum``) or a broadcasting elementwise op: -1 where they are contracted (summed over), None for an operand
    whose examples' dim is not known; None (no list) for other ops."""
    if (func in MATMULS or func in BATCHED_MATMULS) and len(args) == 2:
        return [
            matmul_dim(args, t, batch_dim(t), out.dim()) if batch_dim(t) >= 0 else None
            for t in args[:2]
            if isinstance(t, torch.Tensor) and batch_dim(t) is not None
        ]
    if func in ELEMENTWISE:  # broadcasting: aligned from the right (h[:, None] - h[None]: every pair of examples)
        return [
            batch_dim(t) + out.dim() - t.dim() if batch_dim(t) >= 0 else None
            for t in tensors_in(args)
            if batch_dim(t) is not None and t.dim() > 0
        ]
    spelled = einsum_terms(args) if getattr(func, "__name__", "") == "einsum" else None
    if spelled is not None:
        terms, output, operands = spelled
        return [
            (output.find(term[batch_dim(t)]) if batch_dim(t) < len(term) else -1) if batch_dim(t) >= 0 else None
            for term, t in zip(terms, operands)
            if isinstance(t, torch.Tensor) and batch_dim(t) is not None
        ]
    return None


def einsum_terms(args: tuple) -> tuple[list[str], str, list[Any]] | None:
    """``(input terms, output term, operands)`` of ``torch.einsum(equation, *operands)`` (or a list of them), spelled
    out: an ellipsis as letters of its own (right-aligned across the operands), the output where the equation leaves
    it implicit (the ellipsis's dims, then the letters used once, in alphabetical order); None for the sublist form
    or terms that do not match the operands."""
    if not args or not isinstance(args[0], str):
        return None
    operands = list(args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    inputs, arrow, output = args[0].replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands) or not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    spread = ""
    if "..." in inputs:
        counts = [t.dim() - len(term.replace("...", "")) if "..." in term else 0 for term, t in zip(terms, operands)]
        free = [c for c in string.ascii_letters if c not in args[0]]
        if min(counts) < 0 or max(counts) > len(free):
            return None
        spread = "".join(free[: max(counts)])
        terms = [term.replace("...", spread[len(spread) - n :]) for term, n in zip(terms, counts)]
        output = output.replace("...", spread)
    if any("." in term for term in terms) or "." in output:
        return None
    if not arrow:
        joined = "".join(terms)
        output = spread + "".join(sorted(c for c in set(joined) - set(spread) if joined.count(c) == 1))
    return terms, output, operands


def pools_examples(func: Any, args: tuple, kwargs: dict, dim: int, n: int) -> bool:
    """Whether ``func`` on an ``n``-dim batch operand with the examples along ``dim`` computes across them (a
    reduction over that dim, an op that moves or combines entries along it)."""
    if dim < 0:
        return False
    mixed = mixed_dims(func, args, kwargs, n)
    if mixed is not None:
        return dim in mixed
    if getattr(func, "__name__", "") not in REDUCTIONS:
        return False
    reduced = args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(reduced, torch.Tensor):
        return False  # torch.max(a, b), torch.min(a, b): elementwise, not a reduction
    return reduced is None or _reduced_dim(reduced, dim, n) == -1 if n else False


#: Ops that take or put rows by an index (a gather, a scatter, a segment sum): over rows of several examples they
#: may group each example's own rows (a per-graph pooling), so they are not taken as computing across examples.
BY_INDEX = frozenset(
    ["index_select", "gather", "index_copy", "index_add", "scatter", "scatter_add", "scatter_reduce", "index_reduce"]
)


def pools_owned_rows(func: Any, args: tuple, kwargs: dict, owner: torch.Tensor, dim: int, n: int) -> bool:
    """Whether ``func`` on an ``n``-dim operand whose dim ``dim`` holds rows of several examples (``owner``: tokens
    flattened across the batch, ``h.reshape(-1)``) computes across those rows: a reduction over that dim, a softmax,
    sort or statistics along it (not an op by index, see :data:`BY_INDEX`)."""
    if op_attribute(func).rstrip("_") in BY_INDEX or not pools_examples(func, args, kwargs, dim, n):
        return False
    return owner.numel() > 1 and bool((owner != owner[0]).any())


def order_along(t: Any, dim: int, size: int) -> torch.Tensor | None:
    """The example at each position of ``t``'s dim ``dim``: in order where the examples lie there, the order a
    reordering recorded (:data:`ORDER`), else None."""
    if not isinstance(t, torch.Tensor) or t.dim() <= dim:
        return None
    if batch_dim(t) == dim and getattr(t, OWNER, None) is None:
        return torch.arange(size, device=t.device)
    recorded = getattr(t, ORDER, None)
    return recorded[1] if recorded is not None and recorded[0] == dim else None


def set_order(out: torch.Tensor, dim: int, order: torch.Tensor, size: int) -> None:
    """Mark ``out``'s dim ``dim`` as holding the examples in ``order`` (theirs again where it is the identity)."""
    restored = _in_order(order, size)
    setattr(out, BATCHED, dim if restored else -1)
    setattr(out, ORDER, None if restored else (dim, order))
    setattr(out, OWNER, None)


def mark_packing(func: Any, args: tuple, kwargs: dict, result: Any, size: int) -> bool:
    """Follow the examples through a packed sequence's ops (True where this marked ``result``): ``index_select``
    of the examples by a permutation (the sort by length and its inverse), ``_pack_padded_sequence`` (the example
    of each row of the packed data: :data:`OWNER`) and ``_pad_packed_sequence`` (back to a dim of examples)."""
    name = getattr(func, "__name__", "")
    if name == "index_select" and len(args) >= 3 and not kwargs and isinstance(args[0], torch.Tensor):
        x, dim, index = args[:3]
        base = order_along(x, int(dim) % max(x.dim(), 1), size)
        if base is None or not isinstance(index, torch.Tensor) or index.dim() != 1 or index.numel() != size:
            return False
        set_order(result, int(dim) % x.dim(), base[index.to(base.device)], size)
        return True
    if name == "_pack_padded_sequence" and len(args) >= 3 and isinstance(result, (tuple, list)):
        base = order_along(args[0], 0 if args[2] else 1, size)
        if base is None:
            return False
        data, sizes = result[0], result[1]
        setattr(data, BATCHED, 0)
        setattr(data, OWNER, torch.cat([base[:n] for n in sizes.tolist()]))
        return True
    if name == "_pad_packed_sequence" and len(args) >= 3 and isinstance(result, (tuple, list)):
        data, sizes = args[0], args[1]
        owner = getattr(data, OWNER, None)
        if owner is None or batch_dim(data) != 0:
            return False
        set_order(result[0], 0 if args[2] else 1, owner[: int(sizes[0])], size)
        return True
    return False


def result_batch(
    func: Any,
    args: tuple,
    kwargs: dict,
    source: torch.Tensor,
    dim: int,
    owner: torch.Tensor | None,
    out: torch.Tensor,
    size: int,
) -> tuple[int, torch.Tensor | None]:
    """Where the examples are in ``out``, an output of ``func`` on ``source`` (whose examples' dim is ``dim``, or
    whose dim 0 mixes them as ``owner`` says): ``(dim, owner)``, ``(-1, None)`` when unknown."""
    name = op_attribute(func)
    assembled = _assembled(func, args, kwargs, out, size)
    if assembled is not None:
        return assembled
    joined = _joined(func, args, kwargs, size)
    if joined is not None:
        return joined
    if _adds_own_rows(name, args, source, dim, owner, size):
        return dim, owner  # rows added or copied at the positions of their own examples (a MoE's combine)
    mixed = None if func in STATISTICS else mixed_dims(func, args, kwargs, source.dim())  # a norm keeps the rows
    if mixed is not None and dim in mixed:
        return -1, None  # an example's entries moved to or combined with other rows: whose they are is not followed
    if owner is None:
        chosen = name == "__getitem__" and len(args) >= 2 and args[0] is source  # the batch indexed, not the index
        selected = _selected_rows(args[1], source, size) if chosen else None
        if selected is not None and dim == 0 and out.shape[0] == selected.shape[0]:
            return 0, selected.to(out.device)  # rows of chosen examples: each row's example is known
        single = _single_example(args[1], dim, size) if chosen else None
        if single is not None and out.dim() > 0:  # x[i] in a loop over the examples: its rows all example i's
            rows = torch.full((out.shape[0],), single, dtype=torch.long, device=out.device)
            setattr(rows, EXAMPLE, single)
            return 0, rows
        new = _result_dim(func, args, source, dim, out, size, kwargs)
        part = _part(name, source, dim, out, size) if new < 0 else None
        if part is not None:  # a slice, chunk or split of the examples: rows of those examples
            return dim, part
        merged = _merged(name, source, dim, out, size) if new < 0 else None
        return (new, None) if merged is None else merged
    # rows of the examples along ``dim`` (example ``owner[j]`` at position ``j``): followed as a dim of their own
    if dim < 0:
        return -1, None
    rows = source.shape[dim]
    if dim == 0 and name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], int):
        along = args[2] if len(args) > 2 else kwargs.get("dim")
        if along is not None and int(along) % source.dim() == 0 and out.shape[0] == rows * args[1]:
            return 0, owner.repeat_interleave(args[1])
        return -1, None
    if name == "__getitem__":
        index = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        if dim == 0 and isinstance(index, torch.Tensor) and index.dim() == 1 and not index.is_floating_point():
            index = index.nonzero().flatten() if index.dtype == torch.bool else index
            if out.dim() > 0 and out.shape[0] == index.numel():
                return 0, owner[index]
            return -1, None
    new = _result_dim(func, args, source, dim, out, rows, kwargs)  # transposed, permuted, reduced, unbound, ...
    if new >= 0:
        return new, owner
    merged = _merged(name, source, dim, out, rows)  # the rows merged with the dims after them (heads folded in)
    if merged is not None:
        return merged[0], owner[merged[1].to(owner.device)]
    split = _split(name, source, dim, out, rows)  # the rows split into blocks of k ([B x H, ...] -> [B, H, ...])
    if split is None:
        return -1, None
    at, k = split
    blocks = owner.reshape(-1, k)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):  # a block holds rows of several examples:
        inner = at + 1 < out.dim() and out.shape[at + 1] == k and torch.equal(blocks, blocks[:1].expand_as(blocks))
        if not inner:  # unless each block is the same rows along the next dim ([T x B, d] viewed [T, B, d])
            return -1, None
        return at + 1, None if _in_order(blocks[0], size) else blocks[0]
    owner = blocks[:, 0]
    return at, None if _in_order(owner, size) else owner  # one row per example, in order: the examples' own dim


#: Views of a run of entries along one dim (a slice ``h[a:b]``, ``chunk``, ``split``, ``narrow``).
PARTS = frozenset(["__getitem__", "chunk", "split", "tensor_split", "narrow", "unsafe_chunk", "unsafe_split"])


def _part(name: str, source: torch.Tensor, dim: int, out: torch.Tensor, size: int) -> torch.Tensor | None:
    """The examples of ``out``, a view of a run of ``source``'s examples along their dim ``dim`` (the other dims
    whole): ``arange(start, stop)`` from where the view starts, else None."""
    if name not in PARTS or dim < 0 or out.dim() != source.dim() or out.shape[dim] >= size:
        return None
    if out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr() or out.stride() != source.stride():
        return None
    if any(a != b for d, (a, b) in enumerate(zip(out.shape, source.shape)) if d != dim):
        return None
    start, rest = divmod(out.storage_offset() - source.storage_offset(), source.stride(dim))
    if rest or start < 0 or start + out.shape[dim] > size:
        return None
    return torch.arange(start, start + out.shape[dim], device=out.device)


def _single_example(index: Any, dim: int, size: int) -> int | None:
    """The example ``t[index]`` takes alone (an int at the examples' dim ``dim``, slices or ``...`` elsewhere)."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index or len(index) <= dim or not all(isinstance(i, (int, slice)) for i in index):
        return None
    if not all(isinstance(i, slice) for i in index[:dim]) or not isinstance(index[dim], int):
        return None
    return index[dim] % size if -size <= index[dim] < size else None


def assembled_examples(func: Any, args: tuple, kwargs: dict) -> list[int] | None:
    """The examples ``torch.stack`` puts along its new dim where each stacked tensor is one example's alone (the
    results of a loop over the examples, ``x[i]``'s rows :data:`EXAMPLE`), else None."""
    if func is not torch.stack:
        return None
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    examples = [getattr(getattr(t, OWNER, None), EXAMPLE, None) for t in tensors]
    if None in examples or any(batch_dim(t) != batch_dim(tensors[0]) for t in tensors):
        return None
    return examples


def _assembled(func: Any, args: tuple, kwargs: dict, out: torch.Tensor, size: int) -> tuple[int, Any] | None:
    """Where ``torch.stack`` of one example's tensors each puts the examples: its new dim (theirs in order, or rows
    of them along dim 0), else None (not such a stack)."""
    examples = assembled_examples(func, args, kwargs)
    if examples is None:
        return None
    at = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    at = int(at) % out.dim()
    if examples == list(range(size)):
        return at, None
    return (0, torch.tensor(examples, device=out.device)) if at == 0 else (-1, None)


def _joined(func: Any, args: tuple, kwargs: dict, size: int) -> tuple[int, Any] | None:
    """Where ``torch.cat`` of rows of the examples along their dim (the halves of a batch) puts them: that dim,
    the examples' own again where the rows are theirs in order, else rows of them; None for another op or where an
    operand's examples lie elsewhere."""
    if func not in (torch.cat, torch.concat, torch.concatenate):
        return None
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    dims = {batch_dim(t) for t in tensors}
    along = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if len(dims) != 1 or None in dims or not isinstance(along, int):
        return None
    dim = dims.pop()
    if dim < 0 or along % tensors[0].dim() != dim:
        return None
    owners = [getattr(t, OWNER, None) for t in tensors]
    owners = [torch.arange(size, device=t.device) if o is None else o for o, t in zip(owners, tensors)]
    owner = torch.cat([o.to(owners[0].device) for o in owners])
    return dim, None if _in_order(owner, size) else owner


def _adds_own_rows(name: str, args: tuple, target: torch.Tensor, dim: int, owner: Any, size: int) -> bool:
    """Whether ``target.index_add(dim, index, rows)`` (or ``index_copy``) puts each of ``rows`` at a position of
    ``target`` of the same example: a MoE layer's ``out.index_add(0, tokens, expert(h[tokens]))``."""
    if name.rstrip("_") not in ("index_add", "index_copy") or len(args) < 4 or args[0] is not target or dim < 0:
        return False
    along, index, rows = args[1], args[2], args[3]
    if not isinstance(along, int) or along % target.dim() != dim or not isinstance(rows, torch.Tensor):
        return False
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or batch_dim(rows) != dim:
        return False
    mine = owner if owner is not None else torch.arange(size, device=target.device)
    theirs = getattr(rows, OWNER, None)
    theirs = theirs if theirs is not None else torch.arange(size, device=target.device)
    if mine.numel() != target.shape[dim] or theirs.numel() != index.numel():
        return False
    return bool(torch.equal(mine[index.to(mine.device)], theirs.to(mine.device)))


def _split(name: str, source: torch.Tensor, dim: int, out: torch.Tensor, rows: int) -> tuple[int, int] | None:
    """``(at, k)`` where a reshape folds ``source``'s dim ``dim`` (``rows`` rows of the examples) into ``out``'s dim
    ``at`` of ``rows / k`` entries, each ``k`` consecutive rows (``[B x H, T, d]`` viewed ``[B, H, T, d]``)."""
    if dim < 0 or name not in RESHAPES or out.dim() == 0:
        return None
    before = math.prod(source.shape[:dim])
    at = next((i for i in range(out.dim()) if math.prod(out.shape[:i]) == before), -1)
    if at < 0 or out.shape[at] >= rows or rows % max(out.shape[at], 1):
        return None
    return at, rows // out.shape[at]  # a reshape keeps the entries' order: each block is k consecutive rows


def _merged(name: str, source: torch.Tensor, dim: int, out: torch.Tensor, rows: int) -> tuple[int, Any] | None:
    """``(at, index)`` where a reshape folds ``source``'s dim ``dim`` (``rows`` entries: the examples, or rows of
    them) with dims around it into ``out``'s dim ``at``: entry ``r`` there lies in row ``index[r]`` of ``dim``
    (tokens flattened across the batch, heads or windows folded into it: ``[B x H, T, d]``; a sequence-first
    ``[T, B, d]`` flattened to ``[T x B, d]``, each row's example ``r % B``); None where an entry of ``at`` would
    span two rows, or nothing is folded."""
    if dim < 0 or name not in RESHAPES or out.dim() == 0:
        return None
    after = math.prod(source.shape[dim + 1 :])  # the entries of one row of ``dim``
    for start in range(dim, -1, -1):  # folded from dim ``start`` of ``source`` on
        before = math.prod(source.shape[:start])
        for at in (i for i in range(out.dim()) if math.prod(out.shape[:i]) == before):
            merged, total = out.shape[at], math.prod(source.shape[start:])
            if merged <= 1 or total % merged or (start == dim and merged <= rows):
                continue
            step = total // merged  # the entries of ``source`` each entry of ``at`` covers, in order
            if after % step:
                continue  # an entry of ``at`` would span two rows
            index = (torch.arange(merged, device=out.device) // (after // step)) % rows
            return at, index
    return None


def _result_dim(
    func: Any, args: tuple, source: torch.Tensor, dim: int, out: torch.Tensor, size: int, kwargs: dict | None = None
) -> int:
    """Where the examples' dim of ``source`` (``dim``) lands in ``out``, an output of ``func`` (-1: unknown)."""
    if dim < 0:
        return -1
    name = op_attribute(func)
    n = source.dim()
    kwargs = kwargs or {}
    if name in ("transpose", "swapaxes", "swapdims", "transpose_", "swapaxes_", "swapdims_"):
        pair = _arguments(args, kwargs, ("dim0", "dim1"), ("axis0", "axis1"))
        if pair is None:
            return -1
        a, b = int(pair[0]) % n, int(pair[1]) % n
        new = b if dim == a else a if dim == b else dim
    elif name in ("unsqueeze", "unsqueeze_", "stack"):  # a new dim at ``at``: the dims from it on move one up
        at = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        at = int(at) % out.dim() if isinstance(at, int) else -1
        new = -1 if at < 0 else dim + (1 if dim >= at else 0)
    elif name == "unbind":  # the dim taken apart is gone; an example's entries alone when it is theirs
        taken = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % n
        new = -1 if dim == taken else dim - (1 if dim > taken else 0)
    elif name == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:] or kwargs.get("dims")
        new = [int(d) % n for d in order].index(dim) if order is not None and len(order) == n else -1
    elif name in ("movedim", "moveaxis"):
        moves = _arguments(args, kwargs, ("source", "destination"))
        new = -1 if moves is None else _moved_dim(moves[0], moves[1], dim, n)
    elif name in ("t", "t_") and n == 2:
        new = 1 - dim
    elif name == "T" and args and args[0] is source:
        new = n - 1 - dim
    elif name == "mT" and args and args[0] is source and n >= 2:
        new = {n - 1: n - 2, n - 2: n - 1}.get(dim, dim)
    elif name == "einsum":
        new = _einsum_dim(args, source, dim)
    elif (func in MATMULS or func in BATCHED_MATMULS) and len(args) == 2:
        new = matmul_dim(args, source, dim, out.dim())
    elif name == "as_strided" and args and args[0] is source:
        new = 0 if dim == 0 and _rows_kept(source, out) else -1
    elif name in REORDERS:  # rot90, mT, as_strided...: where the dim goes is not followed
        new = -1
    elif name == "__getitem__" and len(args) >= 2:
        new = 0 if _picks_per_example(args[1], dim, size) else _indexed_dim(args[1], dim, n)
    elif name in REDUCTIONS and out.dim() < n:
        new = _reduced_dim(args[1] if len(args) > 1 else (kwargs or {}).get("dim"), dim, n)
    elif func in ELEMENTWISE or name in ("expand", "expand_as", "broadcast_to", "repeat", "tile"):
        new = dim + out.dim() - n  # broadcasting (new dims in front): aligned from the right
    elif name in ("addmm", "baddbmm") and len(args) >= 3 and any(source is t for t in args[1:3]):
        new = matmul_dim(args[1:3], source, dim, out.dim())  # b + x @ W: the product's rows
    elif name == "scaled_dot_product_attention":  # [..., L, E]: the batch dims are the query's, key's and value's
        new = dim if dim < n - 2 else -1
    elif name in STACKED_ROWS:
        new = -1  # vstack/hstack/...: a new dim in front, or a concatenation, by the operands' ranks: not followed
    elif out.dim() == n and name not in RESHAPES:
        new = dim if _follows(name, args, kwargs, source, out) else -1
    else:  # a reshape, or a change of rank: the dim after the same number of leading entries
        before = math.prod(source.shape[:dim])
        new = next((i for i in range(out.dim() + 1) if math.prod(out.shape[:i]) == before), -1)
    return new if 0 <= new < out.dim() and out.shape[new] == size else -1


#: Concatenations whose result's layout depends on their operands' ranks (a new dim in front for 1-D ones).
STACKED_ROWS = frozenset(["vstack", "row_stack", "hstack", "column_stack", "dstack"])


def _follows(name: str, args: tuple, kwargs: dict, source: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether an op keeping the rank lays ``out`` out as its batch operand ``source``: its first operand (a unary
    op, ``F.linear(x, W)``), the index of a ``gather``, a pointwise op's operand broadcast with its first; not
    ``cdist(C, h)`` or ``F.linear(C, h)`` (``[K, B]``: the batch operand's rows on the last dim, whatever the
    sizes say)."""
    first = args[0] if args else kwargs.get("input")
    if first is source:
        return True
    if name in ("gru_cell", "lstm_cell", "rnn_tanh_cell", "rnn_relu_cell"):
        return True  # [B, H]: the input's and the state's examples
    if name in ("gather", "take_along_dim"):
        return source is (args[2] if len(args) > 2 else kwargs.get("index", kwargs.get("indices")))
    if not isinstance(first, torch.Tensor):
        return True  # a number first: pointwise (torch.pow(2.0, h))
    try:
        return torch.broadcast_shapes(first.shape, source.shape) == out.shape
    except RuntimeError:
        return False


def _rows_kept(source: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out``, a strided view (``as_strided``) of ``source``, a dense tensor in any dim order, keeps its
    rows along dim 0: the same row stride and start, every other stride either within one row's span or a whole
    number of all the rows' periods, nothing past ``source``'s entries (Longformer's overlapping chunks)."""
    if out.dim() == 0 or source.dim() == 0 or out.shape[0] != source.shape[0]:
        return False
    step, rows = source.stride(0), source.shape[0]
    if out.stride(0) != step or out.storage_offset() != source.storage_offset():
        return False
    dense = 1
    for d in sorted(range(source.dim()), key=source.stride):
        if source.shape[d] > 1 and source.stride(d) != dense:
            return False
        dense *= source.shape[d]
    others = [(n, t) for n, t in zip(out.shape[1:], out.stride()[1:]) if n > 1]
    if sum((n - 1) * t for n, t in others if t < step) >= step or any(
        t >= step and t % (step * rows) for _, t in others
    ):
        return False
    return sum((n - 1) * t for n, t in zip(out.shape, out.stride())) < source.numel()


def _arguments(args: tuple, kwargs: dict, *spellings: tuple[str, ...]) -> tuple[Any, ...] | None:
    """A method's two arguments after ``self``, positional or by any of their keyword ``spellings``."""
    if len(args) >= 3:
        return args[1], args[2]
    for names in spellings:
        values = list(args[1:2]) + [kwargs[k] for k in names[len(args[1:2]) :] if k in kwargs]
        if len(values) == 2:
            return tuple(values)
    return None


def _einsum_dim(args: tuple, source: torch.Tensor, dim: int) -> int:
    """Where dim ``dim`` of operand ``source`` lands in ``torch.einsum(equation, *operands)`` (-1: summed over,
    or not found)."""
    spelled = einsum_terms(args)
    if spelled is None:
        return -1
    terms, output, operands = spelled
    term = next((t for t, op in zip(terms, operands) if op is source), None)
    if term is None or dim >= len(term):
        return -1
    return output.find(term[dim])


def _moved_dim(source: Any, destination: Any, dim: int, n: int) -> int:
    """Where dim ``dim`` lands after ``movedim(source, destination)`` on an ``n``-dim tensor."""
    sources = [int(d) % n for d in (source if isinstance(source, (tuple, list)) else (source,))]
    targets = [int(d) % n for d in (destination if isinstance(destination, (tuple, list)) else (destination,))]
    if dim in sources:
        return targets[sources.index(dim)]
    free = [d for d in range(n) if d not in targets]
    return free[[d for d in range(n) if d not in sources].index(dim)]


def _selected_rows(index: Any, source: torch.Tensor, size: int) -> torch.Tensor | None:
    """The example of each row of ``source[index]`` (examples along dim 0) where the index chooses rows along the
    examples with one 1-D integer index or a boolean mask (a subset, a permutation, a task's examples), the other
    dims by slices only; None for any other index (one entry per example, ``t[arange(B), ids]``, is not this)."""
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
    if not all(isinstance(i, slice) or i is Ellipsis for i in rest):
        return None
    if isinstance(first, list):
        if not first or not all(isinstance(i, (int, bool)) for i in first):
            return None
        first = torch.tensor(first)
    if not isinstance(first, torch.Tensor) or first.dim() != 1 or first.is_floating_point():
        return None
    if first.dtype == torch.bool:
        return torch.nonzero(first).flatten() if first.shape[0] == size == source.shape[0] else None
    return first.long() % size if source.shape[0] == size else None


def _picks_per_example(index: Any, dim: int, size: int) -> bool:
    """Whether ``t[index]`` is ``t[arange(B), positions, ...]`` with the examples along dim 0: one entry per
    example, in order (CLIP's pooled token ``hidden[arange(B), ids.argmax(-1)]``), so the result's dim 0 is theirs."""
    if dim != 0 or not isinstance(index, tuple) or len(index) < 2:
        return False
    first = index[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 1 or first.numel() != size or first.is_floating_point():
        return False
    if not all(i.dim() <= 1 and i.numel() in (1, size) for i in index[1:] if isinstance(i, torch.Tensor)):
        return False
    return _in_order(first, size)


def _indexed_dim(index: Any, dim: int, n: int) -> int:
    """Where dim ``dim`` of an ``n``-dim tensor lands after ``t[index]`` with basic indexing (ints, slices,
    ``None``, ``...``); -1 when ``dim`` itself is indexed by an int or the index holds tensors."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (torch.Tensor, list)) for i in index):  # advanced indexing: rows picked, reordered
        return -1
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    source, out = 0, 0
    for i in index:
        if i is Ellipsis:
            skip = n - consumed
            if source <= dim < source + skip:
                return out + dim - source
            source, out = source + skip, out + skip
        elif i is None:
            out += 1
        elif isinstance(i, int):
            if source == dim:
                return -1
            source += 1
        else:  # a slice keeps the dim
            if source == dim:
                return out
            source, out = source + 1, out + 1
    return out + dim - source if dim >= source else -1


def _reduced_dim(reduced: Any, dim: int, n: int) -> int:
    """Where dim ``dim`` lands after a reduction over ``reduced`` (an int or a tuple) without ``keepdim``."""
    if reduced is None:
        return -1
    reduced = {int(d) % n for d in (reduced if isinstance(reduced, (tuple, list)) else (reduced,))}
    return -1 if dim in reduced else dim - sum(1 for d in reduced if d < dim)
