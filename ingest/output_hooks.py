"""Hooks on the gradient of an op's or a layer's output that survive the model modifying that output in place.

``F.linear`` with a bias on a ``[B, T, d]`` input returns ``addmm``'s ``[B x T, d_out]`` result *viewed* as
``[B, T, d_out]``. A hook registered on such a view is lost when the model then modifies the view in place
(``F.relu(h, inplace=True)``, ``h += x``, ``h[mask] = v``, ``h.mul_(s)``): autograd rebuilds the view's history
and never calls it, so the layer's rows stay silently zero. Registered on the view's base instead, the hook
receives the gradient of the output before the modification, whether or not one happens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def on_gradient(output: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> None:
    """Call ``hook`` with the gradient of ``output`` (as ``Tensor.register_hook`` does), at its base where
    ``output`` is a reshaping view of a whole tensor (see the module's docstring)."""
    base = output._base
    whole = (
        base is not None
        and base.requires_grad
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
        and output.storage_offset() == base.storage_offset()
    )
    if not whole:
        output.register_hook(hook)
        return
    base.register_hook(_Reshaped(hook, output.shape, base.shape))


class _Reshaped:
    """``hook`` called with its base's gradient in the view's shape (a replacement it returns in the base's)."""

    def __init__(self, hook: Callable[[torch.Tensor], Any], shape: torch.Size, base_shape: torch.Size) -> None:
        self.hook, self.shape, self.base_shape = hook, shape, base_shape

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        replaced = self.hook(grad.reshape(self.shape))
        return None if replaced is None else replaced.reshape(self.base_shape)
