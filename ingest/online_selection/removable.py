"""Which modules' per-example terms online selection (:mod:`ingest.online_selection`) can remove exactly from
``.grad`` (Linear, dense Embedding, Hugging Face Conv1D), and the refusal of every other trainable parameter and of
sharded (FSDP) gradients."""

from __future__ import annotations

from torch import nn

from ingest.layers import _conv1d_class, _stock_forward
from ingest.misuse import CaptureUsageError


class ExactRemovalError(CaptureUsageError):
    """The model has trainable parameters whose per-example contributions cannot be removed exactly."""


def removal_kind(module: nn.Module) -> str | None:
    """How a module's per-example contributions are removed (``"linear"``, ``"conv1d"``, ``"embedding"``), or
    ``None`` when they cannot be removed exactly: another module type, or a subclass with a forward of its own
    (its weight gradient need not be ``dy^T x``)."""
    if isinstance(module, nn.Linear):
        return "linear" if _stock_forward(module, nn.Linear) else None
    if isinstance(module, nn.Embedding) and not module.sparse and module.max_norm is None:
        return "embedding" if _stock_forward(module, nn.Embedding) else None
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d" if _stock_forward(module, conv1d) else None
    return None


def removable_modules(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The modules of ``model`` with trainable parameters and how each one's terms are removed; raises
    :class:`ExactRemovalError` when any of them cannot be removed exactly."""
    found, refused = [], []
    for name, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        kind = removal_kind(module)
        if kind is None or any(n not in ("weight", "bias") for n in own):
            refused.append(f"{name or '<root>'} ({type(module).__name__})")
        else:
            found.append((module, kind))
    if refused:
        raise ExactRemovalError(
            "online selection removes dropped examples' exact contributions from Linear, Embedding (dense, no "
            "max_norm) and Conv1D layers (with their own forward, not a subclass's) only; these modules with "
            f"trainable parameters are not such layers: {refused[:8]}"
            f"{' ...' if len(refused) > 8 else ''}. Freeze them (requires_grad_(False)) or select offline"
        )
    if not found:
        raise ExactRemovalError("online selection: the model has no trainable parameters")
    return found


def refuse_sharded(model: nn.Module) -> None:
    """FSDP shards parameters and gradients: the saved factors' terms do not fit the local gradient shard."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return
    for module in model.modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            raise ExactRemovalError(
                "online selection removes examples' terms from full gradients; FSDP shards them: train with "
                "DistributedDataParallel (or one process), or select offline"
            )
