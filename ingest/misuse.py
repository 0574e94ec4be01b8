"""The error a capture raises when it is used in a way it cannot work (not a data condition): no layer to
capture, ids that do not match the batch, a loss reduction the model's inputs cannot support, an invalid
option. gradstore re-raises it as its own ``CaptureUsageError`` (an ``InvalidArgumentError``)."""

from __future__ import annotations


class CaptureUsageError(ValueError):
    """A capture used in a way it cannot work; the message says what to change."""
