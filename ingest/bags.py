"""Packed bags: a batch given as ``nn.EmbeddingBag`` takes it, a flat ``[N]`` tensor of every example's ids one
after the other and ``offsets`` where each example starts (PyTorch's text classification tutorial, recommendation
models), not a tensor with the examples along a dim.

The capture reads such a batch as ``len(offsets)`` examples (one fewer with ``include_last_offset``), each the
ids between its offset and the next: its content hash is that of the same ids given as a padded ``[B, L]``
batch with an attention mask, its token count the bag's length, and the op-level capture
(:mod:`ingest.uses`) follows the flat ids as rows owned by their examples, which the ``embedding_bag`` rule splits
per example. Recognised only where it is unambiguous: the model's first input is a flat integer tensor, the model
has ``nn.EmbeddingBag`` modules (all with the same ``include_last_offset``), and the forward is given valid offsets
into it (the keyword ``offsets``, or the positional argument after the ids): starting at 0, non-decreasing, within
the ids (ending at their count with ``include_last_offset``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class PackedBags:
    """One batch of packed bags: ``tokens [N]`` (the model's flat input), ``offsets`` as given, ``owner [N]`` the
    example of each id and ``lengths [B]`` each example's ids."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    owner: torch.Tensor
    lengths: torch.Tensor

    @property
    def size(self) -> int:
        """The number of examples (bags)."""
        return int(self.lengths.shape[0])

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, L] ids, [B, L] mask)``: the bags as a padded batch (``L`` the longest bag, at least 1), the mask 1
        at the bags' own ids."""
        width = max(int(self.lengths.max()), 1) if self.size else 1
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        position = torch.arange(self.tokens.shape[0], device=self.tokens.device) - starts[self.owner]
        ids = self.tokens.new_zeros(self.size, width)
        mask = torch.zeros(self.size, width, dtype=torch.long, device=self.tokens.device)
        ids[self.owner, position] = self.tokens.detach()
        mask[self.owner, position] = 1
        return ids, mask

    def matches(self, tokens: torch.Tensor, offsets: Any) -> bool:
        """Whether an ``embedding_bag`` call on ``tokens`` with ``offsets`` reads these bags."""
        if not isinstance(offsets, torch.Tensor) or tokens.shape != self.tokens.shape:
            return False
        if offsets is self.offsets:
            return True
        return offsets.shape == self.offsets.shape and bool(torch.equal(offsets.to(self.offsets.device), self.offsets))


def bag_modules(model: nn.Module) -> list[nn.EmbeddingBag]:
    """The model's ``nn.EmbeddingBag`` modules (packed bags are looked for only in a model with one)."""
    return [m for m in model.modules() if isinstance(m, nn.EmbeddingBag)]


def packed_bags(
    modules: list[nn.EmbeddingBag], args: tuple, kwargs: dict[str, Any], main: torch.Tensor | None
) -> PackedBags | None:
    """The batch's packed bags when the forward's ``args``/``kwargs`` give them (see the module's docstring), else
    None (the batch is then read along a dim, as any other)."""
    if not modules or main is None or main.dim() != 1 or main.is_floating_point() or main.dtype == torch.bool:
        return None
    last = {m.include_last_offset for m in modules}
    if len(last) != 1:
        return None
    offsets = _offsets_argument(args, kwargs, main)
    if offsets is None or offsets.dim() != 1 or offsets.is_floating_point() or offsets.dtype == torch.bool:
        return None
    include_last = last.pop()
    n, count = main.shape[0], offsets.shape[0] - (1 if include_last else 0)
    if count < 1:
        return None
    values = offsets.detach().to(main.device, torch.long)
    ends = torch.cat([values[1:], values.new_tensor([n])]) if not include_last else values[1:]
    starts = values[:count]
    valid = (values[0] == 0) & (ends[:count] >= starts).all() & (ends[count - 1] == n) & (values <= n).all()
    if not bool(valid):
        return None
    lengths = ends[:count] - starts
    owner = torch.repeat_interleave(torch.arange(count, device=main.device), lengths)
    return PackedBags(tokens=main, offsets=offsets, owner=owner, lengths=lengths)


def _offsets_argument(args: tuple, kwargs: dict[str, Any], main: torch.Tensor) -> torch.Tensor | None:
    """The ``offsets`` keyword, else the positional argument right after ``main``."""
    if isinstance(kwargs.get("offsets"), torch.Tensor):
        return kwargs["offsets"]
    for i, value in enumerate(args):
        if value is main:
            following = args[i + 1] if i + 1 < len(args) else None
            return following if isinstance(following, torch.Tensor) else None
    return None


def other_values(values: Iterable[Any], bags: PackedBags) -> list[Any]:
    """``values`` without the bags' ids and offsets (the batch's other inputs, marked by their shape)."""
    return [v for v in values if v is not bags.tokens and v is not bags.offsets]
