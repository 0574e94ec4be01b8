"""The op-level capture's :class:`~torch.overrides.TorchFunctionMode` (:mod:`ingest.uses`): sees every torch
function call of a captured forward, hands each use of a captured parameter to its rule (:class:`UseRules`), leaves
a hooked module's own op to its hook, and marks every result with where its examples are."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ingest.hooks import ActiveBatch, LayerHook, in_backward
from ingest.output_hooks import on_gradient
from ingest.uses.batch_tracking import (
    ACROSS,
    BATCHED,
    BROADCAST,
    BROADCAST_HOOK,
    GATHER,
    OWNER,
    POOLED,
    ROWS,
    SLICE,
    SOURCES,
    TAKEN,
    assembled_examples,
    batch_dim,
    batch_operand,
    landings,
    mark_packing,
    pools_examples,
    pools_owned_rows,
    result_batch,
    row_block,
    set_order,
    tensors_in,
)
from ingest.uses.gradients import refuse_recomputation
from ingest.uses.ops import CONCATENATIONS, ELEMENTWISE, bind_arguments, op_name
from ingest.uses.recurrent import SEQUENCES, RecurrentCall, is_packed, read_call
from ingest.uses.rules import SEQUENCE_FIRST_HINT, UseOwner, UseRules

log = logging.getLogger(__name__)


class ParameterUses(UseRules, TorchFunctionMode):
    """The op-level capture (see :mod:`ingest.uses`) of ``hooks``' parameters while a captured forward runs.

    ``hooks``: the layer hooks of the op-level slots and of the hooked slots (whose own forward is theirs: a use
    of a hooked slot's parameter outside its module is captured here too). ``names``: every trainable parameter's
    name, by id (for reports). ``outside``: the names of hooked parameters used outside their modules.
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
            if hook.bias is not None:  # a module's bias is a use of its slot too (x @ W.T + b, HF's FalconLinear)
                self.slots.setdefault(id(hook.bias), []).append(hook)
        # weights and biases whose row blocks (a packed projection split in parts) are uses of their slot
        self.row_owners = {
            id(p): p
            for hook in hooks
            if hook.index is None and (hook.slot.kind in ("linear", "attention") or hook.parameter.dim() == 1)
            for p in (hook.parameter, hook.bias)
            if p is not None
        }
        self.hooked = hooked  # ids of the modules whose hooks capture their own forward
        # running hooked modules, their inputs and their own parameters' ids
        self.scope: list[tuple[nn.Module, Any, frozenset[int]]] = []
        self.sequence_first = False
        self.outside: set[str] = set()
        # hooked modules run on a single row (position ids [1, T]), by id: True where their output only meets the
        # batch in a broadcasting elementwise op, so the hook may expand it over the batch (exact, cheap); False
        # where something else takes it (.repeat(B), a concatenation, in-place ops): this capture follows it
        self.broadcasts: dict[int, bool] = {}

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
        if func is torch.Tensor.__iter__ and args and batch_dim(args[0]) is not None:  # q, k, v = qkv: unbind(0)
            return iter(self.__torch_function__(torch.Tensor.unbind, types, (args[0], 0), {}))
        if func is torch.Tensor.__getitem__ and args and self._is_stacked(args[0]):
            return self._slice(args)
        operands = list(tensors_in(args)) + list(tensors_in(kwargs.values()))
        if getattr(func, "__name__", "") in ("type_as", "to") and args and batch_dim(args[0]) is None:
            operands = operands[:1]  # w.type_as(x), w.to(x): x gives a dtype and device, not a use of w with x
        first = batch_operand(operands)
        batched = first is not None
        if not batched and func in (torch.Tensor.expand, torch.Tensor.expand_as) and hasattr(args[0], BROADCAST_HOOK):
            expanded = _over_the_batch(func(*args, **kwargs), args[0], batch)
            if expanded is not None:
                return expanded
        sources = self._sources(operands)
        own = self._own_forward(sources, operands) if sources else False
        owns = _hook_owns(own, batch.size) if own is not False else False
        single = self.scope[-1][0] if owns == "single" else None  # a hooked module on one row: where does it go?
        if single is not None and (self.broadcasts.get(id(single)) or not all(p.requires_grad for p in sources)):
            # seen: its output only meets the batch by broadcasting, the hook's expansion is exact; or a frozen
            # layer kept on purpose (include_frozen), which only the hook differentiates (by its output)
            owns, single = True, None
        if own is not False and owns is True:
            sources = []  # a hooked module's own op on a batch-first input: its hook captures this use
        if batched and single is None and self.broadcasts:  # only once a one-row output is being watched
            self._learn_broadcasts(func, operands, first)
        if sources:
            result = self._use(func, args, kwargs, batch, batched, sources)
            if own is not False and isinstance(result, torch.Tensor):
                setattr(result, TAKEN, True)
                hook = None if single is None else self._hook_of(single, sources)
                if hook is not None:  # a one-row output followed, watched to where it meets the batch
                    setattr(result, BROADCAST, id(single))
                    setattr(result, BROADCAST_HOOK, (hook, own.detach()))
                    self.broadcasts.setdefault(id(single), True)
                else:
                    self.outside.update(self._names(sources))
        else:
            result = func(*args, **kwargs)
        if first is None and operands and id(operands[0]) in self.row_owners:
            _mark_rows(operands[0], result)
        try:
            self._mark_result(func, args, kwargs, result, first, sources, batch.size)
        except Exception as error:  # an op this bookkeeping does not know: its outputs' examples are unknown
            log.debug("op-level capture: no batch bookkeeping for %s: %r", op_name(func), error)
            for out in tensors_in([result]):
                with contextlib.suppress(Exception):
                    setattr(out, BATCHED, -1 if first is not None else None)
        return result

    def _hook_of(self, module: nn.Module, sources: list[torch.Tensor]) -> LayerHook | None:
        """The hook of ``module``'s slot among ``sources``' slots."""
        return next((h for p in sources for h in self.slots.get(id(p), ()) if h.module is module), None)

    def _learn_broadcasts(self, func: Any, operands: list[torch.Tensor], first: torch.Tensor) -> None:
        """A batch op taking outputs of hooked modules run on one row: safe to expand over the batch when it is a
        broadcasting elementwise op whose batch dim meets their single row, else not."""
        for t in operands:
            module = getattr(t, BROADCAST, None)
            if module is None:
                continue
            dim = batch_dim(first)
            aligned = dim is not None and dim >= 0 and first.dim() >= t.dim()
            lead = dim - (first.dim() - t.dim()) if aligned else -1
            broadcast = func in ELEMENTWISE and (lead < 0 or t.shape[lead] == 1) and aligned
            self.broadcasts[module] = self.broadcasts.get(module, True) and broadcast

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
        if first is not None and mark_packing(func, args, kwargs, result, size):
            return
        if first is not None and func is F.embedding_bag and getattr(first, OWNER, None) is not None:
            # flat ids bagged: one row per example where the bags are the batch's (ingest.bags), else unknown
            bound = bind_arguments(F.embedding_bag, args, kwargs)
            bags = self.owner.batch.bags if self.owner.batch is not None else None
            rows = bags is not None and first is bound.get("input") and bags.matches(first, bound.get("offsets"))
            for out in tensors_in([result]):
                setattr(out, BATCHED, 0 if rows else -1)
                setattr(out, OWNER, None)
            return
        if first is not None and func in SEQUENCES:  # (output, states...): the states are [layers, B, H]
            owner = getattr(first, OWNER, None)
            packed = is_packed(args) and owner is not None and batch_dim(first) == 0
            sequence = not is_packed(args) and owner is None
            if sequence and size > 1 and first is args[0] and _along_examples(func, args, kwargs, first):
                sequence = False  # a sequence-first layer fed [B, T, ...]: it recurs along the examples
                self.owner.mixed(
                    "recurrence along the examples",
                    f"{op_name(func)} recurs along dim {batch_dim(first)} of its input, where the examples are "
                    f"({SEQUENCE_FIRST_HINT}, or pass batch_first=True): each example's state carries the others'",
                )
            for i, out in enumerate(tensors_in([result])):
                if packed and i == 0:  # the packed output's rows are the input's
                    setattr(out, BATCHED, 0)
                    setattr(out, OWNER, owner)
                    continue
                if packed:  # the final states, in the packed sequence's sorted order
                    set_order(out, 1, owner[:size], size)
                    continue
                setattr(out, BATCHED, (batch_dim(first) if i == 0 else 1) if sequence else -1)
                setattr(out, OWNER, None)
        elif first is not None:
            dim, owner = batch_dim(first), getattr(first, OWNER, None)
            # entries move or combine along a dim of the op's input only (a batch of ids indexing a table does not)
            taken = first is (args[0] if args else kwargs.get("input"))
            pooled = (
                size > 1
                and taken
                and (
                    pools_examples(func, args, kwargs, dim, first.dim())
                    if owner is None
                    else pools_owned_rows(func, args, kwargs, owner, dim, first.dim())
                )
            )
            if pooled and func is F.batch_norm and first is getattr(self.owner, "statistics_input", None):
                pooled = False  # a BatchNorm module's: reported by its own pre-hook, rows taken as shares after it
            crossed = False  # a product of batch operands whose examples land apart (x @ x.T) or are summed over
            lost = False  # ... or whose examples' dim is not followed in one of them (what it does is not known)
            for out in tensors_in([result]):  # an in-place op returns (and so marks) its first operand
                new, new_owner = result_batch(func, args, kwargs, first, dim, owner, out, size)
                setattr(out, BATCHED, new)
                setattr(out, OWNER, new_owner)
                lands = landings(func, args, out) if size > 1 and owner is None else None
                crossing, unknown = _crossing(lands)
                crossed, lost = crossed or crossing, lost or unknown
                inherited = getattr(first, POOLED, False)
                if pooled or (new < 0 and (inherited or crossing or unknown)):
                    setattr(out, POOLED, True if pooled or crossing or inherited is True else LOST)
            operands = list(tensors_in([*args, *kwargs.values()]))
            marks = {getattr(t, POOLED, False) for t in operands if t.requires_grad}
            mixing = crossed or bool(marks - {False})
            unfollowed = not crossed and True not in marks and (lost or LOST in marks)
            outs = list(tensors_in([result]))
            side_by_side = func in CONCATENATIONS and _beside(func, args, kwargs, first)
            side_by_side = side_by_side and assembled_examples(func, args, kwargs) is None  # a loop's results
            if (func in ELEMENTWISE or side_by_side) and size > 1 and _misaligned(operands, size):
                mixing = True  # reported below; the result's rows taken as the batch's in order (shares) after it
                in_order = [t for t in operands if batch_dim(t) is not None and batch_dim(t) >= 0]
                if any(getattr(t, OWNER, None) is None for t in in_order):
                    for out in outs:
                        setattr(out, OWNER, None)
            if pooled and first.requires_grad:  # one entry per example, each computed across them (a softmax)
                for out in outs:
                    if out.shape == first.shape:
                        setattr(out, ACROSS, True)
            elif any(getattr(t, ACROSS, False) for t in operands) and not self._sources(operands):  # to the output
                for out in outs:
                    setattr(out, ACROSS, True)
            if mixing and unfollowed and any((batch_dim(t) if batch_dim(t) is not None else -1) >= 0 for t in outs):
                self.owner.mixed(
                    "ops not followed",
                    f"the examples' rows are not followed through an op before {op_name(func)} (a view or op the "
                    "capture does not track): each row may hold other examples' shares of the batch gradient",
                )
            elif mixing and any((batch_dim(t) if batch_dim(t) is not None else -1) >= 0 for t in outs):
                self.owner.mixed(
                    "ops across the examples",
                    f"the forward combines each example with a tensor computed across the examples ({op_name(func)} "
                    "with a mean or sum over the batch, a softmax along it): each row is the example's share of the "
                    "batch gradient, not the gradient of its own loss",
                )
        elif sources:
            single = {getattr(t, BROADCAST) for t in tensors_in([*args, *kwargs.values()]) if hasattr(t, BROADCAST)}
            for out in tensors_in([result]):
                if id(out) not in self.slots:  # a no-op cast (param.to(its dtype)) returns the parameter itself
                    setattr(out, SOURCES, tuple({id(p): p for p in sources}.values()))
                for module in single:  # still one row: watched on; else (.repeat(B), ...) not a broadcast
                    if out.dim() > 0 and out.shape[0] == 1:
                        setattr(out, BROADCAST, module)
                    else:
                        self.broadcasts[module] = False

    def _without_grad(self, func: Any, args: tuple, kwargs: dict, batch: ActiveBatch) -> Any:
        operands = list(tensors_in(args)) + list(tensors_in(kwargs.values()))
        first = batch_operand(operands)
        used = [p for p in self._sources(operands) if p.requires_grad]  # also through w.t() and the like
        own = self._own_forward(used, operands) if used else False
        if own is not False and _hook_owns(own, batch.size):
            used = []  # a hooked module's own op inside a custom Function of its forward: its hook captures it
        if used and first is not None:  # a custom autograd.Function's forward, reentrant checkpointing's forward
            how = f"{op_name(func)} under torch.no_grad (inside a custom autograd.Function, or reentrant checkpointing)"
            self.owner.uncovered(self._names(used), how)
        result = func(*args, **kwargs)
        with contextlib.suppress(Exception):
            self._mark_result(func, args, kwargs, result, first, used, batch.size)
        return result

    def _recomputed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op run inside a backward: a reentrant gradient-checkpointing recomputation. A use of a captured
        parameter there would be backpropagated in a nested backward the capture does not see: refused, as the
        hooks refuse it (:class:`~ingest.hooks.RecomputationError`), when that output is backpropagated."""
        result = func(*args, **kwargs)
        operands = list(tensors_in(args)) + list(tensors_in(kwargs.values()))
        if isinstance(result, torch.Tensor) and result.requires_grad and any(id(t) in self.slots for t in operands):
            name = sorted(self._names([t for t in operands if id(t) in self.slots]))[0]
            on_gradient(result, functools.partial(refuse_recomputation, name))
        return result

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

    def _own_forward(self, sources: list[torch.Tensor], operands: list[torch.Tensor]) -> Any:
        """The module's input when this op is a hooked module's own op on its own parameters, else False. The
        parameters must be the op's operands themselves: a weight computed from them (the legacy
        ``torch.nn.utils.weight_norm`` sets ``weight = g * v / |v|`` before each forward) is not what the hook
        differentiates by, so such a use is the op-level capture's (which reports it when no rule splits it).
        Parameters that are not the module's may come in through its input (a position table projected)."""
        if not self.scope:
            return False
        _, x, own = self.scope[-1]
        direct = {id(t) for t in operands}
        through_x = {id(p) for p in getattr(x, SOURCES, ())} | {id(x)}
        mine = [p for p in sources if id(p) in own]
        if not mine or not all(id(p) in direct for p in mine):
            return False
        return x if all(id(p) in own or id(p) in through_x for p in sources) else False


