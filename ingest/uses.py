"""Op-level capture: each use of a captured parameter, taken at the op that consumes it.

A module hook assumes how a module uses its weight. This capture does not: while a captured forward runs, a
:class:`~torch.overrides.TorchFunctionMode` (:class:`ParameterUses`) sees every torch function call, and where a
captured parameter is an operand it forms that use's per-example gradient from the op's real inputs and output
gradient:

* ``F.linear`` (weight of a ``linear``/``attention``/``parameter`` slot, with its bias): the Linear rule on the
  op's input; inside ``F.multi_head_attention_forward`` (which works sequence-first and reads ``out_proj.weight``
  and the packed ``in_proj_weight`` without calling a module) inputs are ``[T, B, d]`` or ``[T*B, d]``;
* ``F.embedding`` with batch-first indices: the lookup rule with the op's own indices and padding index;
* ``conv1d/2d/3d``: the Linear rule over the input's patches (im2col, ``[C_in/groups x kernel]``);
* a tensor computed from parameters alone (a position table sliced or looked up with indices that do not come
  from the batch, T5's relative-position bias, a ``cls_token`` expanded over the batch) is followed until it
  meets the batch in an elementwise op or a concatenation. There it is expanded over the batch, so autograd hands
  each example its own output gradient, and the parameter's per-example gradient is a batched vector-Jacobian
  product through the parameter-only part (``torch.autograd.grad(..., is_grads_batched=True)``).

What comes from the batch is known by marking the model's inputs and every tensor computed from them (a taint,
not a shape guess: indices of shape ``[T, T]`` are batch-free even when ``T == B``). A use of a captured
parameter that none of the rules covers is reported to the capture's coverage (``uncovered``), never silently
left out. Layers a module hook provably captures (:mod:`ingest.layers`) keep the hook; their own op inside the
module's forward is left to it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ingest.hooks import TAKEN_MARK, ActiveBatch, LayerHook, RecomputationError, in_backward

log = logging.getLogger(__name__)

#: Attribute set on tensors computed from the batch's inputs: the dim that indexes the examples (-1: unknown).
BATCHED = "_gradstore_batched"
TAKEN = TAKEN_MARK
#: Attribute set on a batch tensor whose dim 0 mixes the examples (tokens flattened across the batch, then
#: gathered): a long tensor, the example of each entry along dim 0.
OWNER = "_gradstore_owner"
#: Attribute set on a slice ``param[e]`` of a captured stacked parameter: ``(param, e)``.
SLICE = "_gradstore_slice"
#: Attribute set on ``param[ids]`` of a captured stacked parameter gathered per row (``ids`` a 1-D long tensor,
#: transformers' batched-mm experts): ``(param, ids)``.
GATHER = "_gradstore_gather"
#: Attribute set on batch-free tensors computed from captured parameters: the parameters (a tuple).
SOURCES = "_gradstore_sources"
#: Elementwise (broadcasting) functions where a parameter-only tensor may meet the batch.
ELEMENTWISE = frozenset(
    [
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
        torch.where,
        *(
            getattr(torch.Tensor, name)
            for name in (
                "add",
                "sub",
                "mul",
                "div",
                "add_",
                "sub_",
                "mul_",
                "div_",
                "__add__",
                "__radd__",
                "__iadd__",
                "__sub__",
                "__rsub__",
                "__isub__",
                "__mul__",
                "__rmul__",
                "__imul__",
                "__truediv__",
                "__rtruediv__",
                "__itruediv__",
            )
        ),
    ]
)
RESHAPES = frozenset(["view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"])
REDUCTIONS = frozenset(["mean", "sum", "amax", "amin", "max", "min", "std", "var", "logsumexp", "prod", "norm"])
CONCATENATIONS = frozenset([torch.cat, torch.concat, torch.concatenate, torch.stack])
CONVOLUTIONS = frozenset([torch.conv1d, torch.conv2d, torch.conv3d])
#: Normalisations with an elementwise scale (and shift) over the last dims: their argument names, in order.
NORMALIZATIONS = {
    F.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
    **({F.rms_norm: ("input", "normalized_shape", "weight", "eps")} if hasattr(F, "rms_norm") else {}),
}
#: Grouped matmuls ``(x [S, d_in], W [E, d_in, d_out], offs [E])``: rows ``offs[e-1]:offs[e]`` of ``x`` use ``W[e]``.
GROUPED_MM = frozenset(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)


def _unguarded(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a Python function of ``torch.nn.functional``) without its own ``handle_torch_function`` call,
    so the ops inside it reach the active mode (the mode sees ``func`` itself first and descends)."""
    clone = types.FunctionType(
        func.__code__,
        dict(func.__globals__, has_torch_function=lambda *_: False),
        func.__name__,
        func.__defaults__,
        func.__closure__,
    )
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


