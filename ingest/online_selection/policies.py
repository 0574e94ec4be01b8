"""Selection policies (:mod:`ingest.online_selection`): for the examples of one step, a weight per example from
their scores or losses (keep the top fraction, drop below a threshold, keep by loss, keep at random)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ingest.misuse import CaptureUsageError


class SelectionPolicy(Protocol):
    """Decides, for the ``n`` examples of one step, a weight per example: ``True``/1 keep, ``False``/0 drop, or any
    float (reweight). ``scores``: ``[n]`` float64 (``None`` when no target was given); ``losses``: ``[n]`` float32
    per-example losses (``None`` without ``per_example_loss``)."""

    needs_scores: bool
    needs_loss: bool

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor: ...


def _fraction(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise CaptureUsageError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _top(values: torch.Tensor, fraction: float, largest: bool) -> torch.Tensor:
    n = values.shape[0]
    count = max(1, round(fraction * n)) if n else 0
    top = torch.topk(values.cpu(), count, largest=largest, sorted=False).indices
    return torch.zeros(n, dtype=torch.bool).index_fill_(0, top, True)


@dataclass(frozen=True)
class KeepTopFraction:
    """Keep the ``fraction`` of the step's examples with the highest scores (at least one)."""

    fraction: float
    needs_scores: bool = True
    needs_loss: bool = False

    def __post_init__(self) -> None:
        _fraction(self.fraction, "KeepTopFraction.fraction")

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: the top ``fraction`` by score."""
        return _top(scores, self.fraction, largest=True)


@dataclass(frozen=True)
class DropBelowThreshold:
    """Drop the examples whose score is below ``threshold`` (all may be dropped: the step's gradient is then 0).
    ``threshold``: a number, not NaN (every comparison with NaN is false: everything would be dropped); ``-inf``
    keeps every example, ``+inf`` drops every one."""

    threshold: float
    needs_scores: bool = True
    needs_loss: bool = False

    def __post_init__(self) -> None:
        value = self.threshold
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise CaptureUsageError(
                f"DropBelowThreshold.threshold must be a number, not NaN (NaN compares false with every score, so "
                f"every example would be dropped), got {self.threshold!r}: pass a finite threshold (or -inf to keep "
                "every example, +inf to drop every one)"
            )

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: score >= threshold."""
        return (scores >= self.threshold).cpu()


@dataclass(frozen=True)
class LossBased:
    """Baseline without gradients: keep the ``fraction`` of examples with the lowest loss (``keep="low"``, the
    small-loss rule against label noise) or the highest (``keep="high"``, hard-example mining). Needs the
    capture's ``per_example_loss``."""

    fraction: float
    keep: str = "low"
    needs_scores: bool = False
    needs_loss: bool = True

    def __post_init__(self) -> None:
        _fraction(self.fraction, "LossBased.fraction")
        if self.keep not in ("low", "high"):
            raise CaptureUsageError(f"LossBased.keep must be 'low' or 'high', got {self.keep!r}")

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: the ``fraction`` lowest (or highest) losses."""
        return _top(losses, self.fraction, largest=self.keep == "high")


@dataclass(frozen=True)
class RandomSelection:
    """Keep a uniformly random ``fraction`` of the step's examples (the comparison baseline); seeded by the
    selector's ``seed``."""

    fraction: float
    needs_scores: bool = False
    needs_loss: bool = False

    def __post_init__(self) -> None:
        _fraction(self.fraction, "RandomSelection.fraction")

    def decide(
        self, n: int, scores: torch.Tensor | None, losses: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """Keep mask: a random ``fraction``."""
        return _top(torch.rand(n, generator=generator, dtype=torch.float64), self.fraction, largest=True)
