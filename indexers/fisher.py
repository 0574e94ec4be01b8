"""Projected Fisher / GGN preconditioner, block-diagonal over the layer blocks of the projected vector."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from indexers.blocks import Rows
from indexers.preconditioner import (
    STACKED,
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
from indexers.search_errors import NotFittedError


class FisherPreconditioner:
    """``P_b = G_b^T G_b / n + damping * mean(eig(G_b^T G_b / n)) * I`` for each block ``b``.

    ``blocks`` lists ``(offset, size)`` per layer block of the projected vector and must tile it; ``None``
    means one full ``dim x dim`` block. The damping is relative to the mean eigenvalue of each block.

    Only the eigendecomposition ``V diag(lambda) V^T`` of each block is kept, and applying works in it:
    ``P^-p x = V diag((lambda + d)^-p) V^T x`` with ``d`` the absolute damping (``p = 1`` for queries, ``1/2``
    for both sides). With fewer rows ``n`` than a block's size, the block has rank ``<= n``: only its top ``n``
    eigenpairs are kept, and the damping alone acts on the rest of the space,
    ``P^-p x = d^-p x + V diag((lambda + d)^-p - d^-p) V^T x`` (exact; at zero damping the rest is left out, a
    pseudo-inverse). :meth:`with_damping` re-damps without a pass over the data and shares the converted
    eigenvectors (:class:`DeviceCache`), so neither a new damping nor a repeat call builds a dense matrix. Only a
    call applying to more rows than a block holds (stored rows on both sides; the choice depends on the call's
    shape alone, never on what is cached) multiplies by the dense ``P^-p`` of that block, built once per damping
    and kept in the shared cache. The low-rank formula's two terms cancel to about the relative damping inside the
    rows' span (float32 eigenvectors there erred by ``2^-24 / damping``), so a low-rank block keeps float64
    eigenvectors, saved too, and is applied in float64 whatever the input; a full-rank block is saved with float32
    eigenvectors (what applying to float32 vectors uses anyway; a fit keeps them in float64 until it is saved).
    Eigenvalues are float64.
    """

    name = "fisher"

    def __init__(self, damping: float = 0.1, blocks: Sequence[tuple[int, int]] | None = None):
        self.damping = check_damping(damping)
        self.blocks = None if blocks is None else [(int(offset), int(size)) for offset, size in blocks]
        self.dim: int | None = None
        self.n_rows = 0
        self.eigenvalues: list[torch.Tensor] = []  # per block, the kept ones (ascending), float64
        self.eigenvectors: list[
            torch.Tensor
        ] = []  # per block, [size, kept]: float64 (float32 once a full one is saved)
        self._cache = DeviceCache()

    passes = 1

    def fit(self, blocks: Rows) -> FisherPreconditioner:
        """One streaming pass accumulating ``G_b^T G_b`` per block in float64, then an eigendecomposition."""
        return fit_in_passes(self, blocks)

    def statistics(self, blocks: Rows, stage: int = 0) -> FitStatistics:
        """Per block, float64: the rows themselves (``stack_rows_<b>``) while there are fewer than the block's size,
        else ``G_b^T G_b`` (``gram_<b>``)."""
        spans: list[tuple[int, int]] = []
        stacks: list[list[torch.Tensor]] = []
        grams: list[torch.Tensor | None] = []
        rows = 0
        for block in float64_blocks(blocks):
            if not spans:
                spans = self.blocks if self.blocks is not None else [(0, block.shape[1])]
                check_tiling(spans, block.shape[1], "Fisher blocks")
                stacks, grams = [[] for _ in spans], [None] * len(spans)
            rows += block.shape[0]
            for index, (offset, size) in enumerate(spans):
                stacks[index].append(block[:, offset : offset + size])
                if rows >= size:  # the sum is now the smaller: fold the stacked rows into it
                    part = torch.cat(stacks[index])
                    stacks[index] = []
                    gram = grams[index]
                    grams[index] = part.T @ part if gram is None else gram.addmm_(part.T, part)
        sums = {f"gram_{index}": gram.numpy() for index, gram in enumerate(grams) if gram is not None}
        sums |= {f"{STACKED}rows_{index}": torch.cat(stack).numpy() for index, stack in enumerate(stacks) if stack}
        return FitStatistics(rows, sums)

    def finish(self, statistics: FitStatistics, stage: int = 0) -> FisherPreconditioner:
        """Eigendecompose each block of the merged ``G^T G / n``, keeping its top ``min(n, size)`` eigenpairs
        (an empirical Fisher of ``n`` rows has rank ``<= n``). A block with fewer rows than its size is
        decomposed through the ``n x n`` Gram matrix ``G G^T / n`` (same nonzero eigenvalues; eigenvectors
        ``G^T u / sqrt(n mu)``): seconds instead of a ``size^3`` eigendecomposition."""
        rows = statistics.rows
        if rows == 0:
            raise ValueError("cannot fit a preconditioner on zero rows")
        blocks = sorted({int(key.rsplit("_", 1)[1]) for key in statistics.sums})
        self.n_rows, self.eigenvalues, self.eigenvectors = rows, [], []
        sizes = []
        for index in blocks:
            gram = statistics.sums.get(f"gram_{index}")
            stack = statistics.sums.get(f"{STACKED}rows_{index}")
            if gram is None:
                values, vectors = _small_gram_eigh(torch.from_numpy(stack), rows)
            else:
                gram = torch.from_numpy(gram).clone()
                if stack is not None:
                    part = torch.from_numpy(stack)
                    gram.addmm_(part.T, part)
                values, vectors = torch.linalg.eigh(gram / rows)
                kept = min(rows, gram.shape[0])
                values, vectors = values[-kept:].clamp_min(0.0).contiguous(), vectors[:, -kept:].contiguous()
            sizes.append(vectors.shape[0])
            self.eigenvalues.append(values)
            self.eigenvectors.append(vectors)
        self.dim = sum(sizes)
        self._cache = DeviceCache()
        return self

    def with_damping(self, damping: float) -> FisherPreconditioner:
        """A copy with another damping, sharing the eigendecomposition and the cache of its converted copies
        (no pass over the data, nothing rebuilt for a damping used before)."""
        other = copy.copy(self)
        other.damping = check_damping(damping)
        return other

    def _spans(self) -> list[tuple[int, int]]:
        if self.dim is None:
            raise NotFittedError("fit the Fisher preconditioner before applying or saving it")
        return self.blocks if self.blocks is not None else [(0, self.dim)]

    def _shifts(self, index: int, power: float) -> tuple[torch.Tensor, float]:
        """``(weights, rest)``: ``(lambda + d)^-power`` of the kept eigenpairs (float64) and ``d^-power``, the
        weight of the space they leave out (0 when nothing is left out, or at zero damping)."""
        values, size = self.eigenvalues[index], self._spans()[index][1]
        shift = absolute_damping(self.damping, values, size)
        weights = (values + shift).pow(-power)
        if values.numel() == size or shift <= 0:
            return weights, 0.0
        rest = shift**-power
        return weights - rest, rest

    def _matrix(self, index: int, power: float) -> torch.Tensor:
        """``P_b^-power`` as a dense ``[size, size]`` float64 matrix (for calls on many rows; cached per damping)."""
        weights, rest = self._shifts(index, power)
        vectors = self.eigenvectors[index].to(torch.float64)
        matrix = (vectors * weights) @ vectors.T
        if rest:
            matrix.diagonal().add_(rest)
        return matrix

    def _apply_block(self, index: int, x: torch.Tensor, power: float, variant: str) -> torch.Tensor:
        """``P_b^-power x`` for one block's columns ``x [m, size]``, in ``x``'s compute dtype; a low-rank block is
        applied in float64 whatever ``x`` is (its two terms cancel in the kept eigenvectors' span)."""
        size, rank = x.shape[1], self.eigenvectors[index].shape[1]
        if rank < size and x.dtype != torch.float64:
            return self._apply_block(index, x.to(torch.float64), power, variant).to(x.dtype)
        if x.shape[0] * (2 * rank - size) >= size * rank > 0:  # many rows: the dense matrix costs less in all
            matrix = self._cache.get_damped(f"m{index}", variant, self.damping, partial(self._matrix, index, power), x)
            return x @ matrix
        vectors = self._cache.get(f"v{index}", "", lambda: self.eigenvectors[index], x)
        weights = self._cache.get_damped(f"w{index}", variant, self.damping, lambda: self._shifts(index, power)[0], x)
        out = ((x @ vectors) * weights) @ vectors.T
        rest = self._shifts(index, power)[1]
        return out.add_(x, alpha=rest) if rest else out

    def _apply(self, x: torch.Tensor, power: float, variant: str) -> torch.Tensor:
        spans = self._spans()

        def transform(rows: torch.Tensor) -> torch.Tensor:
            if len(spans) == 1:
                return self._apply_block(0, rows, power, variant)
            out = torch.empty_like(rows)
            for index, (offset, size) in enumerate(spans):
                out[:, offset : offset + size] = self._apply_block(
                    index, rows[:, offset : offset + size], power, variant
                )
            return out

        return apply_rows(x, transform)

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        """``P^-1 q`` block by block."""
        return self._apply(q, 1.0, "query")

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 x`` block by block (the symmetric square root)."""
        return self._apply(x, 0.5, "both")

    def apply_function(self, x: torch.Tensor, function: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``f(F_b) x`` block by block for a spectral function ``f`` of the *undamped* fitted ``F_b = G^T G / n``
        (float64): ``V f(lambda) V^T x + f(0) (x - V V^T x)``, the second term over the space a low-rank fit
        leaves out (eigenvalue 0). ``function`` maps a float64 tensor of eigenvalues to their values; SOURCE's
        segment terms (``exp(-c F)``, ``(I - exp(-c F)) F^-1``) are such functions."""
        spans = self._spans()
        x = x.to(torch.float64)
        out = torch.empty_like(x)
        at_zero = float(function(torch.zeros(1, dtype=torch.float64))[0])
        for index, (offset, size) in enumerate(spans):
            vectors = self.eigenvectors[index].to(torch.float64)
            part = x[:, offset : offset + size]
            coordinates = part @ vectors
            out[:, offset : offset + size] = (coordinates * (function(self.eigenvalues[index]) - at_zero)) @ vectors.T
            out[:, offset : offset + size] += at_zero * part
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write damping, blocks, row count and the per-block eigendecompositions (the kept eigenpairs: eigenvalues
        float64, eigenvectors float64 for a low-rank block, else float32). This object keeps what it wrote, so it
        scores exactly as a copy loaded from ``path`` does."""
        spans = self._spans()
        saved = [
            vectors if vectors.shape[1] < size else vectors.to(torch.float32)
            for vectors, (_, size) in zip(self.eigenvectors, spans)
        ]
        if any(vectors is not kept for vectors, kept in zip(saved, self.eigenvectors)):
            self.eigenvectors = saved
            self._cache = DeviceCache()  # its copies were made from the float64 eigenvectors
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
        """Read a saved Fisher preconditioner: the kept eigenpairs (float64 or float32 eigenvectors, as saved; a
        fit saved before with every eigenpair in float64 loads as it is)."""
        config, arrays = load_state(path, cls.name)
        loaded = cls(damping=config["damping"], blocks=config["blocks"])
        loaded.dim, loaded.n_rows = config["dim"], config["n_rows"]
        for index, (_, size) in enumerate(loaded._spans()):
            values = np.asarray(arrays[f"eigenvalues_{index}"], np.float64)
            vectors = arrays[f"eigenvectors_{index}"]
            if vectors.dtype not in (np.float32, np.float64) or vectors.shape != (size, len(values)):
                raise ValueError(
                    f"block {index}: eigenvectors {vectors.dtype} {vectors.shape} for {len(values)} values"
                )
            loaded.eigenvalues.append(torch.from_numpy(values))
            loaded.eigenvectors.append(torch.from_numpy(vectors))
        return loaded


def _small_gram_eigh(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nonzero eigenpairs of ``G^T G / n`` for ``G = rows`` (``[n, size]``, ``n < size``, float64) from the
    ``n x n`` matrix ``G G^T / n``: eigenvalues ascending, eigenvectors ``[size, kept]`` orthonormal. Eigenvalues at
    rounding level (a rank below ``n``) are left to the damping, as a zero eigenvalue would be."""
    values, left = torch.linalg.eigh(rows @ rows.T / n)
    floor = values.abs().max() * max(rows.shape) * torch.finfo(torch.float64).eps
    keep = values > floor
    values, left = values[keep], left[:, keep]
    vectors = rows.T @ left / torch.sqrt(values * n)
    return values.contiguous(), vectors.contiguous()