_ATTENTION = _unguarded(F.multi_head_attention_forward)


class UseOwner(Protocol):
    """What the op-level capture needs from the capture that owns it."""

    batch: ActiveBatch | None

    def uncovered(self, names: Iterable[str], how: str) -> None: ...


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def mark_batched(values: Iterable[Any]) -> None:
    """Mark the tensors among ``values`` (and inside lists, tuples and dicts one level down) as the batch's,
    examples along dim 0."""
    for value in values:
        if isinstance(value, dict):
            mark_batched(value.values())
        for t in _tensors([value]):
            setattr(t, BATCHED, 0)


def batch_dim(t: Any) -> int | None:
    """The dim of ``t`` that indexes the examples (-1: from the batch, dim unknown; None: not from the batch)."""
    return getattr(t, BATCHED, None) if isinstance(t, torch.Tensor) else None


def _result_dim(
    func: Any, args: tuple, source: torch.Tensor, dim: int, out: torch.Tensor, size: int, kwargs: dict | None = None
) -> int:
    """Where the examples' dim of ``source`` (``dim``) lands in ``out``, an output of ``func`` (-1: unknown)."""
    if dim < 0:
        return -1
    name = getattr(func, "__name__", "")
    n = source.dim()
    if name in ("transpose", "swapaxes", "swapdims") and len(args) >= 3:
        a, b = int(args[1]) % n, int(args[2]) % n
        new = b if dim == a else a if dim == b else dim
    elif name == "permute" and len(args) >= 2:
        order = args[1] if isinstance(args[1], (tuple, list)) else args[1:]
        new = [int(d) % n for d in order].index(dim)
    elif name == "__getitem__" and len(args) >= 2:
        new = _indexed_dim(args[1], dim, n)
    elif name in REDUCTIONS and out.dim() < n:
        new = _reduced_dim(args[1] if len(args) > 1 else (kwargs or {}).get("dim"), dim, n)
    elif func in ELEMENTWISE:  # broadcasting: aligned from the right
        new = dim + out.dim() - n
    elif out.dim() == n and name not in RESHAPES:
        new = dim
    else:  # a reshape, or a change of rank: the dim after the same number of leading entries
        before = math.prod(source.shape[:dim])
        new = next((i for i in range(out.dim() + 1) if math.prod(out.shape[:i]) == before), -1)
    return new if 0 <= new < out.dim() and out.shape[new] == size else -1


