"""Which modules of a model can be captured, and their shapes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LayerInfo:
    """A capturable module: its name, kind and linear-map shape (``d_in -> d_out``)."""

    name: str
    module: nn.Module
    kind: str
    d_in: int
    d_out: int
    has_bias: bool


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def layer_info(name: str, module: nn.Module) -> LayerInfo | None:
    """Describe ``module`` if it is a supported layer (Linear, HF Conv1D, Embedding), else None."""
    if isinstance(module, nn.Linear):
        return LayerInfo(name, module, "linear", module.in_features, module.out_features, module.bias is not None)
    if isinstance(module, nn.Embedding):
        return LayerInfo(name, module, "embedding", module.num_embeddings, module.embedding_dim, False)
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        d_in, d_out = getattr(module, "nx", None), getattr(module, "nf", None)
        if d_in is None or d_out is None:  # FSDP1 (use_orig_params) holds a flat 1-D shard outside forward
            d_in, d_out = module.weight.shape
        return LayerInfo(name, module, "conv1d", d_in, d_out, module.bias is not None)
    return None


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


def select_layers(
    model: nn.Module,
    layer_types: tuple[str, ...],
    include: str | None,
    exclude: str | None,
    include_frozen: bool = False,
) -> list[LayerInfo]:
    """Supported layers of ``model`` in module order, filtered by kind and name regexes.

    Names are the module names without wrapper components (:func:`clean_name`). ``include``/``exclude`` are
    matched with ``re.search`` on them. Layers whose weight does not require grad (frozen, e.g. the base
    layers of a LoRA model) are skipped unless ``include_frozen``.
    """
    found = []
    for raw_name, module in model.named_modules():
        name = clean_name(raw_name)
        info = layer_info(name, module)
        if info is None or info.kind not in layer_types or not (include_frozen or module.weight.requires_grad):
            continue
        if include is not None and not re.search(include, name):
            continue
        if exclude is not None and re.search(exclude, name):
            continue
        found.append(info)
    return found
