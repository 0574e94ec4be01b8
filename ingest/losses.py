"""Per-example loss functions to pass as ``GradientCapture(per_example_loss=...)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ingest.scaling import IGNORE_INDEX


def causal_lm_loss(outputs: Any, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """Each example's mean next-token cross-entropy over its non-ignored labels: ``[B]``.

    Matches the Hugging Face causal-LM loss of the example alone (labels shifted by one, ``-100``
    ignored); an example without label tokens gets 0.
    """
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    labels = kwargs["labels"]
    logits = logits[:, :-1].float()
    targets = labels[:, 1:].to(logits.device)
    token_loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)
    counts = (targets != IGNORE_INDEX).sum(dim=1)
    return token_loss.sum(dim=1) / counts.clamp(min=1)


def sample_labels(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Labels drawn from the model's own predictive distribution ``softmax(logits)`` over the last dimension
    (one per position, no gradient): the loss on them backpropagates true-Fisher (GGN) rows, the curvature rows
    of split ``"true-fisher"``. Positions whose logits are not finite get label 0."""
    probabilities = torch.softmax(logits.detach().float(), dim=-1)
    flat = probabilities.reshape(-1, probabilities.shape[-1])
    finite = torch.isfinite(flat).all(dim=1)
    flat = torch.where(finite[:, None], flat, torch.ones_like(flat))
    return torch.multinomial(flat, 1, generator=generator).reshape(probabilities.shape[:-1])
