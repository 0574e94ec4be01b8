"""The op-level capture's rule for each use of a captured parameter (:mod:`ingest.uses`): which op it is, which
slot it feeds, and the output-gradient hook that forms its per-example gradient (see :mod:`ingest.uses.gradients`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ingest.hooks import ActiveBatch, LayerHook
from ingest.output_hooks import on_gradient
from ingest.uses.batch_tracking import (
    BATCHED,
    BATCHED_MATMULS,
    BROADCAST_HOOK,
    GATHER,
    OWNER,
    ROWS,
    SLICE,
    SOURCES,
    batch_dim,
    irregular_rows,
    tensors_in,
)
from ingest.uses.copies import (
    conv_with_copies,
    einsum_with_copies,
    linear_with_copies,
    over_the_batch,
    product_with_copies,
)
from ingest.uses.gradients import (
    bag_backward,
    bag_max_backward,
    bias_backward,
    channels_last,
    conv_patches,
    first_hook,
    gathered_backward,
    grouped_conv_backward,
    grouped_mm_backward,
    hook_backward,
    lookup_backward,
    matmul_backward,
    meeting_backward,
    normalization_backward,
    rows_backward,
    slope_backward,
    table_backward,
    transposed_conv_backward,
    widen_rows,
)
from ingest.uses.ops import (
    CHANNEL_NORMALIZATIONS,
    CONCATENATIONS,
    CONVOLUTIONS,
    ELEMENTWISE,
    GROUPED_MM,
    LOOKUPS,
    MATMULS,
    NORMALIZATIONS,
    TRANSPOSED_CONVOLUTIONS,
    bind_arguments,
    in_place,
    op_name,
)
from ingest.uses.recurrent import (
    CELLS,
    SEQUENCES,
    RecurrentCall,
    read_call,
    recurrent_backward,
    separate_outputs,
)

log = logging.getLogger(__name__)

#: Ops whose rules read the example of each row of a batch operand (:data:`~ingest.uses.batch_tracking.OWNER`).
ROWS_RULES = frozenset([F.linear, F.embedding_bag, *BATCHED_MATMULS, *GROUPED_MM, *SEQUENCES, *CELLS])
ROWS_RULES |= ELEMENTWISE | CONCATENATIONS

#: The kinds of slot whose parameters take a meeting's per-example gradient whole (:meth:`UseRules._meeting`).
MEETING_KINDS = ("embedding", "parameter", "norm", "linear", "attention", "conv", "conv1d")

#: Said where an op of a sequence-first layer finds the examples along its sequence dim.
SEQUENCE_FIRST_HINT = (
    "a sequence-first model input ([T, B, ...]) is read batch-first unless the capture is given example_dim=1"
)


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
    #: the input a BatchNorm module normalises by the batch's statistics now (its own pre-hook reported it)
    statistics_input: torch.Tensor | None

    def uncovered(self, names: Iterable[str], how: str) -> None: ...

    def mixed(self, where: str, how: str) -> None: ...


class UseRules:
    """The rule of each captured use, by op (``F.linear``, ``F.embedding``, ``convNd``, the grouped and gathered
    matmuls of MoE experts, ``F.layer_norm``/``F.rms_norm``, ``F.multi_head_attention_forward``, elementwise ops
    and concatenations where a parameter-only tensor meets the batch): the half of
    :class:`~ingest.uses.mode.ParameterUses` that forms a use's per-example gradient. It reads the mode's state
    (``owner``, ``slots``, ``hooked``, ``names``, ``left_out``, ``sequence_first``, ``outside``, ``scope``)."""

    owner: UseOwner
    slots: dict[int, list[LayerHook]]
    hooked: set[int]
    names: dict[int, str]
    left_out: dict[int, Any]
    sequence_first: bool
    outside: set[str]
    scope: list[tuple[Any, Any, frozenset[int]]]  # running hooked modules: (module, input, own parameter ids)

    def _sources(self, operands: list[torch.Tensor]) -> list[torch.Tensor]:
        """The captured parameters among ``operands`` or behind their parameter-only inputs."""
        found: dict[int, torch.Tensor] = {}
        for t in operands:
            if id(t) in self.slots:
                found[id(t)] = t
            found.update((id(p), p) for p in getattr(t, SOURCES, ()))
            for mark in (SLICE, GATHER):
                if hasattr(t, mark):
                    found.setdefault(id(getattr(t, mark)[0]), getattr(t, mark)[0])
        return list(found.values())

    def _use(
        self,
        func: Any,
        args: tuple,
        kwargs: dict,
        batch: ActiveBatch,
        batched: bool,
        sources: list[torch.Tensor],
    ) -> Any:
        if not batched and (func in SEQUENCES or func in CELLS):  # a recurrent layer on no input of the batch's
            how = "on an input not recognised as the batch's (a sequence packed before the captured forward?)"
            self.owner.uncovered(self._names(sources), f"{op_name(func).rpartition('.')[2]} {how}")
            return func(*args, **kwargs)
        if not batched:
            return func(*args, **kwargs)  # parameters among themselves: followed until they meet the batch
        if self.left_out.get(id(args[1] if len(args) > 1 else None)) is func:
            return func(*args, **kwargs)  # a left-out layer's own op on a weight it shares (a tied lm_head)
        self.outside.update(self._names([p for p in sources if self._is_hooked(p)]))
        operands = [*tensors_in(args), *tensors_in(kwargs.values())]
        grouped = op_name(func).endswith("grouped_mm_fallback")
        if func not in ROWS_RULES and not grouped and any(irregular_rows(t, batch.size) for t in operands):
            # rows of the examples in an order of their own: only the rules that read each row's example split it
            self.owner.uncovered(self._names(self._missed(sources)), f"{op_name(func)} on rows of mixed examples")
            return func(*args, **kwargs)
        try:
            if func is F.linear:
                result = self._linear(batch, *args, **kwargs)
            elif func is F.embedding:
                result = self._embedding(batch, args, kwargs)
            elif func in CONVOLUTIONS:
                result = self._convolution(batch, func, args, kwargs)
            elif func in TRANSPOSED_CONVOLUTIONS:
                result = self._transposed_convolution(batch, func, args, kwargs)
            elif func is F.bilinear:
                result = self._bilinear(batch, *args, **kwargs)
            elif func in GROUPED_MM or op_name(func).endswith("grouped_mm_fallback"):
                result = self._grouped(batch, func, args, kwargs)
            elif func in BATCHED_MATMULS and not kwargs:
                result = self._gathered(batch, *args)
            elif func in MATMULS and not kwargs and len(args) == 2:
                result = self._matmul(batch, *args)
            elif func in NORMALIZATIONS:
                result = self._normalization(batch, func, args, kwargs)
            elif func in (torch.addmm, torch.Tensor.addmm):
                result = self._addmm(batch, args, kwargs)
            elif func is torch.prelu and not kwargs and len(args) == 2:
                result = self._prelu(batch, *args)
            elif func is F.embedding_bag:
                result = self._bag_lookup(batch, args, kwargs)
            elif func in LOOKUPS:
                result = self._index_lookup(batch, func, args, kwargs)
            elif func in CHANNEL_NORMALIZATIONS:
                result = self._channel_normalization(batch, func, args, kwargs)
            elif func is F.scaled_dot_product_attention:
                result = self._attention_operands(batch, args, kwargs)
            elif op_name(func).endswith("__setitem__") and not kwargs:
                result = self._assign(batch, args)
            elif func in (torch.gather, torch.Tensor.gather):
                result = self._gather(batch, args, kwargs)
            elif func in ELEMENTWISE or func in CONCATENATIONS:
                result = self._meet(batch, func, args, kwargs)
            elif func in SEQUENCES or func in CELLS:
                result = self._recurrent(batch, func, args, kwargs, sources)
            else:
                result = None
            if result is None and not self.sequence_first:
                result = self._with_copies(batch, func, args, kwargs)
        except Exception as error:  # a rule that does not fit this call: the use is reported, training goes on
            log.warning(
                "op-level capture: %s on %s failed (%r); reported as not captured",
                op_name(func),
                self._names(sources),
                error,
            )
            result = None
        if result is None:
            self.owner.uncovered(self._names(self._missed(sources)), op_name(func))
            return func(*args, **kwargs)
        return result

    def _with_copies(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """A product no other rule splits, over per-example copies of its parameter operand (:mod:`ingest.uses.copies`:
        ``einsum``, ``bmm``/``matmul`` with a weight broadcast over the examples, ``F.linear``, ``convNd`` and
        ``conv_transposeNd`` with a computed or bare weight); None for any other op."""
        copy = functools.partial(self._copy, batch)
        if op_name(func).rpartition(".")[2] == "einsum" and not kwargs:
            return einsum_with_copies(args, copy)
        if (func in MATMULS or func in BATCHED_MATMULS) and not kwargs:
            return product_with_copies(func, args, batch.size, copy)
        if func is F.linear:
            bound = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            return linear_with_copies(bound["input"], bound["weight"], bound.get("bias"), batch.size, copy)
        if func in CONVOLUTIONS or func in TRANSPOSED_CONVOLUTIONS:
            bound = bind_arguments(func, args, kwargs)
            return conv_with_copies(func, bound, batch.size, copy, func in TRANSPOSED_CONVOLUTIONS)
        return None

    def _copy(
        self,
        batch: ActiveBatch,
        t: torch.Tensor,
        aligned: torch.Tensor,
        shape: torch.Size,
        at: int,
        owner: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Per-example copies of the parameter operand ``t`` (``aligned``: ``t`` with a dim of size 1 at ``at``),
        expanded to ``shape`` and hooked as a meeting (``owner``: copies per row of the examples, summed per
        example); ``t`` itself where it carries no captured parameter; None where a parameter has no slot that
        takes a whole copy's gradient, or the capture is per position."""
        params = self._sources([t])
        if not params or not t.requires_grad:
            return t
        targets = self._meeting_targets(params, MEETING_KINDS)
        if targets is None or any(first_hook(h).PER_POSITION for h in targets):
            return None
        return self._meeting(batch, aligned, params, shape, at, owner)

    def _missed(self, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters a use no rule splits leaves out: ``sources`` but a hooked module's own bias inside its
        forward (its hook still takes that op's output gradient, the bias's column exact)."""
        own = self.scope[-1][2] if self.scope else frozenset()
        return [p for p in sources if id(p) not in own or not any(h.bias is p for h in self.slots.get(id(p), ()))]

    def _is_hooked(self, param: torch.Tensor) -> bool:
        return any(id(h.module) in self.hooked for h in self.slots.get(id(param), ()))

    def _names(self, sources: list[torch.Tensor]) -> list[str]:
        """The names of ``sources`` and of their slots' biases (a slot one of whose uses is missed is partial)."""
        biases = [h.bias for p in sources for h in self.slots.get(id(p), ()) if h.bias is not None]
        return sorted({self.names.get(id(p), "<tensor>") for p in [*sources, *biases]})

    def _slot(self, weight: Any, kinds: tuple[str, ...]) -> LayerHook | None:
        if hasattr(weight, SLICE):  # a slice of a stacked parameter: its own slot
            param, index = getattr(weight, SLICE)
            return next((h for h in self.slots.get(id(param), ()) if h.index == index), None)
        for hook in self.slots.get(id(weight), ()):
            if hook.slot.kind in kinds and hook.index is None:
                return hook
        return None

    def _linear(self, batch: ActiveBatch, x: Any, weight: Any, bias: Any = None) -> Any:
        """``F.linear`` with a slot's weight, or with a block of its rows (``weight = param[start:stop]``, the
        bias the same rows of the slot's bias): that use's output gradient is the slot's, zero in the other rows."""
        rows = getattr(weight, ROWS, None)
        if rows is None and self._slot(weight, ("linear", "attention", "parameter")) is None:
            # F.linear(x, W, b) is x @ W.T + b: W = P.T (a tied autoencoder's decoder) or an embedding's table (an
            # output layer tied to it) by the matrix-product rule, b by its own slot
            param, transposed = self._matrix_parameter(weight)
            if param is not None and (transposed or self._slot(param, ("embedding",)) is not None):
                if not transposed:
                    param = param.t()
                    setattr(param, SOURCES, (weight,))
                return self._product_and_bias(batch, x, param, bias)
        hook = self._slot(weight if rows is None else rows[0], ("linear", "attention", "parameter"))
        if batch_dim(x) is None or (hook is None and self._sources([weight])):
            return None
        own = hook is not None and bias is not None
        own = own and (bias if rows is None else _rows_of(bias, hook.bias, rows)) is hook.bias
        if hook is not None and hook.slot.has_bias and not own:
            return None
        apart = None if bias is None or own or not self._sources([bias]) else self._bias_slot(bias)
        if (bias is not None and not own and self._sources([bias]) and apart is None) or (hook or apart) is None:
            return None
        owner = getattr(x, OWNER, None)
        if owner is not None and not self.sequence_first and irregular_rows(x, batch.size):  # rows of examples
            if hook is None or apart is not None or batch_dim(x) != 0 or x.dim() < 2:
                return None
            flatten = None if x.dim() == 2 else _flat_rows
            widen = flatten if rows is None else widen_rows(rows[1], rows[2], hook.slot.d_out, flatten)
            out = F.linear(x, weight, bias)
            flat = x.detach().reshape(-1, x.shape[-1])  # [R, ..., d] (Swin's windows): each row's positions its own
            flat_owner = owner.repeat_interleave(flat.shape[0] // max(owner.numel(), 1))
            on_gradient(out, functools.partial(rows_backward, hook, batch.generation, flat, flat_owner, widen))
            return out
        layout = self._layout(x, batch.size)
        if layout is None:
            return None
        out = F.linear(x, weight, bias)
        if hook is not None:
            route, saved = hook._save(layout(x.detach()), batch.size)
            out_layout = layout if rows is None else widen_rows(rows[1], rows[2], hook.slot.d_out, layout)
            on_gradient(out, functools.partial(hook_backward, hook, batch.generation, route, saved, out_layout))
        if apart is not None:
            self._hook_bias(out, apart, batch, layout)
        return out

    def _addmm(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        """``torch.addmm(b, x, M)`` (``beta = alpha = 1``): ``x @ M`` by the matrix-product rule, ``b`` by its own
        slot (a bare ``b`` and ``M`` written out as a layer)."""
        if kwargs or len(args) != 3 or batch_dim(args[2]) is not None:
            return None
        return self._product_and_bias(batch, args[1], args[2], args[0])

    def _product_and_bias(self, batch: ActiveBatch, x: Any, matrix: torch.Tensor, bias: Any) -> Any:
        """``x @ matrix + bias``, each captured use split by its rule (None when one cannot be)."""
        apart = None if bias is None else self._bias_slot(bias)
        layout = self._layout(x, batch.size) if isinstance(x, torch.Tensor) else None
        if layout is None or (bias is not None and self._sources([bias]) and apart is None):
            return None
        if not self._sources([matrix]):
            return None
        out = self._matmul(batch, x, matrix)
        if out is None or bias is None:
            return out
        out = out + bias
        if apart is not None:
            self._hook_bias(out, apart, batch, layout)
        return out

    def _prelu(self, batch: ActiveBatch, x: Any, weight: Any) -> Any:
        """``F.prelu`` with a captured slope (``nn.PReLU``): per example, the slope's gradient sums ``dy *
        min(x, 0)`` over the example's positions, channel by channel (dim 1; one slope: over everything)."""
        hook = self._slot(weight, ("parameter",))
        if hook is None or hook.PER_POSITION or batch_dim(x) != 0 or weight.dim() != 1 or self.sequence_first:
            return None
        if getattr(x, OWNER, None) is not None:
            return None  # rows of the examples: each row's slopes are not summed per example here
        out = torch.prelu(x, weight)
        channels = weight.shape[0] if x.dim() > 1 else 1
        if channels > 1 and x.shape[1] != channels:
            return None
        negative = x.detach().clamp(max=0)
        on_gradient(out, functools.partial(slope_backward, hook, weight, batch.generation, negative, channels))
        return out

    def _matmul(self, batch: ActiveBatch, a: Any, b: Any) -> Any:
        """``x @ M`` or ``M @ x`` with ``M`` a captured 2-D parameter ``P`` or its transpose ``P.T`` (or a 1-D one:
        :meth:`_vector_product`) and ``x`` the batch's (its examples along a dim the product keeps). Each example's
        gradient of ``P`` sums the outer products of its rows (``x @ M``) or columns (``M @ x``) with their output
        gradients."""
        x_first = batch_dim(b) is None
        x, matrix = (a, b) if x_first else (b, a)
        dim = batch_dim(x)
        if dim is None or dim < 0 or batch_dim(matrix) is not None or matrix.dim() not in (1, 2) or self.sequence_first:
            return None
        if dim >= x.dim() - (1 if x_first else 2):
            return None  # the examples lie along a dim the product contracts or mixes
        if matrix.dim() == 1:
            return self._vector_product(batch, a, b, x, matrix, x_first, dim)
        param, transposed = self._matrix_parameter(matrix)
        hook = None if param is None else self._slot(param, ("linear", "attention", "parameter", "embedding"))
        if hook is None or hook.PER_POSITION or param.dim() != 2:
            return None
        out = torch.matmul(a, b)
        size, rows = batch.size, x.detach().movedim(dim, 0)
        if not x_first:  # M @ x: the columns of x are its rows
            rows = rows.transpose(-1, -2)
        rows = rows.reshape(size, -1, rows.shape[-1])
        owner = torch.arange(size, device=x.device).repeat_interleave(rows.shape[1])
        # whether the slot's rows (P's dim 0; an embedding's slot is P.T) are the output gradient's
        side = (x_first == transposed) != (hook.slot.kind == "embedding")
        rows = rows.flatten(0, 1)
        on_gradient(out, functools.partial(matmul_backward, hook, batch.generation, rows, owner, dim, x_first, side))
        return out

    def _vector_product(
        self, batch: ActiveBatch, a: Any, b: Any, x: torch.Tensor, vector: torch.Tensor, x_first: bool, dim: int
    ) -> Any:
        """``x @ q`` or ``q @ x`` with ``q`` a captured 1-D parameter (attention pooling's query vector, a scoring
        vector): the product rule of the ``[1, d]`` matrix ``q`` is as a slot, each example's gradient the sum of
        its rows (columns) of ``x`` times their output gradients."""
        hook = self._slot(vector, ("parameter",)) if id(vector) in self.slots else None
        if hook is None or hook.PER_POSITION or (hook.slot.d_out, hook.slot.d_in) != (1, vector.shape[0]):
            return None
        out = torch.matmul(a, b)
        rows = x.detach().movedim(dim, 0)
        if not x_first:  # q @ x: the columns of x are its rows
            rows = rows.transpose(-1, -2)
        rows = rows.reshape(batch.size, -1, rows.shape[-1])
        owner = torch.arange(batch.size, device=x.device).repeat_interleave(rows.shape[1])
        backward = functools.partial(
            matmul_backward, hook, batch.generation, rows.flatten(0, 1), owner, dim, x_first, True
        )
        on_gradient(out, lambda dy: backward(dy.unsqueeze(-1 if x_first else -2)))  # the [.., 1] the matrix gives
        return out

    def _recurrent(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict, sources: list[torch.Tensor]) -> Any:
        """A fused recurrent op (``torch.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` or a ``*_cell``) on the batch
        with captured ``recurrent`` weights: run as it is; when its outputs' gradients arrive, the layer is
        recomputed step by step and each weight's rows go to its slot (:mod:`ingest.uses.recurrent`)."""
        call = read_call(func, args, kwargs)
        replaced: dict[int, torch.Tensor] = {}
        slots, covered = [], set()
        x = args[0]
        if isinstance(call, RecurrentCall) and call.sizes is None and batch_dim(x) is None and self._sources([x]):
            # an input computed from parameters alone over the batch (a decoder's first input, embed(SOS)):
            # every example's own rows, meeting the batch here
            params = self._sources([x])
            expanded = self._meeting(batch, x, params, None, call.examples_dim)
            if expanded is not None:
                replaced[id(x)] = expanded
                covered.update(id(p) for p in params)
        if (
            isinstance(call, RecurrentCall)
            and call.sizes is None
            and id(x) not in replaced
            and (batch_dim(x) != call.examples_dim or getattr(x, OWNER, None) is not None)
        ):
            along_time = batch_dim(x) == 0 and call.examples_dim == 1  # sequence-first, examples taken along T
            call = "on an input whose examples are not along its batch dim"
            call += f" (along its time dim: {SEQUENCE_FIRST_HINT})" if along_time else ""
        for w_ih, w_hh, b_ih, b_hh, w_hr in call.weights if isinstance(call, RecurrentCall) else ():
            found = []
            for weight, bias in ((w_ih, b_ih), (w_hh, b_hh), (w_hr, None)):
                hook = None if weight is None else self._slot(weight, ("recurrent",))
                covered.update((id(weight), id(bias)) if hook is not None and hook.bias is bias else ())
                found.append(hook)
            slots.append((found[0], found[1], found[2]))
        hx = (args[2] if call.sizes is not None else args[1]) if isinstance(call, RecurrentCall) else ()
        for t in hx if isinstance(hx, (list, tuple)) else (hx,):
            params = self._sources([t])  # a learned initial state: meets the batch here, like any operand
            if not params or batch_dim(t) is not None or id(t) in replaced:
                continue
            if call.sizes is not None:
                call = "on a packed sequence with an initial state computed from parameters (in its sorted order)"
                break
            expanded = self._meeting(batch, t, params, None, 0 if call.single_step else 1)
            if expanded is None:
                call = "with an initial state computed from parameters"
                break
            replaced[id(t)] = expanded
            covered.update(id(p) for p in params)
        if isinstance(call, RecurrentCall) and any(id(p) not in covered for p in sources):
            call = "with a captured parameter in another role than its weights or initial state"
        if isinstance(call, str):
            self.owner.uncovered(self._names(sources), f"{op_name(func).rpartition('.')[2]} {call}")
            return func(*args, **kwargs)
        outputs, result = separate_outputs(func(*_swap(args, replaced), **kwargs))
        needed = [i for i, out in enumerate(outputs) if out.requires_grad]
        if needed:
            saved = dataclasses.replace(
                call,
                input=call.input.detach(),
                states=tuple(t.detach() for t in call.states),
                weights=[tuple(None if w is None else w.detach() for w in ws) for ws in call.weights],
            )

            def arrived(grads: Sequence[torch.Tensor | None]) -> None:
                full: list[torch.Tensor | None] = [None] * len(outputs)
                for i, g in zip(needed, grads):
                    full[i] = g
                recurrent_backward(saved, slots, batch.generation, full)

            torch.autograd.graph.register_multi_grad_hook([outputs[i] for i in needed], arrived, mode="all")
        return result

    def _matrix_parameter(self, matrix: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """``(P, transposed)``: the captured 2-D parameter ``matrix`` is, or is the transpose of, else None."""
        if id(matrix) in self.slots:
            return matrix, False
        for param in self._sources([matrix]):
            if param.dim() != 2 or matrix.data_ptr() != param.data_ptr():
                continue
            if matrix.shape == param.shape and matrix.stride() == param.stride():
                return param, False
            if matrix.shape == param.shape[::-1] and matrix.stride() == param.stride()[::-1]:
                return param, True
        return None, False

    def _bias_slot(self, bias: torch.Tensor) -> tuple[LayerHook, int, int] | None:
        """``(slot, start, stop)`` of a bias that is a 1-D captured parameter of its own or a block of its rows
        (MultiheadAttention with ``kdim``/``vdim`` chunks its packed ``in_proj_bias`` over three weights)."""
        block = getattr(bias, ROWS, None)
        param, start, stop = block if block is not None else (bias, 0, bias.shape[0] if bias.dim() == 1 else 0)
        hook = self._slot(param, ("parameter",))
        if hook is None or param.dim() != 1 or hook.PER_POSITION:
            return None
        return hook, start, stop

    def _layout(self, x: torch.Tensor, size: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """How to view ``x`` (and its output gradient) batch-first, or None when its batch cannot be found."""
        if self.sequence_first:
            if x.dim() < 2 or (x.shape[-2] != size if x.dim() >= 3 else x.shape[0] % size):
                return None
            return lambda t: t.reshape(-1, size, t.shape[-1]).transpose(0, 1)
        dim = batch_dim(x)
        if dim is None or dim < 0 or x.dim() < 2:
            return None
        if getattr(x, OWNER, None) is not None:  # rows of the examples: in order, k per example (windows, tokens)
            return None if irregular_rows(x, size) else functools.partial(_rows_first, size=size)
        return (lambda t: t) if dim == 0 else (lambda t: t.movedim(dim, 0))

    def _embedding(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        bound = bind_arguments(F.embedding, args, kwargs)
        idx, weight = bound["input"], bound["weight"]
        hook = self._slot(weight, ("embedding",))
        dim = batch_dim(idx)
        if dim is None or dim < 0 or self.sequence_first or bound.get("max_norm") is not None:
            return None
        if bound.get("scale_grad_by_freq"):  # scaled by the counts over the whole batch: no per-example split
            return None
        if hook is None and id(weight) in self.slots:  # a bare [n, d] parameter as the table
            padding = bound.get("padding_idx")
            padding = None if padding is None else padding % weight.shape[0]
            return self._table_lookup(batch, F.embedding, args, kwargs, weight, idx, padding)
        if hook is None:
            return self._transposed_lookup(batch, args, kwargs, idx, weight, dim)
        out = F.embedding(*args, **kwargs)
        padding = bound.get("padding_idx")
        hook.padding_idx = None if padding is None else padding % hook.slot.d_in
        layout = None if dim == 0 else (lambda t: t.movedim(dim, 0))
        route, saved = hook._save(idx.detach() if layout is None else layout(idx.detach()), batch.size)
        on_gradient(out, functools.partial(hook_backward, hook, batch.generation, route, saved, layout))
        return out

    def _table_lookup(
        self,
        batch: ActiveBatch,
        func: Any,
        args: tuple,
        kwargs: dict,
        table: torch.Tensor,
        index: Any,
        padding_idx: int | None = None,
    ) -> Any:
        """A bare parameter used as a table of the batch's ids (``P[ids]``, ``P.index_select(0, ids)``,
        ``F.embedding(ids, P)``: a matrix factorisation's user and item tables, per-id biases): each example's
        gradient is its lookups' output gradients at the entries it read (:meth:`LayerHook.add_lookup`)."""
        hook = self._slot(table, ("parameter",))
        dim = batch_dim(index)
        if hook is None or hook.PER_POSITION or table.dim() not in (1, 2) or dim is None or dim < 0:
            return None
        if not isinstance(index, torch.Tensor) or index.is_floating_point() or index.dtype == torch.bool:
            return None
        out = func(*args, **kwargs)
        ids = index.detach().movedim(dim, 0).reshape(batch.size, -1)
        owner = torch.arange(batch.size, device=ids.device).repeat_interleave(ids.shape[1])
        entries = ids.reshape(-1) % table.shape[0]
        backward = table_backward, hook, batch.generation, entries, owner, dim, table.dim() == 2, padding_idx
        on_gradient(out, functools.partial(*backward))
        return out

    def _bag_lookup(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        """``F.embedding_bag`` of one bag per example (``nn.EmbeddingBag``): ``[B, L]`` bags, or the batch's packed
        bags (flat ids with offsets, :mod:`ingest.bags`), modes ``sum`` (with ``per_sample_weights``) and
        ``mean``: each bag's output gradient times each entry's weight in it (its sample weight, or 1 / the bag's
        entries other than ``padding_idx``) at the entries it read; ``max``: :meth:`_bag_maxima`. Flat ids with
        offsets other than the batch's are not split (reported)."""
        names = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse")
        names += ("per_sample_weights", "include_last_offset", "padding_idx")
        bound = {**dict(zip(names, args)), **kwargs}
        index, table, mode, offsets = bound["input"], bound["weight"], bound.get("mode", "mean"), bound.get("offsets")
        hook = self._slot(table, ("parameter",))
        if hook is None or hook.PER_POSITION or id(table) not in self.slots or table.dim() != 2:
            return None
        if mode not in ("sum", "mean", "max") or bound.get("max_norm") is not None or bound.get("scale_grad_by_freq"):
            return None
        if offsets is None and (index.dim() != 2 or batch_dim(index) != 0):
            return None
        if offsets is not None and (index.dim() != 1 or batch.bags is None or not batch.bags.matches(index, offsets)):
            return None
        padding = bound.get("padding_idx")
        if mode == "max":
            return self._bag_maxima(batch, args, kwargs, hook, index, table, offsets, padding, bound)
        if offsets is None:
            owner = torch.arange(batch.size, device=index.device).repeat_interleave(index.shape[1])
        else:
            owner = batch.bags.owner.to(index.device)
        flat = index.detach().reshape(-1)
        keep = torch.ones_like(flat, dtype=torch.float32)
        if padding is not None:
            keep = (flat != padding % table.shape[0]).float()
        weights = bound.get("per_sample_weights")
        if weights is not None:
            keep = keep * weights.detach().float().reshape(-1)
        elif mode == "mean":
            counts = keep.new_zeros(batch.size).index_add_(0, owner, keep)
            keep = keep / counts.clamp(min=1)[owner]
        out = F.embedding_bag(*args, **kwargs)
        entries = flat % table.shape[0]
        on_gradient(out, functools.partial(bag_backward, hook, batch.generation, entries, owner, keep))
        return out

    @staticmethod
    def _bag_maxima(
        batch: ActiveBatch,
        args: tuple,
        kwargs: dict,
        hook: LayerHook,
        index: torch.Tensor,
        table: torch.Tensor,
        offsets: torch.Tensor | None,
        padding: int | None,
        bound: dict[str, Any],
    ) -> Any:
        """``F.embedding_bag`` in ``max`` mode: each bag's output gradient in dim ``d`` goes to the entry whose value
        was the bag's maximum there (torch's own ``max_indices``, so ties resolve as its backward resolves them);
        an empty bag and the ``padding_idx`` entry get none. Each example's entries are the distinct maxima of its
        bag."""
        size, rows = batch.size, table.shape[0]
        pad = -1 if padding is None else padding % rows
        with torch.no_grad():
            if offsets is None:  # [B, L]: F.embedding_bag's own flattening
                ids, starts, last = index.reshape(-1), torch.arange(0, index.numel(), index.shape[1]), False
            else:
                ids, starts, last = index, offsets, bool(bound.get("include_last_offset", False))
            _, _, bag_size, maxima = torch.embedding_bag(
                table.detach(), ids, starts.to(index.device), False, 2, False, None, last, pad
            )
        valid = (bag_size[:size] > 0).unsqueeze(1) & (maxima != pad)
        bags, dims = torch.nonzero(valid, as_tuple=True)
        distinct, inverse = torch.unique(bags * rows + maxima[bags, dims], return_inverse=True)
        out = F.embedding_bag(*args, **kwargs)
        backward = bag_max_backward, hook, batch.generation, distinct % rows, distinct // rows, inverse, bags, dims
        on_gradient(out, functools.partial(*backward))
        return out

    def _index_lookup(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """``P[ids]`` or ``P.index_select(0, ids)`` of a captured bare parameter ``P`` (see :meth:`_table_lookup`)."""
        if func is torch.Tensor.__getitem__:
            table, index, dim = (*args, 0) if len(args) == 2 and not kwargs else (None, None, None)
        else:
            bound = {**dict(zip(("input", "dim", "index"), args)), **kwargs}
            table, index, dim = bound.get("input"), bound.get("index"), bound.get("dim")
        if not isinstance(table, torch.Tensor) or id(table) not in self.slots or dim is None or dim % table.dim():
            return None
        return self._table_lookup(batch, func, args, kwargs, table, index)

    def _transposed_lookup(
        self, batch: ActiveBatch, args: tuple, kwargs: dict, idx: torch.Tensor, weight: torch.Tensor, dim: int
    ) -> Any:
        """``F.embedding(idx, P.T)`` with ``P`` a captured ``[d, num_embeddings]`` parameter (peft's LoRA on an
        embedding looks up ``lora_embedding_A.T``): each example's gradient of ``P`` is the lookup rule's
        ``[d, num_embeddings]``, ``P``'s own orientation."""
        param, transposed = self._matrix_parameter(weight)
        hook = None if param is None or not transposed else self._slot(param, ("parameter",))
        if hook is None or hook.PER_POSITION or (hook.slot.d_out, hook.slot.d_in) != tuple(param.shape):
            return None
        out = F.embedding(*args, **kwargs)
        padding = bind_arguments(F.embedding, args, kwargs).get("padding_idx")
        padding = None if padding is None else padding % param.shape[1]
        rows = (idx.detach() if dim == 0 else idx.detach().movedim(dim, 0)).reshape(batch.size, -1)
        backward = functools.partial(lookup_backward, hook, batch.generation, rows, dim, param.shape[1], padding)
        on_gradient(out, backward)
        return out

    def _convolution(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        bound = bind_arguments(func, args, kwargs)
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
            on_gradient(out, functools.partial(hook_backward, hook, batch.generation, route, saved, channels_last))
        else:
            backward = functools.partial(grouped_conv_backward, hook, batch.generation, patches, groups, batch.size)
            on_gradient(out, backward)
        return out

    def _transposed_convolution(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """``conv_transpose1d/2d/3d``: the adjoint of a convolution with the same weight, so each
        example's weight gradient ``[C_in, C_out x kernel]`` sums its input's channels at each input position
        times the patches of its output gradient there; a captured bias is each example's ``dy`` summed."""
        bound = bind_arguments(func, args, kwargs)
        x, weight, bias = bound["input"], bound["weight"], bound.get("bias")
        slots = self._weight_and_bias(weight, bias)
        if slots is None or batch_dim(x) != 0 or self.sequence_first or getattr(x, OWNER, None) is not None:
            return None
        hook, apart = slots
        out = func(*args, **kwargs)
        if hook is not None:
            geometry = (weight.shape[2:], bound.get("stride", 1), bound.get("padding", 0), bound.get("dilation", 1))
            groups = int(bound.get("groups", 1))
            backward = functools.partial(transposed_conv_backward, hook, batch.generation, x.detach(), geometry, groups)
            on_gradient(out, backward)
        if apart is not None:
            self._hook_bias(out, apart, batch, channels_last)
        return out

    def _weight_and_bias(self, weight: Any, bias: Any) -> tuple[LayerHook | None, tuple | None] | None:
        """``(the weight's parameter slot, the bias's slot apart)`` of an op taking both, either None where it is
        not captured; None when a captured one has no slot that rule could fill."""
        hook = self._slot(weight, ("parameter",))
        apart = None if bias is None or not self._sources([bias]) else self._bias_slot(bias)
        if (hook is None and self._sources([weight])) or (apart is None and bias is not None and self._sources([bias])):
            return None
        return None if hook is None and apart is None else (hook, apart)

    def _hook_bias(self, out: torch.Tensor, apart: tuple, batch: ActiveBatch, layout: Any = None) -> None:
        """Each example's gradient of a bias slot apart from its weight's: ``out``'s gradient summed."""
        bias_hook, start, stop = apart
        widen = widen_rows(start, stop, bias_hook.slot.d_in, layout)
        on_gradient(out, functools.partial(bias_backward, bias_hook, batch.generation, widen))

    def _bilinear(self, batch: ActiveBatch, x1: Any, x2: Any, weight: Any, bias: Any = None) -> Any:
        """``F.bilinear``: each example's weight gradient ``[out, in1 x in2]`` sums ``dy ⊗ (x1 ⊗ x2)`` over its
        positions; a captured bias is each example's ``dy`` summed."""
        slots = self._weight_and_bias(weight, bias)
        if slots is None or batch_dim(x1) != 0 or batch_dim(x2) != 0 or self.sequence_first:
            return None
        if getattr(x1, OWNER, None) is not None or getattr(x2, OWNER, None) is not None:
            return None
        hook, apart = slots
        out = F.bilinear(x1, x2, weight, bias)
        size = batch.size
        if hook is not None:
            pairs = (x1.detach().unsqueeze(-1) * x2.detach().unsqueeze(-2)).reshape(size, -1, hook.slot.d_in)
            owner = torch.arange(size, device=out.device).repeat_interleave(pairs.shape[1])
            backward = functools.partial(rows_backward, hook, batch.generation, pairs.flatten(0, 1), owner)
            on_gradient(out, functools.partial(backward, lambda dy: dy.reshape(-1, dy.shape[-1])))
        if apart is not None:
            self._hook_bias(out, apart, batch)
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
        on_gradient(
            out,
            functools.partial(
                normalization_backward, hooks, scale, batch.generation, layout(x_hat), len(shape), layout
            ),
        )
        return out

    def _channel_normalization(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """``F.group_norm``, ``F.instance_norm`` and ``F.batch_norm`` in eval mode on a batch-first ``[B, C, ...]``
        input, with a captured per-channel scale or shift (kind ``norm``): each example's statistics are its own (or
        the running ones), so per example the scale's gradient sums ``dy * x_hat`` and the shift's ``dy`` over the
        example's positions, channel by channel. Batch norm in training mode normalises by the batch's statistics
        (no per-example split; the BatchNorm module's pre-hook records that the rows mix the examples)."""
        bound = {**dict(zip(CHANNEL_NORMALIZATIONS[func], args)), **kwargs}
        x, scale, shift = bound["input"], bound.get("weight"), bound.get("bias")
        eps = bound.get("eps", 1e-5)
        if batch_dim(x) != 0 or x.dim() < 2 or self.sequence_first or irregular_rows(x, batch.size):
            return None
        with torch.no_grad():
            if func is F.group_norm:
                x_hat = F.group_norm(x.detach(), bound["num_groups"], eps=eps)
            elif func is F.instance_norm and bound.get("use_input_stats", True):
                x_hat = F.instance_norm(x.detach(), eps=eps)  # no running statistics: none are updated twice
            elif func is F.instance_norm:
                x_hat = F.instance_norm(
                    x.detach(), bound["running_mean"], bound["running_var"], None, None, False, 0.0, eps
                )
            elif bound.get("training") or bound.get("running_mean") is None:
                return None
            else:
                x_hat = F.batch_norm(
                    x.detach(), bound["running_mean"], bound["running_var"], None, None, False, 0.0, eps
                )
        hooks = [(p, self._slot(p, ("norm",))) for p in (scale, shift) if p is not None]
        out = func(*args, **kwargs)
        layout = functools.partial(torch.movedim, source=1, destination=-1)  # channels last
        if getattr(x, OWNER, None) is not None:  # rows of the examples, k each in order (windows)
            layout = functools.partial(_rows_first, size=batch.size, layout=layout)
        backward = functools.partial(normalization_backward, hooks, scale, batch.generation, layout(x_hat), 1, layout)
        on_gradient(out, backward)
        return out

    def _grouped(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """A grouped matmul over a stacked parameter (transformers' MoE experts): rows of group ``e`` use slice ``e``,
        whose per-example gradient sums each example's rows (the rows' examples tracked through the routing)."""
        x, weight = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        owner = getattr(x, OWNER, None)
        sources = getattr(weight, SOURCES, ()) if id(weight) not in self.slots else (weight,)
        if (
            owner is None
            or batch_dim(x) != 0
            or len(sources) != 1
            or offs is None
            or x.dim() != 2
            or self.sequence_first
        ):
            return None
        param = sources[0]
        hooks = {h.index: h for h in self.slots.get(id(param), ()) if h.index is not None}
        if len(hooks) != param.shape[0]:
            return None
        if weight.data_ptr() != param.data_ptr():
            return None  # not a view of the parameter (a copy, a computed weight): no rule
        swapped = (param.shape[0], param.shape[2], param.shape[1])
        if tuple(weight.shape) == swapped and weight.stride() == (param.stride(0), param.stride(2), param.stride(1)):
            transposed = True  # W = param^T: a slice's gradient is dy^T x, in the parameter's own layout
        elif tuple(weight.shape) == tuple(param.shape) and weight.stride() == param.stride():
            transposed = False  # W = param: its gradient is x^T dy (told from the strides: square slices too)
        else:
            return None
        out = func(*args, **kwargs)
        ends = offs.tolist()
        on_gradient(
            out, functools.partial(grouped_mm_backward, hooks, batch.generation, x.detach(), owner, ends, transposed)
        )
        return out

    def _gathered(self, batch: ActiveBatch, a: Any, b: Any) -> Any:
        """``bmm`` of per-row gathered slices ``param[ids]`` with rows of mixed examples (transformers' batched-mm
        experts): row ``r`` uses slice ``ids[r]``; each slice's per-example gradient sums its examples' rows."""
        if batch_dim(a if batch_dim(b) is None else b) != 0:
            return None
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
        on_gradient(out, functools.partial(gathered_backward, hooks, batch.generation, x, owner, ids, left))
        return out

    def _attention(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        """``F.multi_head_attention_forward`` with its inner ops visible, sequence-first. A query computed from
        parameters alone and expanded over the batch (Perceiver's latents, DETR's object queries, a Q-Former's query
        tokens) meets the batch here: each example's gradient of those parameters is its own query's."""
        query = args[0] if args else kwargs["query"]
        params = self._sources([query]) if batch_dim(query) is None and query.dim() == 3 else []
        if params and query.shape[1] == batch.size:
            met = self._meeting(batch, query, params, None, 1)
            if met is not None:
                setattr(met, BATCHED, 1)
                query = met
                args, kwargs = ((met, *args[1:]), kwargs) if args else (args, {**kwargs, "query": met})
        misfed = query.dim() == 3 and (query.shape[1] != batch.size or batch_dim(query) == 0)  # [B, T, E] given
        if misfed:  # not this batch's layout (sequence-first [T, B, E] expected): its inner uses unseen
            params = self._sources([*tensors_in(args), *tensors_in(kwargs.values())])
            self.owner.uncovered(self._names(params), "multi_head_attention_forward on an input not laid out [T, B, E]")
            if batch_dim(query) == 0:  # the examples capture took are the attention's sequence
                self.owner.mixed(
                    "attention along the examples",
                    f"multi_head_attention_forward attends along dim 0 of its [T, B, E] input, where capture took "
                    f"the examples: {SEQUENCE_FIRST_HINT}",
                )
            return F.multi_head_attention_forward(*args, **kwargs)
        previous, self.sequence_first = self.sequence_first, query.dim() == 3
        try:
            with self:
                result = _ATTENTION(*args, **kwargs)
        finally:
            self.sequence_first = previous
        if query.dim() == 3 and batch_dim(query) == 1:
            # the ops inside lose the examples' dim (merged with the heads'): the output is [T, B, E] as the query
            # is, the attention weights (need_weights=True) [B, (H,) T, S]
            output, weights = result
            setattr(output, BATCHED, 1)
            if isinstance(weights, torch.Tensor):
                setattr(weights, BATCHED, 0)
        return result

    # parameter-only tensors meeting the batch -----------------------------------------------------

    def _attention_operands(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        """``F.scaled_dot_product_attention`` with operands computed from parameters alone: an ``attn_mask`` (T5's
        relative position bias, Swin's tables) expanded over the examples (or over rows of them, where the batch
        operands' are: Swin's windows), a query, key or value of the batch's size or of one row (DETR's object
        queries, learned latents): each hooked as where a parameter-only tensor meets the batch (:meth:`_meet`),
        so each example's gradient of it gives theirs."""
        names = ("query", "key", "value", "attn_mask")
        bound = {**dict(zip(names, args)), **kwargs}
        first = next((bound[n] for n in names[:3] if batch_dim(bound.get(n)) is not None), None)
        if first is None or batch_dim(first) != 0 or self.sequence_first:
            return None
        owner, rows = getattr(first, OWNER, None), first.shape[0]
        replaced: dict[str, torch.Tensor] = {}
        for name in names:
            t = bound.get(name)
            params = self._sources([t]) if isinstance(t, torch.Tensor) and batch_dim(t) is None else []
            if not params:
                continue
            targets = self._meeting_targets(params, MEETING_KINDS)
            if targets is None or any(first_hook(h).PER_POSITION for h in targets):
                return None
            if name == "attn_mask":
                shape = torch.broadcast_shapes(t.shape, (*bound["query"].shape[:-1], bound["key"].shape[-2]))
            elif t.dim() == first.dim() and t.shape[0] in (1, rows):
                shape = torch.Size((rows, *t.shape[1:]))
            else:
                return None
            met = self._meeting(batch, t, params, shape, 0, owner)
            if met is None:
                return None
            replaced[name] = met
        if not replaced:
            return None
        args = tuple(replaced.get(n, a) for n, a in zip(names, args)) + args[len(names) :]
        kwargs = {k: replaced.get(k, v) for k, v in kwargs.items()}
        return F.scaled_dot_product_attention(*args, **kwargs)

    def _meet(self, batch: ActiveBatch, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` with every parameter-only operand expanded over the batch (along the examples' dim of the
        batch operand) and hooked, so each example's gradient of it arrives separately (see :mod:`ingest.uses`).
        None when an operand's parameters are not all captured or the layout is not one this rule handles."""
        if in_place(func) and args and batch_dim(args[0]) is None:
            return None  # the parameter-only operand is the one written to
        owner = None
        if func in CONCATENATIONS:
            tensors = args[0] if args else kwargs["tensors"]
            at = _examples_dim(tensors)
            if any(getattr(t, OWNER, None) is not None for t in tensors):
                return None  # rows of the examples concatenated with a parameter: not followed
            dim = bind_arguments(func, args, kwargs).get("dim", 0)
            if at is None or (dim % tensors[0].dim() == at and func is not torch.stack):
                return None  # a concatenation along the examples' dim
            shape = None
        else:
            tensors = list(tensors_in(args)) + list(tensors_in(kwargs.values()))
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
            at = _examples_dim(tensors)
            if at is None or self.sequence_first:  # inside attention the examples' dim merges with the heads'
                return None
            first = next(t for t in tensors if batch_dim(t) is not None)
            at += len(shape) - first.dim()  # the result's dim
            owner = getattr(first, OWNER, None)  # rows of the examples along dim 0 (windows, chosen rows)
            if owner is not None and (at != 0 or shape[0] != owner.numel()):
                return None
        replaced: dict[int, torch.Tensor] = {}
        for t in tensors:
            params = self._sources([t])
            if not params or batch_dim(t) is not None or id(t) in replaced:
                continue
            expanded = self._meeting(batch, t, params, shape, at, owner)
            if expanded is None:
                return None
            replaced[id(t)] = expanded
        return func(*_swap(args, replaced), **{k: _swap_one(v, replaced) for k, v in kwargs.items()})

    def _gather(self, batch: ActiveBatch, args: tuple, kwargs: dict) -> Any:
        """``torch.gather(table, dim, ids)`` of a table computed from parameters alone, expanded or repeated over
        the batch (learned positions read at each example's position ids) by the batch's ``ids``: the table met
        per example (one copy each, hooked as in :meth:`_meet`), each example's gradient its own reads'."""
        bound = {**dict(zip(("input", "dim", "index"), args)), **kwargs}
        table, index = bound.get("input"), bound.get("index")
        at = batch_dim(index)
        if not isinstance(table, torch.Tensor) or batch_dim(table) is not None or at is None or at < 0:
            return None
        if getattr(index, OWNER, None) is not None or table.dim() != index.dim() or self.sequence_first:
            return None
        spread = over_the_batch(table, at, batch.size)
        if spread is None:
            return None
        met = self._meeting(batch, spread[0], self._sources([table]), spread[1], at)
        if met is None:
            return None
        return torch.gather(met, bound["dim"], index, **{k: v for k, v in kwargs.items() if k == "sparse_grad"})

    def _assign(self, batch: ActiveBatch, args: tuple) -> Any:
        """``h[index] = value`` with ``value`` computed from parameters alone written into the batch's ``h``
        (wav2vec2/HuBERT's ``masked_spec_embed`` at the masked time steps, a mask token): ``value`` expanded over
        the entries it is written to, rows of the examples (:meth:`_meeting` with their owners), so each example's
        gradient of it sums its own entries' gradients. Returns ``h``; None where the entries written do not fall
        in rows of one example each."""
        if len(args) != 3 or not isinstance(args[2], torch.Tensor) or self.sequence_first:
            return None
        h, index, value = args
        dim = batch_dim(h)
        if dim is None or dim < 0 or getattr(h, OWNER, None) is not None or batch_dim(value) is not None:
            return None
        layout = [1] * h.dim()
        layout[dim] = batch.size
        who = torch.arange(batch.size, device=h.device).reshape(layout).expand(h.shape)[index]
        if who.dim() == 0 or who.numel() == 0:
            return None
        owner = who.reshape(who.shape[0], -1)[:, 0]
        if not bool((who == owner.reshape(-1, *[1] * (who.dim() - 1))).all()):
            return None
        expanded = self._meeting(batch, value, self._sources([value]), who.shape, 0, owner)
        if expanded is None:
            return None
        torch.Tensor.__setitem__(h, index, expanded)
        return h

    def _meeting(
        self,
        batch: ActiveBatch,
        t: torch.Tensor,
        params: list[torch.Tensor],
        shape: torch.Size | None,
        at: int,
        owner: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The parameter-only operand ``t`` (of captured ``params``) expanded over the batch along ``at`` (to
        ``shape``; None: ``t`` already spans the batch there) and hooked, so each example's gradient of it gives
        theirs (:func:`~ingest.uses.gradients.meeting_backward`); None where a parameter has no slot for it.
        ``owner``: the batch operand's rows along dim 0 are examples ``owner`` (Swin's windows, rows chosen by an
        index): ``t`` is expanded over those rows and each example sums its rows' gradients."""
        if not t.requires_grad:
            return t  # computed from parameters without a gradient (torch.zeros_like(param)): nothing to split
        targets = self._meeting_targets(params, MEETING_KINDS)
        if targets is None or ((at or owner is not None) and first_hook(targets[0]).PER_POSITION):
            return None
        expanded = _expand(t, shape, batch.size if owner is None else owner.numel(), at)
        if expanded is None:
            return None
        direct = getattr(t, BROADCAST_HOOK, None)
        if direct is not None and at == 0 and shape is not None and t.dim() == len(shape) and owner is None:
            hook, x = direct  # a hooked module's one-row output broadcast here: its hook's own route
            route, saved = hook._save(x.expand(batch.size, *x.shape[1:]), batch.size)
            expanded.register_hook(functools.partial(hook._backward, batch.generation, route, saved))
        else:
            rows = None if owner is None else (owner, batch.size)
            backward = functools.partial(meeting_backward, t, params, targets, batch.generation, at, rows=rows)
            expanded.register_hook(backward)
        return expanded

    def _meeting_targets(
        self, params: list[torch.Tensor], kinds: tuple[str, ...]
    ) -> list[LayerHook | list[LayerHook]] | None:
        """Where each of ``params``' per-example gradients goes where they meet the batch whole: its slot, or a
        stacked parameter's slots in order (``[H, T, T]`` relative position biases added to attention scores,
        one slot per leading entry); None where a parameter has neither."""
        targets: list[LayerHook | list[LayerHook]] = []
        for param in params:
            hook = self._slot(param, kinds)
            if hook is None:
                stacked = sorted(
                    (h for h in self.slots.get(id(param), ()) if h.index is not None), key=lambda h: h.index
                )
                if not stacked or [h.index for h in stacked] != list(range(len(param))) or stacked[0].PER_POSITION:
                    return None
                targets.append(stacked)
            else:
                targets.append(hook)
        return targets


def _examples_dim(tensors: Iterable[Any]) -> int | None:
    """The examples' dim of the first batch operand among ``tensors`` (None: none, or its dim is unknown)."""
    dim = next((batch_dim(t) for t in tensors if batch_dim(t) is not None), None)
    return None if dim is None or dim < 0 else dim


def _rows_first(t: torch.Tensor, size: int, layout: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """``t`` (after ``layout``), rows of the examples in order, ``k`` each, along dim 0, as ``[B, k, ...]``."""
    t = t if layout is None else layout(t)
    return t.reshape(size, -1, *t.shape[1:])


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``[R, ..., d]`` as ``[R x ..., d]``: each position of a row of the examples a row of its own."""
    return t.reshape(-1, t.shape[-1])


def _rows_of(bias: Any, slot_bias: Any, rows: tuple[Any, int, int]) -> Any:
    """The slot's bias when ``bias`` is the same block of its rows as the weight's ``rows``, else ``bias``."""
    block = getattr(bias, ROWS, None)
    if block is not None and block[0] is slot_bias and block[1:] == rows[1:]:
        return slot_bias
    return bias


def _swap_one(value: Any, replaced: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return replaced.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(replaced.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _swap(args: tuple, replaced: dict[int, torch.Tensor]) -> tuple:
    return tuple(_swap_one(a, replaced) for a in args)


def _expand(t: torch.Tensor, shape: torch.Size | None, size: int, at: int) -> torch.Tensor | None:
    """``t`` as an operand whose dim ``at`` is the batch: broadcast to ``shape`` (elementwise ops) or, in a
    concatenation, ``t`` itself when its dim ``at`` already spans the batch."""
    if shape is None:
        if t.dim() <= at or t.shape[at] != size:
            return None
        return t.view_as(t)
    if len(shape) <= at or shape[at] != size or t.dim() > len(shape):
        return None
    return t.expand(shape)
