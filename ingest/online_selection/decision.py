"""What online selection (:mod:`ingest.online_selection`) decided at one optimizer step."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ingest.ids import content_hashes


@dataclass
class StepDecision:
    """What the selector decided at one optimizer step (this rank's examples, in batch order; ``example_ids``
    are the capture's ids, or content hashes computed when first read)."""

    step: int
    id_sources: list[Any]  # per captured backward: its ids, or the (inputs, mask) its hashes come from
    weights: torch.Tensor  # [n] float64: 1 kept, 0 dropped, else the weight applied
    scores: torch.Tensor | None  # [n] float64
    losses: torch.Tensor | None  # [n] float32
    renormalization: float  # the factor the step's gradient was multiplied by after the removal
    rank: int

    @functools.cached_property
    def example_ids(self) -> list[str]:
        """The examples' ids, in batch order."""
        ids: list[str] = []
        for source in self.id_sources:
            ids.extend(source if isinstance(source, list) else content_hashes(*source))
        return ids

    @property
    def kept(self) -> torch.Tensor:
        """``[n]`` bool: examples whose weight is not 0."""
        return self.weights != 0