def _over_the_batch(result: torch.Tensor, single: torch.Tensor, batch: ActiveBatch) -> torch.Tensor | None:
    """``single`` (a hooked module's one-row output) expanded over the batch by the model or a hook (online
    selection's): the module's hook takes the examples' output gradients there, as its own expansion would."""
    if result.dim() != single.dim() or single.shape[0] != 1 or result.shape[0] != batch.size:
        return None
    hook, x = getattr(single, BROADCAST_HOOK)
    route, saved = hook._save(x.expand(batch.size, *x.shape[1:]), batch.size)
    on_gradient(result, functools.partial(hook._backward, batch.generation, route, saved))
    setattr(result, BATCHED, 0)
    return result


def _mark_rows(param: torch.Tensor, result: Any) -> None:
    """Mark the pieces of ``result`` that are row blocks ``param[start:stop]`` with :data:`ROWS`."""
    for piece in tensors_in([result]):
        block = row_block(piece, param)
        if block is not None and piece is not param:
            setattr(piece, ROWS, (param, *block))


#: :data:`POOLED`'s mark on a tensor computed from a product with an operand whose examples' dim was not followed:
#: it may combine the examples, or not (what the op did is not known).
LOST = "lost"


def _crossing(lands: list[int | None] | None) -> tuple[bool, bool]:
    """``(crossing, unknown)`` of a product's operands' landings (:func:`landings`): the examples of operands
    whose examples' dim is known land apart or are summed over; an operand's examples' dim is not known."""
    known = [at for at in lands or () if at is not None]
    return len(set(known)) > 1 or any(at < 0 for at in known), len(known) < len(lands or ())


