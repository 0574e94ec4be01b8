"""What online selection (:mod:`ingest.online_selection`) scores examples against: a fixed ``[dim]`` vector, a
scoring function, or a :class:`RefreshedTarget` that follows training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ingest.capture import GradientCapture
from ingest.misuse import CaptureUsageError

Target = torch.Tensor | Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None


class RefreshedTarget:
    """A target that follows training: the mean captured row of ``loss_fn(model, batch)`` over ``batches`` (a
    validation or trusted set; a sequence, or a function returning an iterable of batches), recomputed every
    ``every`` decisions, with the capture's own projection. Pass it as ``target=``.

    The pass uses ``torch.autograd.grad`` (the training gradient in ``.grad`` is not touched) under a second
    capture while ``capture`` is paused; ``loss_reduction`` says how ``loss_fn`` reduces its batch (rows are
    per-example gradients either way). ``similarity``: ``"dot"`` or ``"cosine"`` (each row normalised).
    ``refreshes`` counts the passes. One process: under DDP give it the unwrapped module's loss.
    """

    def __init__(
        self,
        capture: GradientCapture,
        batches: Any,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        every: int = 10,
        loss_reduction: str = "mean",
        similarity: str = "dot",
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CaptureUsageError(f"RefreshedTarget.every must be a positive integer, got {every!r}")
        if similarity not in ("dot", "cosine"):
            raise CaptureUsageError(f"similarity must be 'dot' or 'cosine', got {similarity!r}")
        self.capture = capture
        self.batches = batches
        self.loss_fn = loss_fn
        self.every = every
        self.loss_reduction = loss_reduction
        self.similarity = similarity
        self.vector: torch.Tensor | None = None
        self.refreshes = 0
        self._calls = 0

    def refresh(self) -> torch.Tensor:
        """Recompute the target now: the ``[dim]`` float32 mean row of the batches."""
        from ingest.capture import CaptureConfig

        rows: list[torch.Tensor] = []
        model = self.capture.model
        params = [p for p in model.parameters() if p.requires_grad]
        config = CaptureConfig(projection=self.capture.config.projection, loss_reduction=self.loss_reduction)
        batches = self.batches() if callable(self.batches) else self.batches
        with self.capture.paused(), GradientCapture(model, lambda b: rows.append(b.grads), config):
            for batch in batches:
                torch.autograd.grad(self.loss_fn(model, batch), params, allow_unused=True)
        if not rows:
            raise CaptureUsageError("RefreshedTarget: the batches produced no captured rows (empty batches?)")
        self.vector = torch.cat(rows).mean(0)
        self.refreshes += 1
        return self.vector

    def __call__(self, rows: torch.Tensor, losses: torch.Tensor | None) -> torch.Tensor:
        """Scores of ``rows`` against the target (refreshed first when due)."""
        if self.vector is None or self._calls % self.every == 0:
            self.refresh()
        self._calls += 1
        target = self.vector.to(rows.device, rows.dtype)
        scores = rows @ target
        if self.similarity == "cosine":
            scores = scores / rows.norm(dim=1).clamp(min=1e-30)
        return scores
