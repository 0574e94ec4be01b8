"""The collective side of online selection (:mod:`ingest.online_selection`) under DDP: whether several ranks run,
and the group that gathers every rank's values and averages the corrections."""

from __future__ import annotations

import torch
from torch import nn


def is_ddp(model: nn.Module) -> bool:
    """Whether several ranks run (their gradients then are DDP's average: decide and remove collectively)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Group:
    """The collective side of a decision: gather every rank's values (in rank order), average corrections."""

    def __init__(self, collective: bool) -> None:
        dist = torch.distributed
        self.active = collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.sizes: list[int] | None = None

    def gather(self, values: torch.Tensor | None) -> torch.Tensor | None:
        if not self.active:
            return None if values is None else values.cpu()
        dist = torch.distributed
        present = torch.tensor([0 if values is None else 1])
        dist.all_reduce(present, op=dist.ReduceOp.MIN)
        if not bool(present.item()):
            return None
        values = values.detach().cpu().to(torch.float64)
        if self.sizes is None:
            size = torch.tensor([values.shape[0]])
            sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
            dist.all_gather(sizes, size)
            self.sizes = [int(s) for s in sizes]
        padded = torch.zeros(max(self.sizes), dtype=torch.float64)
        padded[: values.shape[0]] = values
        parts = [torch.zeros_like(padded) for _ in self.sizes]
        dist.all_gather(parts, padded)
        return torch.cat([part[:n] for part, n in zip(parts, self.sizes)])

    def offset(self, local_size: int) -> int:
        if not self.active:
            return 0
        return sum(self.sizes[: torch.distributed.get_rank()])

    def average(self, term: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return term
        dist = torch.distributed
        dist.all_reduce(term)
        return term / dist.get_world_size()