def _along_examples(func: Any, args: tuple, kwargs: dict, x: torch.Tensor) -> bool:
    """Whether a fused recurrent layer's time dim is its input ``x``'s examples' dim."""
    call = read_call(func, args, kwargs)
    if not isinstance(call, RecurrentCall) or call.sizes is not None:
        return False
    dim = batch_dim(x)
    return dim is not None and dim >= 0 and dim == 1 - call.examples_dim


def _beside(func: Any, args: tuple, kwargs: dict, first: torch.Tensor) -> bool:
    """Whether a concatenation puts its operands side by side along another dim than the examples' (``stack``
    always does): each result row then combines the operands' rows at one position."""
    if func is torch.stack:
        return True
    along = bind_arguments(func, args, kwargs).get("dim", 0)
    dim = batch_dim(first)
    return dim is not None and dim >= 0 and isinstance(along, int) and along % max(first.dim(), 1) != dim


def _misaligned(operands: list[torch.Tensor], size: int) -> bool:
    """Whether batch operands of one elementwise op hold their examples' rows in different orders (``h + h[perm]``:
    manifold mixup), so each result row combines examples: rows chosen along the examples (:data:`OWNER`)
    against each other or against the batch in order."""
    orders = [getattr(t, OWNER, None) for t in operands if (batch_dim(t) if batch_dim(t) is not None else -1) >= 0]
    if len(orders) < 2 or all(order is None for order in orders):
        return False
    first = orders[0] if orders[0] is not None else torch.arange(size)
    for order in orders[1:]:
        order = order if order is not None else torch.arange(size)
        if order is not first and (order.shape != first.shape or not torch.equal(order.cpu(), first.cpu())):
            return True
    return False


def _hook_owns(x: Any, size: int) -> bool | str:
    """Whether a hooked module's hook captures its forward on input ``x`` exactly: a batch-first input (True), or
    ``"single"``: one row that the hook broadcasts over the batch (position ids ``[1, T]``) where the model only
    broadcasts its output (:attr:`ParameterUses.broadcasts`)."""
    if not isinstance(x, torch.Tensor):
        return False
    dim = batch_dim(x)
    if getattr(x, OWNER, None) is not None:
        return False  # rows that mix the examples (tokens flattened across the batch): captured at the op
    if dim is None and (hasattr(x, SOURCES) or isinstance(x, nn.Parameter)):
        # computed from parameters alone (a relative-position table projected): followed to where it meets the
        # batch; expanding the module's output over the batch would change its shape under the model's feet
        return False
    if dim == 0 or (dim is None and x.dim() > 0 and size == 1 and x.shape[0] == 1):
        return True  # batch-first, or one row of a one-example batch (a [T, d] input is a table: followed)
    return "single" if dim is None and x.dim() > 0 and x.shape[0] == 1 else False
