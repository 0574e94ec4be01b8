"""Example ids: normalising given ids and hashing example contents."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from ingest.misuse import CaptureUsageError

HASH_PREFIX = "h:"


def normalize_ids(ids: Sequence[Any] | torch.Tensor, batch_size: int | None = None) -> list[str]:
    """Ids as strings; raises ValueError when the count differs from ``batch_size``."""
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    elif isinstance(ids, (str, bytes)):
        raise CaptureUsageError("example ids must be a sequence with one id per example, not a single string")
    out = [str(i) for i in ids]
    if batch_size is not None and len(out) != batch_size:
        raise CaptureUsageError(f"got {len(out)} example ids for a batch of {batch_size} examples")
    return out


def find_inputs(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor identifying the examples: ``input_ids``, ``inputs_embeds``, else the first tensor."""
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def find_mask(kwargs: dict[str, Any], inputs: torch.Tensor | None) -> torch.Tensor | None:
    """``attention_mask`` if it is a ``[B, T]`` mask aligned with ``inputs``, else None."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or inputs is None or mask.dim() != 2:
        return None
    if inputs.dim() < 2 or tuple(mask.shape) != tuple(inputs.shape[:2]):
        return None
    return mask


def content_hashes(inputs: torch.Tensor, mask: torch.Tensor | None) -> list[str]:
    """``"h:" + sha256`` of each example's inputs with padding (``mask == 0``) stripped.

    Hashes the dtype and the bytes of the kept positions, so the same tokens give the same hash
    whatever the padding or the batch they came in. Runs on numpy views of one host copy (no torch op per
    example: it runs on the capture's sink thread, beside the training thread).
    """
    inputs = inputs.detach().cpu().contiguous()
    prefix = str(inputs.dtype).encode()
    values = (inputs.view(torch.int16) if inputs.dtype == torch.bfloat16 else inputs).numpy()  # the same bytes
    keep = mask.detach().cpu().bool().numpy() if mask is not None else None
    return [
        HASH_PREFIX + hashlib.sha256(prefix + (row if keep is None else row[keep[b]]).tobytes()).hexdigest()[:32]
        for b, row in enumerate(values)
    ]
