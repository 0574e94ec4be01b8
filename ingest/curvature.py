"""Kronecker-factor curvature statistics: second moments of projected inputs and output gradients.

For every captured token ``t`` of every example ``b`` (padding excluded when an attention mask is
known) a layer adds ``a a^T`` to ``A`` and ``s s^T`` to ``S``, where ``a = P_in [x_t, 1]`` and
``s = c_b P_out dy_t`` (``c_b`` the per-example scale of :mod:`ingest.scaling`). Sums are kept in
float64 on the training device; :meth:`CurvatureStats.result` returns the token means and the count.

A capture keeps one accumulator per checkpoint and split of :data:`CURVATURE_SPLITS`: the training rows give
the empirical Fisher's factors, the ``"true-fisher"`` rows (losses on labels sampled from the model,
:func:`ingest.losses.sample_labels`) the true Fisher's, which K-FAC and EK-FAC prefer where a checkpoint has them.
"""

from __future__ import annotations

import numpy as np
import torch

#: The split of true-Fisher rows: gradients of losses on labels sampled from the model's own predictive distribution.
TRUE_FISHER_SPLIT = "true-fisher"
#: The splits whose rows describe the training loss's curvature; each accumulates its own Kronecker factors.
CURVATURE_SPLITS = ("train", TRUE_FISHER_SPLIT)


class CurvatureStats:
    """Running float64 sums of ``a a^T`` and ``s s^T`` per layer."""

    def __init__(self) -> None:
        self._sums: dict[str, list[torch.Tensor]] = {}

    def add(self, layer: str, x_p: torch.Tensor, dy_p: torch.Tensor, token_mask: torch.Tensor | None) -> None:
        """Accumulate ``x_p: [B, T, k_in]`` and (already scaled) ``dy_p: [B, T, k_out]``."""
        a = x_p.detach().reshape(-1, x_p.shape[-1]).double()
        s = dy_p.detach().reshape(-1, dy_p.shape[-1]).double()
        if token_mask is not None:
            keep = token_mask.reshape(-1).to(device=a.device, dtype=torch.float64)
            count = keep.sum()
            a_w = a * keep.unsqueeze(1)
            s_w = s * keep.unsqueeze(1)
        else:
            count = torch.tensor(float(a.shape[0]), dtype=torch.float64, device=a.device)
            a_w, s_w = a, s
        update = [a_w.T @ a, s_w.T @ s, count]
        if layer in self._sums:
            for total, part in zip(self._sums[layer], update):
                total += part
        else:
            self._sums[layer] = update

    def result(self) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
        """``layer -> (A [k_in, k_in], S [k_out, k_out], token count)``, A and S as token means."""
        out = {}
        for layer, (a, s, count) in self._sums.items():
            n = int(count.item())
            denom = max(n, 1)
            out[layer] = ((a / denom).cpu().numpy(), (s / denom).cpu().numpy(), n)
        return out
