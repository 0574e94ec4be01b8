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
        d_in, d_out = module.weight.shape
        return LayerInfo(name, module, "conv1d", d_in, d_out, module.bias is not None)
    return None


def select_layers(
    model: nn.Module, layer_types: tuple[str, ...], include: str | None, exclude: str | None
) -> list[LayerInfo]:
    """Supported layers of ``model`` in module order, filtered by kind and name regexes.

    ``include``/``exclude`` are matched with ``re.search`` on the module name. Layers whose weight
    does not require grad (frozen) are skipped.
    """
    found = []
    for name, module in model.named_modules():
        info = layer_info(name, module)
        if info is None or info.kind not in layer_types or not module.weight.requires_grad:
            continue
        if include is not None and not re.search(include, name):
            continue
        if exclude is not None and re.search(exclude, name):
            continue
        found.append(info)
    return found