def _indexed_dim(index: Any, dim: int, n: int) -> int:
    """Where dim ``dim`` of an ``n``-dim tensor lands after ``t[index]`` with basic indexing (ints, slices,
    ``None``, ``...``); -1 when ``dim`` itself is indexed by an int or the index holds tensors."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) for i in index):
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


def _mark(result: Any, attribute: str, value: Any) -> None:
    for t in _tensors([result]):
        setattr(t, attribute, value)


class ParameterUses(TorchFunctionMode):
    """The op-level capture (see the module doc) of ``hooks``' parameters while a captured forward runs.

    ``hooks``: the layer hooks of the op-level slots and of the hooked slots (whose own forward is theirs: a use
    of a hooked slot's parameter outside its module is captured here too). ``names``: every trainable parameter's
    name, by id (for reports). ``seen_outside`` becomes True when a hooked parameter was used outside its module.
    """

    def __init__(
        self,
        owner: UseOwner,
        hooks: list[LayerHook],
        hooked: set[int],
        names: dict[int, str],
        left_out: dict[int, Any] | None = None,
    ) -> None:
        super().__init__()
        self.left_out = left_out or {}  # weight id -> the op of a layer module the selection leaves out
        self.owner = owner
        self.names = names
        self.slots: dict[int, list[LayerHook]] = {}
        for hook in hooks:
            self.slots.setdefault(id(hook.parameter), []).append(hook)
        self.hooked = hooked  # ids of the modules whose hooks capture their own forward
        # running hooked modules, their inputs and their own parameters' ids
        self.scope: list[tuple[nn.Module, Any, frozenset[int]]] = []
        self.sequence_first = False
        self.seen_outside = False

    # modules ------------------------------------------------------------------------------------

    def enter_module(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of a hooked module: its own op is its hook's when its input is batch-first."""
        own = frozenset(id(p) for p in module.parameters(recurse=False))
        self.scope.append((module, args[0] if args else None, own))

    def leave_module(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook of a hooked module (``always_call``): a Linear/Conv1D/Embedding keeps its input's leading
        dims, so its output indexes the examples where its input does (its forward may flatten in between)."""
        if self.scope and self.scope[-1][0] is module:
            _, x, _ = self.scope.pop()
            dim = batch_dim(x)
            if dim is not None and isinstance(output, torch.Tensor) and output.dim() > dim >= 0:
                setattr(output, BATCHED, dim)

    # dispatch -----------------------------------------------------------------------------------

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        batch = self.owner.batch
        if batch is None:
            return func(*args, **kwargs)
        if in_backward():
            return self._recomputed(func, args, kwargs)
        if not torch.is_grad_enabled():  # no gradient here; the examples are still tracked (a custom Function)
            return self._without_grad(func, args, kwargs, batch)
        if func is F.multi_head_attention_forward:
            return self._attention(batch, args, kwargs)
        if func is torch.Tensor.__getitem__ and args and self._is_stacked(args[0]):
            return self._slice(args)
        operands = list(_tensors(args)) + list(_tensors(kwargs.values()))
        first = _batch_operand(operands)
        batched = first is not None
        sources = self._sources(operands)
        own = self._own_forward(sources) if sources else False
        if own is not False and _hook_owns(own, batch.size):
            sources = []  # a hooked module's own op on a batch-first input: its hook captures this use
        if sources:
            result = self._use(func, args, kwargs, batch, batched, sources)
            if own is not False and isinstance(result, torch.Tensor):
                setattr(result, TAKEN, True)
                self.seen_outside = True
        else:
            result = func(*args, **kwargs)
        try:
            self._mark_result(func, args, kwargs, result, first, sources, batch.size)
        except Exception as error:  # an op this bookkeeping does not know: its outputs' examples are unknown
            log.debug("op-level capture: no batch bookkeeping for %s: %r", _name(func), error)
            for out in _tensors([result]):
                with contextlib.suppress(Exception):
                    setattr(out, BATCHED, -1 if first is not None else None)
        return result

    def _mark_result(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        result: Any,
        first: torch.Tensor | None,
        sources: list[torch.Tensor],
        size: int,
    ) -> None:
        """Mark ``result``: where its examples are (from ``first``, the batch operand), or the parameters behind it."""
        if first is not None:
            dim, owner = batch_dim(first), getattr(first, OWNER, None)
            for out in _tensors([result]):  # an in-place op returns (and so marks) its first operand
                new, new_owner = _result_batch(func, args, kwargs, first, dim, owner, out, size)
                setattr(out, BATCHED, new)
                setattr(out, OWNER, new_owner)
        elif sources:
            _mark(result, SOURCES, tuple({id(p): p for p in sources}.values()))

    def _without_grad(self, func: Any, args: tuple, kwargs: dict, batch: ActiveBatch) -> Any:
        operands = list(_tensors(args)) + list(_tensors(kwargs.values()))
        first = _batch_operand(operands)
        used = [t for t in operands if id(t) in self.slots and t.requires_grad]
        if used and first is not None:  # e.g. the forward of reentrant checkpointing: recomputed unseen later
            self.owner.uncovered(self._names(used), f"{_name(func)} under torch.no_grad (reentrant checkpointing?)")
        result = func(*args, **kwargs)
        with contextlib.suppress(Exception):
            self._mark_result(func, args, kwargs, result, first, [], batch.size)
        return result

    def _recomputed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op run inside a backward: a reentrant gradient-checkpointing recomputation. A use of a captured
        parameter there would be backpropagated in a nested backward the capture does not see: refused, as the
        hooks refuse it (:class:`~ingest.hooks.RecomputationError`), when that output is backpropagated."""
        result = func(*args, **kwargs)
        operands = list(_tensors(args)) + list(_tensors(kwargs.values()))
        if isinstance(result, torch.Tensor) and result.requires_grad and any(id(t) in self.slots for t in operands):
            name = sorted(self._names([t for t in operands if id(t) in self.slots]))[0]
            result.register_hook(functools.partial(_refuse_recomputation, name))
        return result

    def _sources(self, operands: list[torch.Tensor]) -> list[torch.Tensor]:
        """The captured parameters among ``operands`` or behind their parameter-only inputs."""
        found = []
        for t in operands:
            if id(t) in self.slots:
                found.append(t)
            found.extend(getattr(t, SOURCES, ()))
            if hasattr(t, SLICE):
                found.append(getattr(t, SLICE)[0])
            if hasattr(t, GATHER):
                found.append(getattr(t, GATHER)[0])
        return found

    def _is_stacked(self, t: Any) -> bool:
        return any(h.index is not None for h in self.slots.get(id(t), ()))

    def _slice(self, args: tuple) -> Any:
        """``param[e]`` of a stacked parameter with one integer index (an expert chosen by the router): the slice,
        marked so its uses go to slot ``e``; any other indexing of it is a use no rule splits."""
        param, index = args[0], args[1]
        result = torch.Tensor.__getitem__(param, index)
        integer = isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool
        if integer and index.dim() == 0:
            index = int(index)
        if isinstance(index, int):
            setattr(result, SLICE, (param, index % param.shape[0]))
        elif integer and index.dim() == 1:
            setattr(result, GATHER, (param, index % param.shape[0]))
        else:
            self.owner.uncovered(self._names([param]), "indexing other than param[e]")
        return result

    def _own_forward(self, sources: list[torch.Tensor]) -> Any:
        """The module's input when this op is a hooked module's own op on its own parameters, else False."""
        if not self.scope:
            return False
        _, x, own = self.scope[-1]
        return x if all(id(p) in own for p in sources) else False

    # uses ---------------------------------------------------------------------------------------

    def _use(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        batch: ActiveBatch,
        batched: bool,
        sources: list[torch.Tensor],
    ) -> Any:
        if not batched:
            return func(*args, **kwargs)  # parameters among themselves: followed until they meet the batch
        if self.left_out.get(id(args[1] if len(args) > 1 else None)) is func:
            return func(*args, **kwargs)  # a left-out layer's own op on a weight it shares (a tied lm_head)
        if any(self._is_hooked(p) for p in sources):
            self.seen_outside = True
        try:
            if func is F.linear:
                result = self._linear(batch, *args, **kwargs)
            elif func is F.embedding:
                result = self._embedding(batch, args, kwargs)
            elif func in CONVOLUTIONS:
                result = self._convolution(batch, func, args, kwargs)
            elif func in GROUPED_MM or _name(func).endswith("grouped_mm_fallback"):
                result = self._grouped(batch, func, args, kwargs)
            elif func in (torch.bmm, torch.Tensor.bmm) and not kwargs:
                result = self._gathered(batch, *args)
            elif func in NORMALIZATIONS:
                result = self._normalization(batch, func, args, kwargs)
            elif func in ELEMENTWISE or func in CONCATENATIONS:
                result = self._meet(batch, func, args, kwargs)
            else:
                result = None
        except Exception as error:  # a rule that does not fit this call: the use is reported, training goes on
            log.warning(
                "op-level capture: %s on %s failed (%r); reported as not captured",
                _name(func),
                self._names(sources),
                error,
            )
            result = None
        if result is None:
            self.owner.uncovered(self._names(sources), _name(func))
            return func(*args, **kwargs)
        return result

    def _is_hooked(self, param: torch.Tensor) -> bool:
        return any(id(h.module) in self.hooked for h in self.slots.get(id(param), ()))

    def _names(self, sources: list[torch.Tensor]) -> list[str]:
        return sorted({self.names.get(id(p), "<tensor>") for p in sources})

    def _slot(self, weight: Any, kinds: tuple[str, ...]) -> LayerHook | None:
        if hasattr(weight, SLICE):  # a slice of a stacked parameter: its own slot
            param, index = getattr(weight, SLICE)
            return next((h for h in self.slots.get(id(param), ()) if h.index == index), None)
        for hook in self.slots.get(id(weight), ()):
            if hook.slot.kind in kinds and hook.index is None:
                return hook
        return None

    def _linear(self, batch: ActiveBatch, x: Any, weight: Any, bias: Any = None) -> Any:
        hook = self._slot(weight, ("linear", "attention", "parameter"))
        if hook is None or batch_dim(x) is None:
            return None
        if bias is not None and bias is not hook.bias:
            return None
        if hook.slot.has_bias and bias is None:
            return None
        owner = getattr(x, OWNER, None)
        if owner is not None and not self.sequence_first and x.dim() == 2:  # rows that mix the examples
            out = F.linear(x, weight, bias)
            out.register_hook(functools.partial(_rows_backward, hook, batch.generation, x.detach(), owner))
            return out
        layout = self._layout(x, batch.size)
        if layout is None:
            return None
        out = F.linear(x, weight, bias)
        route, saved = hook._save(layout(x.detach()), batch.size)
        out.register_hook(functools.partial(_backward, hook, batch.generation, route, saved, layout))
        return out

    def _layout(self, x: torch.Tensor, size: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How to view ``x`` (and its output gradient) batch-first, or None when its batch cannot be found."""
        if self.sequence_first:
            if x.dim() < 2 or (x.shape[-2] != size if x.dim() >= 3 else x.shape[0] % size):
                return None
            return lambda t: t.reshape(-1, size, t.shape[-1]).transpose(0, 1)
        dim = batch_dim(x)
        if dim is None or dim < 0 or x.dim() < 2:
            return None
        return (lambda t: t) if dim == 0 else (lambda t: t.movedim(dim, 0))

    def _embedding(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        bound = _bind(F.embedding, args, kwargs)
        idx, weight = bound["input"], bound["weight"]
        hook = self._slot(weight, ("embedding",))
        dim = batch_dim(idx)
        if hook is None or dim is None or dim < 0 or self.sequence_first or bound.get("max_norm") is not None:
            return None
        out = F.embedding(*args, **kwargs)
        padding = bound.get("padding_idx")
        hook.padding_idx = None if padding is None else padding % hook.slot.d_in
        layout = None if dim == 0 else (lambda t: t.movedim(dim, 0))
        route, saved = hook._save(idx.detach() if layout is None else layout(idx.detach()), batch.size)
        out.register_hook(functools.partial(_backward, hook, batch.generation, route, saved, layout))
        return out

    def _convolution(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        bound = _bind(func, args, kwargs)
        x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
        hook = self._slot(weight, ("conv",))
        if hook is None or batch_dim(x) != 0 or self.sequence_first:
            return None
        if (bias is not None and bias is not hook.bias) or (hook.slot.has_bias and bias is None):
            return None
        out = func(*args, **kwargs)
        patches = conv_patches(
            x.detach(), weight.shape[2:], bound.get("stride", 1), bound.get("padding", 0), bound.get("dilation", 1)
        )
        groups = int(bound.get("groups", 1))
        if groups == 1:
            route, saved = hook._save(patches, batch.size)
            out.register_hook(functools.partial(_backward, hook, batch.generation, route, saved, _channels_last))
        else:
            out.register_hook(functools.partial(_grouped_backward, hook, batch.generation, patches, groups))
        return out

    def _normalization(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """``F.layer_norm``/``F.rms_norm`` with a captured scale or shift (kind ``norm``): per example, the scale's
        gradient sums ``dy * x_hat`` and the shift's ``dy`` over the example's positions."""
        bound = {**dict(zip(NORMALIZATIONS[func], args)), **kwargs}
        x, shape = bound["input"], tuple(bound["normalized_shape"])
        scale, shift = bound.get("weight"), bound.get("bias")
        hooks = [(p, self._slot(p, ("norm",))) for p in (scale, shift) if p is not None]
        layout = self._layout(x, batch.size) if batch_dim(x) is not None else None
        if layout is None or self.sequence_first:
            return None
        out = func(*args, **kwargs)
        with torch.no_grad():
            plain = {"eps": bound["eps"]} if bound.get("eps") is not None else {}
            x_hat = func(x.detach(), shape, **plain) if func is F.layer_norm else func(x.detach(), shape, None, **plain)
        out.register_hook(
            functools.partial(
                _normalization_backward, hooks, scale, batch.generation, layout(x_hat), len(shape), layout
            )
        )
        return out

    def _grouped(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """A grouped matmul over a stacked parameter (transformers' MoE experts): rows of group ``e`` use slice ``e``,
        whose per-example gradient sums each example's rows (the rows' examples tracked through the routing)."""
        x, weight = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        owner = getattr(x, OWNER, None)
        sources = getattr(weight, SOURCES, ()) if id(weight) not in self.slots else (weight,)
        if owner is None or len(sources) != 1 or offs is None or x.dim() != 2 or self.sequence_first:
            return None
        param = sources[0]
        hooks = {h.index: h for h in self.slots.get(id(param), ()) if h.index is not None}
        if len(hooks) != param.shape[0]:
            return None
        if tuple(weight.shape) == (param.shape[0], param.shape[2], param.shape[1]) and param.shape[1] != param.shape[2]:
            transposed = True  # W = param^T: a slice's gradient is dy^T x, in the parameter's own layout
        elif tuple(weight.shape) == tuple(param.shape):
            transposed = False  # W = param: its gradient is x^T dy
        else:
            return None
        out = func(*args, **kwargs)
        ends = offs.tolist()
        out.register_hook(
            functools.partial(_grouped_backward_rows, hooks, batch.generation, x.detach(), owner, ends, transposed)
        )
        return out

    def _gathered(self, batch: ActiveBatch, a: Any, b: Any) -> Any:
        """``bmm`` of per-row gathered slices ``param[ids]`` with rows of mixed examples (transformers' batched-mm
        experts): row ``r`` uses slice ``ids[r]``; each slice's per-example gradient sums its examples' rows."""
        if hasattr(a, GATHER) and getattr(b, OWNER, None) is not None and b.dim() == 3 and b.shape[2] == 1:
            (param, ids), x, owner, left = getattr(a, GATHER), b, getattr(b, OWNER), True  # param[ids] @ x
        elif hasattr(b, GATHER) and getattr(a, OWNER, None) is not None and a.dim() == 3 and a.shape[1] == 1:
            (param, ids), x, owner, left = getattr(b, GATHER), a, getattr(a, OWNER), False  # x @ param[ids]
        else:
            return None
        hooks = {h.index: h for h in self.slots.get(id(param), ()) if h.index is not None}
        if len(hooks) != param.shape[0] or ids.shape[0] != x.shape[0]:
            return None
        out = torch.bmm(a, b)
        x = x.detach().reshape(x.shape[0], -1)
        out.register_hook(functools.partial(_gathered_backward, hooks, batch.generation, x, owner, ids, left))
        return out

    def _attention(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        """``F.multi_head_attention_forward`` with its inner ops visible, sequence-first."""
        query = args[0] if args else kwargs["query"]
        if query.dim() == 3 and query.shape[1] != batch.size:
            return F.multi_head_attention_forward(*args, **kwargs)  # not this batch's layout: uses are uncovered
        previous, self.sequence_first = self.sequence_first, query.dim() == 3
        try:
            with self:
                return _ATTENTION(*args, **kwargs)
        finally:
            self.sequence_first = previous

    # parameter-only tensors meeting the batch -----------------------------------------------------

    def _meet(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` with every parameter-only operand expanded over the batch (dim 0 of the result) and hooked,
        so each example's gradient of it arrives separately (see the module doc). None when an operand's
        parameters are not all captured or the layout is not one this rule handles."""
        if self.sequence_first:
            return None
        if _in_place(func) and args and batch_dim(args[0]) is None:
            return None  # the parameter-only operand is the one written to
        size = batch.size
        if func in CONCATENATIONS:
            tensors = args[0] if args else kwargs["tensors"]
            dim = _bind(func, args, kwargs).get("dim", 0)
            if dim % tensors[0].dim() == 0 and func is not torch.stack:
                return None
            shape = None
        else:
            tensors = list(_tensors(args)) + list(_tensors(kwargs.values()))
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        replaced: dict[int, torch.Tensor] = {}
        for t in tensors:
            params = self._sources([t])
            if not params or batch_dim(t) is not None or id(t) in replaced:
                continue
            targets = [
                self._slot(p, ("embedding", "parameter", "norm", "linear", "attention", "conv", "conv1d"))
                for p in params
            ]
            if any(h is None for h in targets):
                return None
            expanded = _expand(t, shape, size)
            if expanded is None:
                return None
            expanded.register_hook(functools.partial(_meeting_backward, t, params, targets, batch.generation, size))
            replaced[id(t)] = expanded
        return func(*_swap(args, replaced), **{k: _swap_one(v, replaced) for k, v in kwargs.items()})


def _batch_operand(operands: list[torch.Tensor]) -> torch.Tensor | None:
    """The operand whose examples' dim the outputs follow: one with a known dim, else any from the batch."""
    dims = [(batch_dim(t), t) for t in operands]
    first = next((t for d, t in dims if d is not None and d >= 0), None)
    return first if first is not None else next((t for d, t in dims if d is not None), None)


def _hook_owns(x: Any, size: int) -> bool:
    """Whether a hooked module's hook captures its forward on input ``x`` exactly: a batch-first input, or one of
    a single row that the hook broadcasts over the batch (e.g. position ids ``[1, T]``)."""
    if not isinstance(x, torch.Tensor):
        return False
    dim = batch_dim(x)
    if getattr(x, OWNER, None) is not None:
        return False  # rows that mix the examples (tokens flattened across the batch): captured at the op
    return dim == 0 or (dim is None and x.dim() > 0 and (x.shape[0] == 1 or size == 1))


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first operand (``add_``, ``__iadd__``, ``__setitem__``)."""
    name = getattr(func, "__name__", "")
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.endswith("__"))
    )


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of a functional op by name (the signatures of ``F.embedding`` and ``convNd``)."""
    if func is F.embedding:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    elif func in CONCATENATIONS:
        names = ("tensors", "dim")
    else:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    return {**dict(zip(names, args)), **kwargs}


def _swap_one(value: Any, replaced: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return replaced.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(replaced.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _swap(args: tuple, replaced: dict[int, torch.Tensor]) -> tuple:
    return tuple(_swap_one(a, replaced) for a in args)


def _expand(t: torch.Tensor, shape: torch.Size | None, size: int) -> torch.Tensor | None:
    """``t`` as an operand whose dim 0 is the batch: broadcast to ``shape`` (elementwise ops) or, in a
    concatenation, ``t`` itself when its dim 0 already spans the batch."""
    if shape is None:
        if t.dim() == 0 or t.shape[0] != size:
            return None
        return t.view_as(t)
    if len(shape) == 0 or shape[0] != size or t.dim() > len(shape):
        return None
    return t.expand(shape)


def _backward(
    hook: LayerHook,
    generation: int,
    route: str,
    saved: torch.Tensor,
    layout: Callable[[torch.Tensor], torch.Tensor] | None,
    dy: torch.Tensor,
) -> None:
    hook._backward(generation, route, saved, dy if layout is None else layout(dy))


def _grouped_backward_rows(
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


def _gathered_backward(
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


def _normalization_backward(
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


def _refuse_recomputation(name: str, grad: torch.Tensor) -> None:
    raise RecomputationError(
        f"capture: parameter {name!r} was used in a recomputation backpropagated inside backward (reentrant "
        "gradient checkpointing). Use non-reentrant checkpointing (use_reentrant=False) or disable gradient "
        "checkpointing while capturing."
    )


def _rows_backward(hook: LayerHook, generation: int, x: torch.Tensor, owner: torch.Tensor, dy: torch.Tensor) -> None:
    hook.add_rows(generation, x, dy, owner)


def _result_batch(
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
    name = getattr(func, "__name__", "")
    if owner is None:
        new = _result_dim(func, args, source, dim, out, size, kwargs)
        if new >= 0 or dim != 0 or name not in RESHAPES or out.dim() == 0:
            return new, None
        merged = out.shape[0]  # leading dims merged into dim 0 (tokens flattened across the batch)?
        if merged % size == 0 and any(math.prod(source.shape[: j + 1]) == merged for j in range(1, source.dim())):
            return 0, torch.arange(size, device=out.device).repeat_interleave(merged // size)
        return -1, None
    rows = source.shape[0]
    if name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], int):
        along = args[2] if len(args) > 2 else kwargs.get("dim")
        if along is not None and int(along) % source.dim() == 0 and out.shape[0] == rows * args[1]:
            return 0, owner.repeat_interleave(args[1])
        return -1, None
    if name == "__getitem__":
        index = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        if isinstance(index, torch.Tensor) and index.dim() == 1 and not index.is_floating_point():
            index = index.nonzero().flatten() if index.dtype == torch.bool else index
            if out.dim() > 0 and out.shape[0] == index.numel():
                return 0, owner[index]
        return -1, None
    if name in RESHAPES and out.dim() > 0 and out.shape[0] == size and rows % size == 0:
        regular = torch.arange(size, device=owner.device).repeat_interleave(rows // size)
        return (0, None) if torch.equal(owner, regular) else (-1, None)
    if name in ("transpose", "swapaxes", "swapdims", "permute", "t", "movedim"):
        return -1, None
    if name in REDUCTIONS and out.dim() < source.dim():
        reduced = args[1] if len(args) > 1 else kwargs.get("dim")
        return (0, owner) if _reduced_dim(reduced, 0, source.dim()) == 0 else (-1, None)
    broadcast_up = func in ELEMENTWISE and out.dim() > source.dim()
    if out.dim() > 0 and out.shape[0] == rows and not broadcast_up:
        return 0, owner  # dim 0 kept (elementwise, unsqueeze, chunk, a reshape of the other dims, ...)
    return -1, None


def _channels_last(dy: torch.Tensor) -> torch.Tensor:
    """A convolution's output gradient ``[B, C_out, *spatial]`` as ``[B, positions, C_out]``."""
    return dy.flatten(2).transpose(1, 2)


def _grouped_backward(hook: LayerHook, generation: int, patches: torch.Tensor, groups: int, dy: torch.Tensor) -> None:
    """A grouped convolution's per-example gradient ``[B, C_out, C_in/groups x kernel (+1)]``, materialised."""
    with torch.no_grad():
        size, positions = patches.shape[:2]
        x = patches.reshape(size, positions, groups, -1).float()
        g = _channels_last(dy.detach()).reshape(size, positions, groups, -1).float()
        grad = torch.einsum("blgo,blgi->bgoi", g, x).reshape(size, -1, x.shape[-1])
        if hook.slot.has_bias:
            grad = torch.cat([grad, g.sum(dim=1).reshape(size, -1, 1)], dim=-1)
    hook.add_gradient(generation, grad)


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


def _meeting_backward(
    operand: torch.Tensor,
    params: list[torch.Tensor],
    hooks: list[LayerHook],
    generation: int,
    size: int,
    grad: torch.Tensor,
) -> None:
    """The per-example (per-token, for a per-token capture's hooks) gradients of ``params`` from the gradient of
    their batch-expanded ``operand``."""
    positions = grad.shape[1] if hooks[0].PER_POSITION and grad.dim() > 1 else None
    with torch.no_grad():
        per_row = split_operand(grad.detach(), operand.shape, 1 if positions is None else 2)
    if len(params) == 1 and params[0] is operand:
        grads = [per_row]
    else:
        grads = torch.autograd.grad(
            operand, params, per_row, retain_graph=True, is_grads_batched=True, allow_unused=True
        )
    for param, hook, g in zip(params, hooks, grads):
        if g is not None:
            hook.add_gradient(generation, slot_gradient(hook, param, g), positions)


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
