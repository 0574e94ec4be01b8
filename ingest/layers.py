"""Which parameters of a model can be captured, as what kind of layer, and by which mechanism.

A captured *layer* is one slot of the row: a parameter (and the bias that goes with it) whose per-example
gradient is a ``d_out x d_in`` matrix (see :mod:`ingest.projection`). Kinds:

* ``linear`` (``nn.Linear``), ``conv1d`` (Hugging Face ``Conv1D``), ``embedding`` (``nn.Embedding``);
* ``conv`` (``nn.Conv1d/2d/3d``: ``[C_out, C_in/groups x kernel]``, the patch (im2col) view);
* ``attention`` (``nn.MultiheadAttention``'s packed in-projection, named ``<module>.in_proj``);
* ``norm`` (opt-in, not among the default ``layer_types``): a normalisation layer's scale or shift (``LayerNorm``,
  ``RMSNorm``, a model's ``*Norm`` class), ``[1, D]``;
* ``recurrent`` (``nn.RNN``/``nn.LSTM``/``nn.GRU`` and their ``*Cell`` modules): ``weight_ih_l<k>`` with
  ``bias_ih_l<k>`` and ``weight_hh_l<k>`` with ``bias_hh_l<k>`` (``_reverse`` for a bidirectional layer's second
  direction; a cell's ``weight_ih``/``weight_hh``), each ``[gates x hidden, d_in (+1)]``, named by the weight;
* ``parameter`` (a bare trainable ``nn.Parameter`` that no layer above owns and that is not a norm's affine
  parameter, e.g. a ViT ``cls_token``, a position table or a router: ``grad.reshape(-1, shape[-1])``; a stacked
  3-D parameter ``[E, d_out, d_in]`` such as transformers-5 MoE experts is ``E`` such layers ``<name>.<e>``).

A layer is captured by a module hook (``hooked``) only where the hook provably sees every use of its weight:
a stock ``nn.Linear``/``nn.Embedding``/``Conv1D`` forward (not a subclass that overrides it, not an attention
module's ``out_proj`` that attention never calls). Every other layer is captured at the ops that consume its
parameter (:mod:`ingest.uses`). Trainable parameters that are not captured are listed, with why, by
:func:`uncaptured_parameters` (:mod:`ingest.coverage` records and reports them).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

#: Why a trainable parameter is not a layer of its own (see :func:`uncaptured_parameters`).


@dataclass(frozen=True)
class LayerInfo:
    """A capturable layer: its name, kind, linear-map shape (``d_in -> d_out``), its parameters and whether a
    module hook captures it (else the op-level capture of :mod:`ingest.uses`)."""

    name: str
    module: nn.Module
    kind: str
    d_in: int
    d_out: int
    has_bias: bool
    weight: nn.Parameter | None = None
    bias: nn.Parameter | None = None
    hooked: bool = True
    index: int | None = None  # the slice ``weight[index]`` of a stacked 3-D parameter (one MoE expert)

    @property
    def parameter(self) -> nn.Parameter:
        """The layer's weight (the module's ``weight`` unless set)."""
        return self.weight if self.weight is not None else self.module.weight


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _stock_forward(module: nn.Module, base: type) -> bool:
    """Whether ``module``'s class runs ``base``'s own forward (a subclass that does not override it; an
    instance-level wrapper, as accelerate's hooks set, is taken to call it)."""
    return type(module).forward is base.forward


def layer_info(name: str, module: nn.Module) -> LayerInfo | None:
    """Describe ``module`` if it is a supported module layer (Linear, HF Conv1D, Embedding, ConvNd), else None."""
    if isinstance(module, nn.Linear):
        return LayerInfo(
            name,
            module,
            "linear",
            module.in_features,
            module.out_features,
            module.bias is not None,
            hooked=_stock_forward(module, nn.Linear),
        )
    if isinstance(module, nn.Embedding):
        return LayerInfo(
            name,
            module,
            "embedding",
            module.num_embeddings,
            module.embedding_dim,
            False,
            # scale_grad_by_freq divides each row's gradient by its index's count in the whole batch, which no
            # per-example split of the output gradient reproduces: left to the op-level capture, which reports it
            hooked=_stock_forward(module, nn.Embedding) and not module.scale_grad_by_freq,
        )
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        d_in = module.in_channels // module.groups * math.prod(module.kernel_size)
        return LayerInfo(name, module, "conv", d_in, module.out_channels, module.bias is not None, hooked=False)
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        d_in, d_out = getattr(module, "nx", None), getattr(module, "nf", None)
        if d_in is None or d_out is None:  # FSDP1 (use_orig_params) holds a flat 1-D shard outside forward
            d_in, d_out = module.weight.shape
        return LayerInfo(name, module, "conv1d", d_in, d_out, module.bias is not None)
    return None


def attention_info(name: str, module: nn.Module) -> LayerInfo | None:
    """The packed in-projection of an ``nn.MultiheadAttention`` (``<name>.in_proj``), else None."""
    if not isinstance(module, nn.MultiheadAttention) or not module._qkv_same_embed_dim:
        return None
    weight, bias = module.in_proj_weight, module.in_proj_bias
    dim = module.embed_dim
    return LayerInfo(
        f"{name}.in_proj" if name else "in_proj",
        module,
        "attention",
        dim,
        3 * dim,
        bias is not None,
        weight,
        bias,
        False,
    )


def row_major_info(name: str, module: nn.Module) -> LayerInfo | None:
    """A weight whose gradient is a ``[shape[0], rest]`` matrix: a transposed convolution's ``[C_in, C_out/groups,
    *kernel]`` (captured at ``conv_transpose1d/2d/3d``), ``nn.Bilinear``'s ``[out, in1, in2]`` (at ``F.bilinear``),
    as a parameter slot ``<name>.weight``. Their biases are 1-D parameter slots of their own (a transposed
    convolution's has ``C_out`` entries, not ``C_in``)."""
    if not isinstance(module, (nn.modules.conv._ConvTransposeNd, nn.Bilinear)):
        return None
    weight = module.weight
    full = f"{name}.weight" if name else "weight"
    return LayerInfo(full, module, "parameter", weight[0].numel(), weight.shape[0], False, weight, None, False)


def recurrent_info(name: str, module: nn.Module) -> list[LayerInfo] | None:
    """The weights of an ``nn.RNN``/``nn.LSTM``/``nn.GRU`` or of a ``*Cell`` module as Linear-like layers
    ``<name>.weight_ih_l<k>`` (with ``bias_ih_l<k>``), ``<name>.weight_hh_l<k>`` (with ``bias_hh_l<k>``) and an
    LSTM's projection ``<name>.weight_hr_l<k>``, captured at the fused op (:mod:`ingest.uses.recurrent`); None for
    other modules."""
    if isinstance(module, nn.RNNCellBase):
        suffixes = [""]
    elif isinstance(module, nn.RNNBase):
        directions = ("", "_reverse") if module.bidirectional else ("",)
        suffixes = [f"_l{layer}{d}" for layer in range(module.num_layers) for d in directions]
    else:
        return None
    prefix = f"{name}." if name else ""
    out = []
    for suffix in suffixes:
        for side in ("ih", "hh", "hr") if getattr(module, "proj_size", 0) else ("ih", "hh"):
            weight = getattr(module, f"weight_{side}{suffix}")
            bias = getattr(module, f"bias_{side}{suffix}", None) if module.bias else None
            d_out, d_in = weight.shape
            full = f"{prefix}weight_{side}{suffix}"
            out.append(LayerInfo(full, module, "recurrent", d_in, d_out, bias is not None, weight, bias, False))
    return out


def parameter_info(name: str, module: nn.Module, param: nn.Parameter) -> LayerInfo:
    """A bare parameter as a ``[numel / last, last]`` layer captured at its ops."""
    last = param.shape[-1] if param.dim() else 1
    return LayerInfo(name, module, "parameter", last, max(param.numel() // max(last, 1), 1), False, param, None, False)


def stacked_info(name: str, module: nn.Module, param: nn.Parameter) -> list[LayerInfo]:
    """A stacked ``[E, d_out, d_in]`` parameter as ``E`` layers ``<name>.<e>`` (one per slice, e.g. per MoE expert),
    captured where a slice ``param[e]`` is used; examples that use no row of a slice have zeros in its slot."""
    _, d_out, d_in = param.shape
    return [
        LayerInfo(f"{name}.{e}", module, "parameter", d_in, d_out, False, param, None, False, e)
        for e in range(param.shape[0])
    ]


#: Path components that wrappers insert into module names (FSDP1's ``FullyShardedDataParallel``).
WRAPPER_COMPONENTS = ("_fsdp_wrapped_module",)


def clean_name(name: str) -> str:
    """``name`` without the components that wrappers insert (``0._fsdp_wrapped_module.fc`` -> ``0.fc``), so
    a wrapped model's layers keep the names (and projection seeds) of the unwrapped model's."""
    return ".".join(part for part in name.split(".") if part and part not in WRAPPER_COMPONENTS)


def fsdp1_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` holds an FSDP1 ``FullyShardedDataParallel`` wrapper (its parameters are flat or sharded
    outside forward, so nothing that reads a layer's weight or the optimizer's state per weight can work)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without distributed support
        return False
    return any(isinstance(module, FullyShardedDataParallel) for module in model.modules())


def is_flat(param: nn.Parameter) -> bool:
    """Whether ``param`` is FSDP1's ``FlatParameter`` (the storage of its module's own parameters, whose layers
    are captured as themselves)."""
    return bool(getattr(param, "_is_flat_param", False))


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer (torch's, or a model's own ``*Norm`` class)."""
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
    return isinstance(module, norms) or "norm" in type(module).__name__.lower()


def computed_weight(module: nn.Module) -> bool:
    """Whether ``module``'s ``weight`` is computed from other parameters before each forward (a parametrization:
    ``weight_norm``, ``spectral_norm``, ``orthogonal``; the legacy ``torch.nn.utils.weight_norm``/``spectral_norm``
    hooks). Such a module is no layer: its weight is no parameter, so a slot for it would hold the gradient of no
    parameter; the parameters it is computed from (and the bias) are bare parameter slots, split where the weight
    meets the batch (:mod:`ingest.uses.copies`)."""
    if parametrize.is_parametrized(module, "weight"):
        return True
    legacy = (WeightNorm, SpectralNorm)
    return any(isinstance(h, legacy) and h.name == "weight" for h in module._forward_pre_hooks.values())


def _candidate_layers(model: nn.Module) -> tuple[list[LayerInfo], dict[int, str]]:
    """Every layer the model offers, in module order, and the reason each other trainable-or-not parameter
    (by id) is not a layer (``""`` for the parameters that are a layer's weight or bias)."""
    layers: list[LayerInfo] = []
    reasons: dict[int, str] = {}
    bypassed = set()  # attention reads out_proj.weight without calling the module
    for raw_name, module in model.named_modules():
        name = clean_name(raw_name)
        info = None
        if not computed_weight(module):
            info = layer_info(name, module) or attention_info(name, module) or row_major_info(name, module)
        if isinstance(module, nn.MultiheadAttention):
            bypassed.add(id(module.out_proj))
        found = [info] if info is not None else recurrent_info(name, module) or []
        for info in found:
            layers.append(info)
            for p in (info.parameter, info.bias if info.weight is not None else getattr(module, "bias", None)):
                if isinstance(p, nn.Parameter):
                    reasons.setdefault(id(p), "")
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in reasons or is_flat(param):
                continue
            full = f"{name}.{pname}" if name else pname
            if is_norm(module):  # a scale or shift: the opt-in kind "norm"
                layers.append(dataclasses.replace(parameter_info(full, module, param), kind="norm"))
                reasons[id(param)] = ""
            elif param.dim() == 3 and param.shape[0] > 1 and min(param.shape[1:]) > 1:
                # stacked matrices (MoE experts): a slot per slice; [L, 1, H] (an RNN's learned initial state) is
                # one matrix, a bare parameter
                layers.extend(stacked_info(full, module, param))
                reasons[id(param)] = ""
            else:  # of any rank ([1, C, H, W] position maps too): the ops that meet the batch split it, or say not
                layers.append(parameter_info(full, module, param))
                reasons[id(param)] = ""
    layers = [dataclasses.replace(i, hooked=False) if id(i.module) in bypassed else i for i in layers]
    return layers, reasons


def select_layers(
    model: nn.Module,
    layer_types: tuple[str, ...],
    include: str | None,
    exclude: str | None,
    include_frozen: bool = False,
) -> list[LayerInfo]:
    """Supported layers of ``model`` in module order, filtered by kind and name regexes.

    Names are the module names without wrapper components (:func:`clean_name`); a bare parameter's name is its
    full dotted name, an attention module's packed in-projection ``<module>.in_proj``. ``include``/``exclude``
    are matched with ``re.search`` on them. Layers whose weight does not require grad (frozen, e.g. the base
    layers of a LoRA model) are skipped unless ``include_frozen``.
    """
    layers, _ = _candidate_layers(model)
    return [info for info in layers if _selected(info, layer_types, include, exclude, include_frozen)]


def _selected(
    info: LayerInfo, layer_types: tuple[str, ...], include: str | None, exclude: str | None, include_frozen: bool
) -> bool:
    if info.kind not in layer_types or not (include_frozen or info.parameter.requires_grad):
        return False
    if include is not None and not re.search(include, info.name):
        return False
    return not (exclude is not None and re.search(exclude, info.name))


def uncaptured_parameters(
    model: nn.Module, layers: list[LayerInfo], layer_types: tuple[str, ...], include: str | None, exclude: str | None
) -> list[tuple[str, int, str]]:
    """``(name, numel, reason)`` of every trainable parameter of ``model`` that none of ``layers`` captures."""
    candidates, reasons = _candidate_layers(model)
    captured = {id(p) for info in layers for p in (info.parameter, _bias(info)) if p is not None}
    why: dict[int, str] = {}
    for info in candidates:
        for p in (info.parameter, _bias(info)):
            if p is None or id(p) in captured:
                continue
            if info.kind not in layer_types:
                why[id(p)] = f"layer kind {info.kind!r} not in layer_types"
            elif not info.parameter.requires_grad:  # a trainable bias of a frozen weight (BitFit)
                why[id(p)] = (
                    f"its layer {info.name}'s weight is frozen, so the layer is not captured: pass include_frozen=True "
                    "to capture it (the frozen weight's columns included)"
                )
            else:
                why[id(p)] = "left out by include=/exclude="
    out, seen = [], set()
    for raw, param in model.named_parameters():
        if not param.requires_grad or id(param) in captured or id(param) in seen or is_flat(param):
            continue
        seen.add(id(param))
        out.append((clean_name(raw), param.numel(), why.get(id(param)) or reasons.get(id(param)) or "not a layer"))
    return out


def _bias(info: LayerInfo) -> nn.Parameter | None:
    if info.weight is not None:
        return info.bias
    bias = getattr(info.module, "bias", None)
    return bias if isinstance(bias, nn.Parameter) and info.has_bias else None


def left_out_ops(model: nn.Module, layers: list[LayerInfo]) -> dict[int, object]:
    """Weight id -> the op (``F.linear``/``F.embedding``) of each Linear/Embedding module the selection leaves out:
    such a module's own use of a weight it shares with a captured layer (a tied ``lm_head``) is left out with it."""
    import torch.nn.functional as F

    selected = {id(info.module) for info in layers}
    out: dict[int, object] = {}
    for module in model.modules():
        if id(module) in selected:
            continue
        if isinstance(module, nn.Linear):
            out[id(module.weight)] = F.linear
        elif isinstance(module, nn.Embedding):
            out[id(module.weight)] = F.embedding
    return out
