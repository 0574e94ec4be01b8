"""A user-defined attribution method in one file: an RMS preconditioner (Adam's second moment as the curvature).

``P = diag(mean over the training rows of g^2) + damping`` (absolute damping), scored on the query side,
``(P^-1 q) . g``. Registering it makes ``method="rms"`` work through ``attribute``, ``score_matrix``,
``self_influence``, ``select``, ``build_index``, the CLI and ``gradstore serve`` (for those two: name this module
in ``GRADSTORE_PLUGINS``, e.g. ``GRADSTORE_PLUGINS=custom_method gradstore attribute ...``). docs/extending.md
walks through it.
"""

from __future__ import annotations

import copy
import os

import torch

import gradstore
from indexers import FitStatistics
from indexers.preconditioner import fit_in_passes, float64_blocks, load_state, save_state


class RMSPreconditioner:
    """``P = diag(E[g^2]) + damping``: a streaming fit (one pass, float64 sums), applied elementwise."""

    name = "rms"
    passes = 1

    def __init__(self, damping: float = 1e-3) -> None:
        self.damping = float(damping)
        self.second: torch.Tensor | None = None  # E[g^2] per coordinate, float64

    def fit(self, blocks) -> RMSPreconditioner:
        return fit_in_passes(self, blocks)

    def statistics(self, blocks, stage: int = 0) -> FitStatistics:
        """The sums of squares of these rows (statistics of disjoint rows add up: fits run on shards)."""
        squares, rows = None, 0
        for block in float64_blocks(blocks):
            part = (block * block).sum(0)
            squares = part if squares is None else squares + part
            rows += block.shape[0]
        return FitStatistics(rows, {} if squares is None else {"squares": squares.numpy()})

    def finish(self, statistics: FitStatistics, stage: int = 0) -> RMSPreconditioner:
        self.second = torch.from_numpy(statistics.sums["squares"] / statistics.rows)
        return self

    def with_damping(self, damping: float) -> RMSPreconditioner:
        other = copy.copy(self)
        other.damping = float(damping)
        return other

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        return q / (self.second.to(q.device, q.dtype) + self.damping)

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(self.second.to(x.device, x.dtype) + self.damping)

    def save(self, path: str | os.PathLike) -> None:
        save_state(path, {"name": self.name, "damping": self.damping}, {"second": self.second.numpy()})

    @classmethod
    def load(cls, path: str | os.PathLike) -> RMSPreconditioner:
        config, arrays = load_state(path, cls.name)
        loaded = cls(config["damping"])
        loaded.second = torch.from_numpy(arrays["second"])
        return loaded


RMS = gradstore.register_method(
    "rms", RMSPreconditioner, summary="Adam's second moment as the curvature: (diag(E[g^2]) + damping)^-1 q . g"
)
