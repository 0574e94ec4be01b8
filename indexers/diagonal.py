"""Diagonal preconditioner: the per-coordinate second moment of the gradients."""

from __future__ import annotations

import copy
import os

import numpy as np
import torch

from indexers.blocks import Rows
from indexers.preconditioner import (
    DeviceCache,
    FitStatistics,
    absolute_damping,
    apply_rows,
    check_damping,
    fit_in_passes,
    float64_blocks,
    load_state,
    save_state,
)
from indexers.search_errors import NotFittedError


class DiagonalPreconditioner:
    """``P = diag(v) + damping * mean(v) * I`` with ``v_j = mean_n g_nj^2`` (the diagonal of the Fisher)."""

    name = "diagonal"

    def __init__(self, damping: float = 0.1):
        self.damping = check_damping(damping)
        self.second_moment: torch.Tensor | None = None
        self.n_rows = 0
        self._cache = DeviceCache()

    passes = 1

    def fit(self, blocks: Rows) -> DiagonalPreconditioner:
        """One streaming pass accumulating ``sum g^2`` per coordinate in float64."""
        return fit_in_passes(self, blocks)

    def statistics(self, blocks: Rows, stage: int = 0) -> FitStatistics:
        """``sum g^2`` per coordinate (``squares``) over these rows, float64."""
        total, rows = None, 0
        for block in float64_blocks(blocks):
            squares = block.square().sum(dim=0)
            total = squares if total is None else total + squares
            rows += block.shape[0]
        return FitStatistics(rows, {} if total is None else {"squares": total.numpy()})

    def finish(self, statistics: FitStatistics, stage: int = 0) -> DiagonalPreconditioner:
        """The second moment of the merged sums."""
        if statistics.rows == 0:
            raise ValueError("cannot fit a preconditioner on zero rows")
        self.second_moment = torch.from_numpy(statistics.sums["squares"]) / statistics.rows
        self.n_rows = statistics.rows
        self._cache = DeviceCache()
        return self

    def with_damping(self, damping: float) -> DiagonalPreconditioner:
        """A copy with another damping (sharing the cache of converted weights); no pass over the data."""
        other = copy.copy(self)
        other.damping = check_damping(damping)
        return other

    def _weights(self, power: float) -> torch.Tensor:
        moment = self._fitted()
        return (moment + absolute_damping(self.damping, moment)).pow(-power)

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q / (v + damping * mean(v))``."""
        return apply_rows(q, lambda rows: rows * self._damped_weights(1.0, "query", rows))

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``x / sqrt(v + damping * mean(v))``."""
        return apply_rows(x, lambda rows: rows * self._damped_weights(0.5, "both", rows))

    def _damped_weights(self, power: float, variant: str, like: torch.Tensor) -> torch.Tensor:
        return self._cache.get_damped("w", variant, self.damping, lambda: self._weights(power), like)

    def _fitted(self) -> torch.Tensor:
        if self.second_moment is None:
            raise NotFittedError("fit the diagonal preconditioner before applying or saving it")
        return self.second_moment

    def save(self, path: str | os.PathLike) -> None:
        """Write damping, row count and the second moments."""
        config = {"name": self.name, "damping": self.damping, "n_rows": self.n_rows}
        save_state(path, config, {"second_moment": self._fitted().numpy()})

    @classmethod
    def load(cls, path: str | os.PathLike) -> DiagonalPreconditioner:
        """Read a saved diagonal preconditioner."""
        config, arrays = load_state(path, cls.name)
        loaded = cls(damping=config["damping"])
        loaded.second_moment = torch.from_numpy(np.asarray(arrays["second_moment"], dtype=np.float64))
        loaded.n_rows = config["n_rows"]
        return loaded
