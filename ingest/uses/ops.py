"""The torch functions the op-level capture (:mod:`ingest.uses`) recognises, by family, and how to read a call of
one: its arguments by name, whether it writes into its first operand, its name for reports."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

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
TRANSPOSED_CONVOLUTIONS = frozenset([torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d])
#: Matrix products ``(a, b)`` (``x @ W``, ``W @ x``, ``torch.matmul``, ``mm``).
MATMULS = frozenset([torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__])
#: Normalisations with an elementwise scale (and shift) over the last dims: their argument names, in order.
#: Reads of a bare parameter's entries by the batch's ids (:meth:`~ingest.uses.rules.UseRules._index_lookup`).
LOOKUPS = frozenset([torch.Tensor.__getitem__, torch.Tensor.index_select, torch.index_select])
#: Normalisations over the channels' dim 1 of ``[B, C, ...]`` inputs, by their arguments' names: per example
#: exact where their statistics are the example's own or fixed (group and instance norm; batch norm in eval mode).
CHANNEL_NORMALIZATIONS = {
    F.group_norm: ("input", "num_groups", "weight", "bias", "eps"),
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    F.instance_norm: ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps"),
}
NORMALIZATIONS = {
    F.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
    **({F.rms_norm: ("input", "normalized_shape", "weight", "eps")} if hasattr(F, "rms_norm") else {}),
}
#: Grouped matmuls ``(x [S, d_in], W [E, d_in, d_out], offs [E])``: rows ``offs[e-1]:offs[e]`` of ``x`` use ``W[e]``.
GROUPED_MM = frozenset(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)


def in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first operand (``add_``, ``__iadd__``, ``__setitem__``)."""
    name = getattr(func, "__name__", "")
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.endswith("__"))
    )


def op_name(func: Any) -> str:
    """The op's name as a user writes it: ``torch.conv2d`` (not its binding class's), ``TensorBase.matmul``."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return name.replace("_VariableFunctionsClass.", "torch.")


def bind_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments of a functional op by name (the signatures of ``F.embedding`` and ``convNd``)."""
    if func is F.embedding:
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    elif func in CONCATENATIONS:
        names = ("tensors", "dim")
    elif func in TRANSPOSED_CONVOLUTIONS:
        names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
    else:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    return {**dict(zip(names, args)), **kwargs}
