"""Undo the loop's loss reduction so per-example gradients do not depend on their batch.

The per-example gradient we record is the gradient of *that example's own loss*:

* ``"sum"``: the loop's loss is a sum of per-example losses; scale 1.
* ``"mean"``: the loop's loss is the batch mean; scale ``B``.
* ``"token_mean"``: a Hugging Face model's loss, the mean over all non-ignored label tokens of the
  batch (``-100`` ignored, or divided by ``num_items_in_batch`` when the model is given it); a causal
  LM's labels are shifted by one (its first label predicts nothing), a masked LM's, a token
  classifier's or a sequence-to-sequence model's are not (:func:`shifts_labels`). The example's own
  loss is the mean over its own label tokens, so the scale is ``N_batch / n_i`` (0 for an example
  without label tokens, whose gradient is 0).

All scales are finally divided by ``loss_scale`` (a constant the loop multiplies its loss with,
e.g. ``1 / grad_accum_steps``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ingest.misuse import CaptureUsageError

REDUCTIONS = ("mean", "token_mean", "sum")
IGNORE_INDEX = -100


def label_token_counts(labels: torch.Tensor, shifted: bool = True) -> torch.Tensor:
    """Label tokens that count in the loss, per example: ``[B]`` int64 (``shifted``: a causal LM's)."""
    return ((labels[:, 1:] if shifted else labels) != IGNORE_INDEX).sum(dim=1)


def shifts_labels(model: Any) -> bool:
    """Whether ``model``'s ``"token_mean"`` loss shifts its labels: a causal LM's (``*ForCausalLM``,
    ``*LMHeadModel``, also wrapped by DDP or peft) does; another Hugging Face model's (a masked LM, a token
    classifier, a sequence-to-sequence model) does not; a model that is not Hugging Face's is taken as a causal
    LM's (the loss ``"token_mean"`` describes)."""
    chain, seen = [], set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        chain.append(model)
        inner = getattr(model, "module", None)  # DDP / FSDP
        if inner is None and callable(getattr(model, "get_base_model", None)):  # peft
            inner = model.get_base_model()
        model = inner
    if any(type(m).__name__.endswith(("ForCausalLM", "LMHeadModel")) for m in chain):
        return True
    return not any(_hugging_face(m) for m in chain)


def _hugging_face(model: Any) -> bool:
    """Whether ``model`` is a transformers model (imports nothing: a model of it has imported its modeling_utils,
    ~50 MB that a capture of another model need not load)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def example_token_counts(inputs: torch.Tensor | None, mask: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """``num_tokens`` metadata: attention-mask sum, else sequence length for token ids, else 1."""
    if mask is not None:
        return mask.sum(dim=1).to(torch.int32)
    if inputs is not None and inputs.dim() >= 2 and not inputs.is_floating_point():
        return torch.full((batch_size,), inputs.shape[1], dtype=torch.int32, device=inputs.device)
    return torch.ones(batch_size, dtype=torch.int32)


def examples_first(kwargs: dict[str, Any], dim: int) -> dict[str, Any]:
    """``kwargs`` with its ``labels`` moved to examples-first when the model's inputs index the examples along
    ``dim`` (a sequence-first model's ``[T, B]`` labels)."""
    labels = kwargs.get("labels")
    if not dim or not isinstance(labels, torch.Tensor) or labels.dim() <= dim:
        return kwargs
    return {**kwargs, "labels": labels.movedim(dim, 0)}


def example_scales(
    reduction: str,
    batch_size: int,
    kwargs: dict[str, Any],
    loss_scale: float,
    device: torch.device,
    shifted: bool = True,
) -> torch.Tensor:
    """Per-example factors ``[B]`` (float32, on ``device``) turning captured rows into per-example grads
    (``shifted``: whether a ``"token_mean"`` loss shifts its labels, :func:`shifts_labels`)."""
    if reduction == "sum":
        scales = torch.ones(batch_size, device=device)
    elif reduction == "mean":
        scales = torch.full((batch_size,), float(batch_size), device=device)
    elif reduction == "token_mean":
        labels = kwargs.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
            raise CaptureUsageError("loss_reduction='token_mean' needs a [B, T] `labels` tensor among the model kwargs")
        counts = label_token_counts(labels, shifted).to(device=device, dtype=torch.float32)
        total = kwargs.get("num_items_in_batch")
        total = counts.sum() if total is None else torch.as_tensor(total, device=device, dtype=torch.float32)
        scales = torch.where(counts > 0, total / counts.clamp(min=1), torch.zeros_like(counts))
    else:
        raise CaptureUsageError(f"loss_reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return scales / loss_scale
