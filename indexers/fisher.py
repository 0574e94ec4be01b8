"""Projected Fisher / GGN preconditioner, block-diagonal over the layer blocks of the projected vector."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from indexers.blocks import Rows
from indexers.errors import NotFittedError
from indexers.preconditioner import (
    DeviceCache,
    FitStatistics,
    absolute_damping,
    apply_rows,
    check_damping,
    check_tiling,
    fit_in_passes,
    float64_blocks,
    load_state,
    save_state,
)


class FisherPreconditioner:
    """``P_b = G_b^T G_b / n + damping * mean(eig(G_b^T G_b / n)) * I`` for each block ``b``.

    ``blocks`` lists ``(offset, size)`` per layer block of the projected vector and must tile it; ``None``
    means one full ``dim x dim`` block. The damping is relative to the mean eigenvalue of each block. The
    eigendecomposition is kept, so :meth:`with_damping` re-damps without another pass over the data.
    """

    name = "fisher"

    def __init__(self, damping: float = 0.1, blocks: Sequence[tuple[int, int]] | None = None):
        self.damping = check_damping(damping)
        self.blocks = None if blocks is None else [(int(offset), int(size)) for offset, size in blocks]
        self.dim: int | None = None
        self.n_rows = 0
        self.eigenvalues: list[torch.Tensor] = []
        self.eigenvectors: list[torch.Tensor] = []
        self._cache = DeviceCache()

    passes = 1

    def fit(self, blocks: Rows) -> FisherPreconditioner:
        """One streaming pass accumulating ``G_b^T G_b`` per block in float64, then an eigendecomposition."""
        return fit_in_passes(self, blocks)

    def statistics(self, blocks: Rows, stage: int = 0) -> FitStatistics:
        """``G_b^T G_b`` per block (``gram_<b>``) over these rows, float64."""
        grams: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []
        rows = 0
        for block in float64_blocks(blocks):
            if not grams:
                spans = self.blocks if self.blocks is not None else [(0, block.shape[1])]
                check_tiling(spans, block.shape[1], "Fisher blocks")
                grams = [torch.zeros(size, size, dtype=torch.float64) for _, size in spans]
            for gram, (offset, size) in zip(grams, spans, strict=True):
                part = block[:, offset : offset + size]
                gram.addmm_(part.T, part)
            rows += block.shape[0]
        return FitStatistics(rows, {f"gram_{index}": gram.numpy() for index, gram in enumerate(grams)})

    def finish(self, statistics: FitStatistics, stage: int = 0) -> FisherPreconditioner:
        """Eigendecompose each block of the merged ``G^T G / n``."""
        rows = statistics.rows
        if rows == 0:
            raise ValueError("cannot fit a preconditioner on zero rows")
        grams = [torch.from_numpy(statistics.sums[f"gram_{index}"]) for index in range(len(statistics.sums))]
        self.dim = sum(gram.shape[0] for gram in grams)
        self.n_rows, self.eigenvalues, self.eigenvectors = rows, [], []
        for gram in grams:
            values, vectors = torch.linalg.eigh(gram / rows)
            self.eigenvalues.append(values.clamp_min(0.0))
            self.eigenvectors.append(vectors)
        self._cache = DeviceCache()
        return self

    def with_damping(self, damping: float) -> FisherPreconditioner:
        """A copy with another damping, sharing the eigendecomposition (no pass over the data)."""
        other = copy.copy(self)
        other.damping, other._cache = check_damping(damping), DeviceCache()
        return other

    def _spans(self) -> list[tuple[int, int]]:
        if self.dim is None:
            raise NotFittedError("fit the Fisher preconditioner before applying or saving it")
        return self.blocks if self.blocks is not None else [(0, self.dim)]

    def _matrix(self, index: int, power: float) -> torch.Tensor:
        """``(Lambda + damping)^-power`` in the original basis, as a dense ``[size, size]`` matrix."""
        values, vectors = self.eigenvalues[index], self.eigenvectors[index]
        weights = (values + absolute_damping(self.damping, values)).pow(-power)
        return (vectors * weights) @ vectors.T

    def _apply(self, x: torch.Tensor, power: float, variant: str) -> torch.Tensor:
        spans = self._spans()

        def transform(rows: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(rows)
            for index, (offset, size) in enumerate(spans):
                matrix = self._cache.get(f"m{index}", variant, partial(self._matrix, index, power), rows)
                out[:, offset : offset + size] = rows[:, offset : offset + size] @ matrix
            return out

        return apply_rows(x, transform)

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        """``P^-1 q`` block by block."""
        return self._apply(q, 1.0, "query")

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 x`` block by block (the symmetric square root)."""
        return self._apply(x, 0.5, "both")

    def save(self, path: str | os.PathLike) -> None:
        """Write damping, blocks, row count and the per-block eigendecompositions."""
        spans = self._spans()
        config = {
            "name": self.name,
            "damping": self.damping,
            "blocks": self.blocks,
            "dim": self.dim,
            "n_rows": self.n_rows,
        }
        arrays = {}
        for index in range(len(spans)):
            arrays[f"eigenvalues_{index}"] = self.eigenvalues[index].numpy()
            arrays[f"eigenvectors_{index}"] = self.eigenvectors[index].numpy()
        save_state(path, config, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> FisherPreconditioner:
        """Read a saved Fisher preconditioner."""
        config, arrays = load_state(path, cls.name)
        loaded = cls(damping=config["damping"], blocks=config["blocks"])
        loaded.dim, loaded.n_rows = config["dim"], config["n_rows"]
        for index in range(len(loaded._spans())):
            loaded.eigenvalues.append(torch.from_numpy(np.asarray(arrays[f"eigenvalues_{index}"], np.float64)))
            loaded.eigenvectors.append(torch.from_numpy(np.asarray(arrays[f"eigenvectors_{index}"], np.float64)))
        return loaded
