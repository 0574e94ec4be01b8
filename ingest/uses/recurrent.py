"""Recurrent layers (``nn.RNN``/``nn.LSTM``/``nn.GRU`` and their ``*Cell`` modules) for the op-level capture
(:mod:`ingest.uses`): each of their weights is a Linear map applied at every time step, ``W_ih`` to the layer's
input ``x_t`` and ``W_hh`` to the previous hidden state ``h_{t-1}``, so an example's gradient of ``W_ih`` (with
``b_ih``) is ``sum_t dgi_t x_t^T`` and of ``W_hh`` (with ``b_hh``) ``sum_t dgh_t h_{t-1}^T``, where ``gi_t`` and
``gh_t`` are the two products (``[B, gates x hidden]``). torch's fused kernels (``torch.lstm``, ``torch.gru``,
``torch.rnn_tanh``/``rnn_relu`` and the ``*_cell`` ops) do not expose ``gi_t``, ``gh_t`` or their gradients, so when
the outputs' gradients arrive the capture recomputes the layer step by step from the inputs it kept (the standard
equations, in the weights' dtype), backpropagates the outputs' gradients to every ``gi_t``/``gh_t``, and hands
each weight's rows ``(x_t | h_{t-1}, dgi_t | dgh_t)`` with their examples to its slot (the Linear rule over the
steps). The training itself runs torch's kernel unchanged: the recomputation only forms the rows (equal to
per-example autograd to float rounding), at about the layer's forward and backward cost again.

An LSTM's projection ``W_hr`` (``proj_size``) is a third Linear map, of each step's ``o * tanh(c_t)``. A packed
sequence's step ``t`` runs its first ``B_t`` (longest) sequences; the example of each of its rows is the one the
packing recorded (:func:`~ingest.uses.batch_tracking.mark_packing`, through the sort by length). Not split
(reported by the caller as a use no rule covers): an unbatched input, dropout between stacked layers in training
mode (its masks cannot be drawn again), an input whose examples' dim is not the layer's batch dim, a packed
sequence packed outside the captured forward or with a learned initial state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ingest.hooks import LayerHook, guarded
from ingest.uses.batch_tracking import OWNER, batch_dim

#: The fused sequence ops (``torch.lstm`` is ``torch._VF.lstm``) and the one-step cell ops, by the cell they run.
SEQUENCES = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "rnn_tanh", torch.rnn_relu: "rnn_relu"}
CELLS = {
    torch.lstm_cell: "lstm",
    torch.gru_cell: "gru",
    torch.rnn_tanh_cell: "rnn_tanh",
    torch.rnn_relu_cell: "rnn_relu",
}


@dataclass
class RecurrentCall:
    """One call of a recurrent op, read from its arguments: the cell, the input (time-major ``[T, B, d]``), the
    initial states (``[layers x directions, B, H]``; LSTM: ``(h0, c0)``), each layer-direction's weights
    ``(w_ih, w_hh, b_ih, b_hh, w_hr)`` (biases None without, ``w_hr`` an LSTM's projection, None without), and
    where the input's examples are."""

    cell: str
    input: torch.Tensor  # [T, B, d]; a packed sequence's data [N, d] (rows of step t after those of step t - 1)
    states: tuple[torch.Tensor, ...]
    weights: list[tuple[torch.Tensor | None, ...]]
    layers: int
    directions: int
    examples_dim: int  # of the input as the op received it
    single_step: bool  # a *_cell op: one step of one layer, states [B, H]
    sizes: list[int] | None = None  # a packed sequence's batch size at each step (its first sequences run)
    owner: torch.Tensor | None = None  # a packed sequence's example of each row of data

    def steps(self) -> list[tuple[int, int]]:
        """``(first row, rows)`` of each step in the input's rows (``[T * B, d]`` time-major, or packed)."""
        if self.sizes is None:
            size = self.input.shape[1]
            return [(t * size, size) for t in range(self.input.shape[0])]
        starts = [0]
        for n in self.sizes[:-1]:
            starts.append(starts[-1] + n)
        return list(zip(starts, self.sizes))

    def rows(self) -> torch.Tensor:
        """The input's rows ``[N, d]`` in :meth:`steps` order."""
        return self.input if self.sizes is not None else self.input.flatten(0, 1)

    def row_examples(self) -> torch.Tensor:
        """The example of each input row."""
        if self.owner is not None:
            return self.owner
        steps, size = self.input.shape[0], self.input.shape[1]
        return torch.arange(size, device=self.input.device).repeat(steps)


def read_call(func: Any, args: tuple, kwargs: dict) -> RecurrentCall | str:
    """The call's parts, or why its rows cannot be recomputed (packed sequence, unbatched input, dropout between
    layers in training mode, keyword arguments)."""
    if kwargs:
        return "called with keyword arguments"
    if func in CELLS:
        return _read_cell(CELLS[func], args)
    if is_packed(args):
        return _read_packed(SEQUENCES[func], args)
    if len(args) != 9:
        return "with arguments of an unknown layout"
    x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return "on an unbatched input"
    if dropout and train and layers > 1:
        return "with dropout between its layers in training mode (its masks cannot be drawn again)"
    weights = _weights(SEQUENCES[func], params, has_biases, layers * (2 if bidirectional else 1))
    if isinstance(weights, str):
        return weights
    states = tuple(hx) if isinstance(hx, (list, tuple)) else (hx,)
    time_major = x.transpose(0, 1) if batch_first else x
    directions = 2 if bidirectional else 1
    return RecurrentCall(
        SEQUENCES[func], time_major, states, weights, layers, directions, 0 if batch_first else 1, False
    )


def _weights(cell: str, params: Any, has_biases: bool, count: int) -> list[tuple[torch.Tensor | None, ...]] | str:
    """Each layer-direction's ``(w_ih, w_hh, b_ih, b_hh, w_hr)`` from the op's flat list of weights."""
    per = 4 if has_biases else 2
    if len(params) == count * (per + 1) and cell == "lstm":
        per += 1  # weight_hr: an LSTM's projection of its hidden state (proj_size)
    elif len(params) != count * per:
        return "with weights of an unknown layout"
    weights = []
    for k in range(count):
        w = params[k * per : (k + 1) * per]
        biases = (w[2], w[3]) if has_biases else (None, None)
        weights.append((w[0], w[1], *biases, w[-1] if per in (3, 5) else None))
    return weights


def _read_packed(cell: str, args: tuple) -> RecurrentCall | str:
    """A packed sequence's call ``(data, batch_sizes, hx, params, has_biases, layers, dropout, train,
    bidirectional)``: the examples of the data's rows are the ones the packing recorded (:data:`OWNER`)."""
    if len(args) != 9:
        return "on a packed sequence with arguments of an unknown layout"
    data, sizes, hx, params, has_biases, layers, dropout, train, bidirectional = args
    owner = getattr(data, OWNER, None)
    if owner is None or data.dim() != 2 or batch_dim(data) != 0:
        return "on a packed sequence whose rows' examples are not known (packed outside the captured forward?)"
    if dropout and train and layers > 1:
        return "with dropout between its layers in training mode (its masks cannot be drawn again)"
    weights = _weights(cell, params, has_biases, layers * (2 if bidirectional else 1))
    if isinstance(weights, str):
        return weights
    states = tuple(hx) if isinstance(hx, (list, tuple)) else (hx,)
    directions = 2 if bidirectional else 1
    return RecurrentCall(cell, data, states, weights, layers, directions, 0, False, sizes.tolist(), owner)


def is_packed(args: tuple) -> bool:
    """Whether a sequence op's arguments are a packed sequence's ``(data, batch_sizes, hx, params, ...)``."""
    return len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dim() == 1


def _read_cell(cell: str, args: tuple) -> RecurrentCall | str:
    if len(args) not in (4, 6) or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
        return "on an unbatched input"
    x, hx, w_ih, w_hh = args[:4]
    b_ih, b_hh = args[4:6] if len(args) == 6 else (None, None)
    states = tuple(s[None] for s in (hx if isinstance(hx, (list, tuple)) else (hx,)))
    return RecurrentCall(cell, x[None], states, [(w_ih, w_hh, b_ih, b_hh, None)], 1, 1, 0, True)


def separate_outputs(result: Any) -> tuple[list[torch.Tensor], Any]:
    """The op's outputs in :func:`recompute`'s order (the output sequence, not for a cell, then each state), each
    a view of its own whose gradient the capture takes, and the op's result rebuilt from copies of them for the
    model. Inside the op a final state can feed another output (an LSTM cell's ``h = o tanh(c)`` reads the ``c`` it
    returns), so the gradient arriving at the op's own ``c`` would hold ``h``'s share too; the views take only what
    the model does with each, and the copies keep them from the model's in-place ops (``ReLU(inplace=True)``,
    ``h.mul_(0.5)``), which would change the gradient a hook on the tensor sees."""
    outputs = [result.view_as(result)] if isinstance(result, torch.Tensor) else [t.view_as(t) for t in result]
    given = [t.clone() for t in outputs]
    return outputs, given[0] if isinstance(result, torch.Tensor) else tuple(given)


@dataclass
class LayerRows:
    """What one layer-direction's weights saw at each step: the inputs ``x_t`` (``[N, d]``, the rows of every step)
    and previous states ``h_{t-1}`` (one ``[B_t, H]`` per step), the products ``gi`` (``[N, G]``) and ``gh_t``
    (one ``[B_t, G]`` per step); with an LSTM projection, the states before it (``o * tanh(c_t)``) and after
    (``h_t = W_hr (o * tanh(c_t))``)."""

    inputs: torch.Tensor
    previous: list[torch.Tensor]
    gi: torch.Tensor
    gh: list[torch.Tensor]
    unprojected: list[torch.Tensor]
    projected: list[torch.Tensor]


def _step(cell: str, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None) -> tuple:
    """One step of torch's cell equations from its two products."""
    if cell == "lstm":
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if cell == "gru":
        ir, iz, i_n = gi.chunk(3, 1)
        hr, hz, h_n = gh.chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h, None
    pre = gi + gh
    return (torch.tanh(pre) if cell == "rnn_tanh" else torch.relu(pre)), None


def recompute(call: RecurrentCall) -> tuple[list[torch.Tensor], list[LayerRows]]:
    """The layer run again step by step (under autograd from each ``gi``): its outputs in :func:`separate_outputs`'s
    order and each layer-direction's :class:`LayerRows`. A packed sequence's step ``t`` runs its first ``B_t``
    sequences; the others keep their state."""
    steps = call.steps()
    dtype = call.weights[0][0].dtype  # the weights' (an autocast region may have run the op in another)
    inputs = call.rows().to(dtype)
    last_h, last_c, rows = [], [], []
    for layer in range(call.layers):
        outputs = []
        for direction in range(call.directions):
            k = layer * call.directions + direction
            w_ih, w_hh, b_ih, b_hh, w_hr = call.weights[k]
            gi = F.linear(inputs, w_ih, b_ih)
            if not gi.requires_grad:
                gi.requires_grad_()
            per_step = gi.split([count for _, count in steps])  # one split: a slice per step backpropagates a full gi
            h = call.states[0][k].to(dtype)
            c = call.states[1][k].to(dtype) if call.cell == "lstm" else None
            ys: list[Any] = [None] * len(steps)
            previous: list[Any] = [None] * len(steps)
            gh: list[Any] = [None] * len(steps)
            unprojected: list[Any] = [None] * len(steps) if w_hr is not None else []
            projected: list[Any] = [None] * len(steps) if w_hr is not None else []
            for t in range(len(steps)) if direction == 0 else reversed(range(len(steps))):
                count = steps[t][1]
                previous[t] = h[:count]
                gh[t] = F.linear(previous[t], w_hh, b_hh)
                if not gh[t].requires_grad:  # from the initial state, which the recomputation starts from
                    gh[t].requires_grad_()
                new, new_c = _step(call.cell, per_step[t], gh[t], previous[t], None if c is None else c[:count])
                if w_hr is not None:
                    unprojected[t] = new
                    new = projected[t] = F.linear(new, w_hr)
                ys[t] = new
                h = new if count == h.shape[0] else torch.cat([new, h[count:]])
                if c is not None:
                    c = new_c if count == c.shape[0] else torch.cat([new_c, c[count:]])
            outputs.append(torch.cat(ys))
            last_h.append(h)
            last_c.append(c)
            rows.append(LayerRows(inputs, previous, gi, gh, unprojected, projected))
        inputs = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
    if call.single_step:
        return ([last_h[0], last_c[0]] if call.cell == "lstm" else [last_h[0]]), rows
    states = [torch.stack(last_h)] + ([torch.stack(last_c)] if call.cell == "lstm" else [])
    if call.sizes is not None:
        return [inputs, *states], rows
    out = inputs.reshape(call.input.shape[0], call.input.shape[1], -1)
    return [out.transpose(0, 1) if call.examples_dim == 0 else out, *states], rows


@guarded
def recurrent_backward(
    call: RecurrentCall,
    slots: Sequence[tuple[LayerHook | None, LayerHook | None, LayerHook | None]],
    generation: int,
    grads: Sequence[torch.Tensor | None],
) -> None:
    """The outputs' gradients arrived (``grads``, None for an output that got none): recompute the layer,
    backpropagate them to every step's products and add each weight's rows to its slot (``slots``: the ``(ih,
    hh, hr)`` hooks of each layer-direction, None where that weight is not captured or absent)."""
    live = [h for pair in slots for h in pair if h is not None and h.live_batch(generation) is not None]
    if not live:
        return  # a gradient that adds no rows (reported by live_batch where it should have)
    try:
        with torch.enable_grad():
            outputs, rows = recompute(call)
            pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
            separate = call.cell == "gru"  # a GRU's n gate reads r * gh: its gh has a gradient of its own
            wanted = [t for r in rows for t in (r.gi, *(r.gh if separate else ()), *r.projected)]
            cotangents = [g.to(o.dtype) for o, g in pairs]
            found = torch.autograd.grad([o for o, _ in pairs], wanted, cotangents, allow_unused=True)
    except Exception as error:  # never stops the training: the layer's slots miss this step, said so
        for hook in live:
            hook.owner.missed(hook, f"{call.cell} recomputed for its rows failed ({type(error).__name__}: {error})")
        return
    owner = call.row_examples()
    steps = len(call.steps())
    at = 0
    for r, (ih, hh, hr) in zip(rows, slots):
        own = steps if separate else 0  # LSTM, RNN: the gates are gi + gh, so dgh_t is dgi_t
        dgi = found[at] if found[at] is not None else torch.zeros_like(r.gi)
        dhr = found[at + 1 + own : at + 1 + own + len(r.projected)]
        if ih is not None:
            ih.add_rows(generation, r.inputs.detach(), dgi, owner, bias=ih.bias is not None)
        if hh is not None:
            dgh = found[at + 1 : at + 1 + own]
            dy = torch.cat([d if d is not None else torch.zeros_like(g) for d, g in zip(dgh, r.gh)]) if own else dgi
            previous = torch.cat([p.detach() for p in r.previous])
            hh.add_rows(generation, previous, dy, owner, bias=hh.bias is not None)
        if hr is not None:
            dy = torch.cat([d if d is not None else torch.zeros_like(g) for d, g in zip(dhr, r.projected)])
            unprojected = torch.cat([u.detach() for u in r.unprojected])
            hr.add_rows(generation, unprojected, dy, owner, bias=False)
        at += 1 + own + len(r.projected)
