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
* ``x @ P``, ``x @ P.T``, ``P @ x``, ``P.T @ x`` (``matmul``/``mm``, ``P`` a captured 2-D parameter, an embedding
  tied to an output included): the Linear rule over each example's rows (or columns) of ``x``;
* a row block ``P[start:stop]`` (``split``/``chunk``: cross-attention's packed in-projection) in ``F.linear``: the
  slot's use with its output gradient zero outside the block; a 1-D parameter (or a block of it) as the bias;
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

Modules, one job each: :mod:`~ingest.uses.ops` (the torch functions recognised, by family),
:mod:`~ingest.uses.batch_tracking` (which tensors come from the batch, along which dim),
:mod:`~ingest.uses.rules` (the rule of each use, by op), :mod:`~ingest.uses.gradients` (each use's per-example
gradient, formed in its output-gradient hook) and :mod:`~ingest.uses.mode` (the ``TorchFunctionMode`` that
dispatches to them).
"""

from ingest.uses.batch_tracking import (
    ACROSS,
    BATCHED,
    GATHER,
    OWNER,
    SLICE,
    SOURCES,
    TAKEN,
    batch_dim,
    mark_batched,
    mark_owned_rows,
)
from ingest.uses.gradients import conv_patches, slot_gradient, split_operand
from ingest.uses.mode import ParameterUses
from ingest.uses.ops import (
    CONCATENATIONS,
    CONVOLUTIONS,
    ELEMENTWISE,
    GROUPED_MM,
    NORMALIZATIONS,
    REDUCTIONS,
    RESHAPES,
)
from ingest.uses.rules import UseOwner, UseRules

__all__ = [
    "ACROSS",
    "BATCHED",
    "CONCATENATIONS",
    "CONVOLUTIONS",
    "ELEMENTWISE",
    "GATHER",
    "GROUPED_MM",
    "NORMALIZATIONS",
    "OWNER",
    "REDUCTIONS",
    "RESHAPES",
    "SLICE",
    "SOURCES",
    "TAKEN",
    "ParameterUses",
    "UseOwner",
    "UseRules",
    "batch_dim",
    "conv_patches",
    "mark_batched",
    "mark_owned_rows",
    "slot_gradient",
    "split_operand",
]
