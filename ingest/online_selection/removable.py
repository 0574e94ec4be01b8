"""Which modules' per-example terms online selection (:mod:`ingest.online_selection`) can remove exactly from
``.grad`` (Linear, dense Embedding, Hugging Face Conv1D), and the refusal of every other trainable parameter, of
such a module's parameter used outside the module's own forward (:class:`OutsideUses`) and of sharded (FSDP)
gradients."""

from __future__ import annotations

from typing import Any

import torch
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


_ACCUMULATE_GRAD = type(torch.zeros(1, requires_grad=True).view(1).grad_fn.next_functions[0][0])


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or nested tuples, lists and dicts, e.g. a ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class OutsideUses:
    """Refuses a selected module's parameter that a captured forward also uses outside that module's own forward.

    The selector removes each example's term of a module's *own* uses (``dy^T x`` of its forward); a parameter read
    elsewhere in the forward (``F.linear(h, self.fc.weight)``, ``h @ self.emb.weight.T``, ``x + self.fc.bias``, a
    weight scaled or transposed first) gets per-example terms the selector cannot see, so a selected step would no
    longer equal a step on the kept examples. Found on the autograd graph: each module call (:meth:`module_ran`)
    marks the nodes its own forward created (from its output back to its input), and at the end of the captured
    forward (:meth:`check`) any other node whose inputs are a selected parameter (its ``AccumulateGrad``) or a node
    inside a module's forward other than its output (autocast's cached cast of the weight) is such a use. A
    parameter used by several modules, each through its own forward (tied embedding and LM head), is not."""

    def __init__(self, model: nn.Module, params: list[torch.Tensor]) -> None:
        self.param_ids = {id(p) for p in params if p.requires_grad}
        self.names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.module_names = {id(m): n or "<root>" for n, m in model.named_modules(remove_duplicate=False)}
        self.inside: dict[Any, nn.Module] = {}  # node -> the module whose forward created it (this forward)
        self.outputs: set[Any] = set()  # the modules' output nodes: where the rest of the forward may use them

    def module_ran(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """Mark the autograd nodes of one call of a selected module (its output back to its inputs)."""
        node = output.grad_fn
        if node is None:
            return
        stop = {t.grad_fn for t in args if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        self.outputs.add(node)
        stack = [node]
        while stack:
            node = stack.pop()
            if node in stop or node in self.inside or type(node) is _ACCUMULATE_GRAD:
                continue
            self.inside[node] = module
            stack.extend(f for f, _ in node.next_functions if f is not None)

    def clear(self) -> None:
        self.inside = {}
        self.outputs = set()

    def check(self, output: Any) -> None:
        """Walk the captured forward's graph from ``output``; raise :class:`ExactRemovalError` at a use of a selected
        parameter outside its module's forward. Clears the marks either way."""
        try:
            stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
            seen = set(stack)
            while stack:
                node = stack.pop()
                outside = node not in self.inside
                for f, _ in node.next_functions:
                    if f is None:
                        continue
                    if type(f) is _ACCUMULATE_GRAD:
                        if outside and id(f.variable) in self.param_ids:
                            self._refuse(node, self.names.get(id(f.variable), "a parameter"))
                        continue
                    if outside and f in self.inside and f not in self.outputs:
                        self._refuse(node, self._behind(f))
                    if f not in seen:
                        seen.add(f)
                        stack.append(f)
        finally:
            self.clear()

    def _behind(self, node: Any) -> str:
        """The selected parameter behind a node inside a module's forward (e.g. autocast's cast of its weight)."""
        stack, seen = [node], {node}
        while stack:
            for f, _ in stack.pop().next_functions:
                if type(f) is _ACCUMULATE_GRAD and id(f.variable) in self.param_ids:
                    return self.names.get(id(f.variable), "a parameter")
                if f is not None and f in self.inside and f not in seen:
                    seen.add(f)
                    stack.append(f)
        return f"a parameter of {self.module_names.get(id(self.inside[node]), 'a selected module')}"

    @staticmethod
    def _refuse(node: Any, name: str) -> None:
        raise ExactRemovalError(
            f"online selection: {name} is also used outside its module's own forward (by {node.name()} in the "
            "captured forward); that use's per-example terms cannot be removed from its gradient, so a selected "
            "step would not equal a step on the kept examples. Route every use of the parameter through its module "
            "(call the module, or tie the parameter to another Linear/Embedding that is called), freeze it "
            "(requires_grad_(False)), or select offline. A penalty on the parameter alone (an L2 term) belongs in "
            "the loss, outside the model's forward"
        )
