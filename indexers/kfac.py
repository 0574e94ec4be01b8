"""Kronecker-factored (K-FAC) preconditioner per layer, with optional eigenvalue correction (EK-FAC).

A layer's slice of the projected vector is the row-major flattening of its ``[k_out, k_in]`` gradient
matrix ``G`` (vector index ``offset + o * k_in + i``). For ``G = s a^T`` the Fisher block is approximated by
``S (x) A`` with ``A = E[a a^T]`` (input covariance, ``[k_in, k_in]``) and ``S = E[s s^T]`` (output-gradient
covariance, ``[k_out, k_out]``). In the eigenbasis ``Q_S (x) Q_A`` the eigenvalues are ``lambda_S[o] *
lambda_A[i]``; EK-FAC replaces them by ``mean_n ((Q_S^T G_n Q_A)[o, i])^2`` fitted from the gradients.

When capture provides no covariances, the factors are estimated from the gradients themselves:
``A = E[G^T G]`` and ``S = E[G G^T] / E[|G|_F^2]`` (exact when ``s`` and ``a`` are independent).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

import numpy as np
import torch

from indexers.blocks import ArrayLike, Rows
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
from indexers.search_errors import NotFittedError

KroneckerLayout = Sequence[tuple[str, int, int, int]]
"""``(layer_name, offset, k_in, k_out)`` per layer; the layers must tile the vector."""
KroneckerFactors = Mapping[str, tuple[ArrayLike, ArrayLike]]
"""``{layer_name: (A [k_in, k_in], S [k_out, k_out])}``: normalized (mean) covariances."""


class KroneckerPreconditioner:
    """``P_l = S_l (x) A_l + damping * mean(eig) * I`` per layer (EK-FAC: ``eigen_correction``).

    Damping is relative to the mean eigenvalue of each layer's Kronecker product; :meth:`with_damping`
    re-damps without a pass over the data."""

    name = "kfac"

    def __init__(
        self,
        layout: KroneckerLayout,
        factors: KroneckerFactors | None = None,
        damping: float = 0.1,
        eigen_correction: bool = False,
        factor_count: int | None = None,
    ):
        self.layout = [(str(name), int(offset), int(k_in), int(k_out)) for name, offset, k_in, k_out in layout]
        if not self.layout:
            raise ValueError("kfac needs a kronecker_layout with at least one layer")
        self.damping = check_damping(damping)
        self.eigen_correction = bool(eigen_correction)
        self.factors = None if factors is None else {name: factors[name] for name, *_ in self.layout}
        self.dim: int | None = None
        self.n_rows: int | None = None  # rows the fit read (None: it read none, given factors and no correction)
        self.factor_count = None if factors is None or factor_count is None else int(factor_count)
        self.basis: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.eigenvalues: dict[str, torch.Tensor] = {}
        self._cache = DeviceCache()

    @property
    def stages(self) -> list[str]:
        """The passes a fit makes: ``factors`` (when none were given), then ``eigenvalues`` (EK-FAC)."""
        return (["factors"] if self.factors is None else []) + (["eigenvalues"] if self.eigen_correction else [])

    @property
    def passes(self) -> int:
        """Passes over the rows a fit makes (0 with given factors and no eigenvalue correction)."""
        return len(self.stages)

    def fit(self, blocks: Rows) -> KroneckerPreconditioner:
        """Eigendecompose the factors; estimate them from the gradients if none were given; EK-FAC pass.

        With factors given and no eigenvalue correction the rows are not read; without factors and with
        ``eigen_correction`` they are read twice (a :data:`~indexers.blocks.VectorBlocks` source restarts)."""
        self.dim, self.n_rows, self.basis, self.eigenvalues = None, None, {}, {}
        fit_in_passes(self, blocks)
        self._decompose_given_factors()
        return self

    def statistics(self, blocks: Rows, stage: int = 0) -> FitStatistics:
        """Pass ``factors``: ``G^T G`` and ``G G^T`` per layer; pass ``eigenvalues``: the squared gradients
        rotated into the Kronecker eigenbasis, per layer (float64 sums over these rows)."""
        correcting = self.stages[stage] == "eigenvalues"
        if correcting:
            self._decompose_given_factors()
        sums: dict[str, torch.Tensor] = {}
        rows = 0
        for block in float64_blocks(blocks):
            for name, grads in self._layer_views(block):
                if correcting:
                    q_a, q_s = self.basis[name]
                    parts = {f"E:{name}": (q_s.T @ grads @ q_a).square().sum(dim=0)}
                else:
                    parts = {
                        f"A:{name}": torch.einsum("noi,noj->ij", grads, grads),
                        f"S:{name}": torch.einsum("noi,npi->op", grads, grads),
                    }
                for key, value in parts.items():
                    sums[key] = sums[key] + value if key in sums else value
            rows += block.shape[0]
        return FitStatistics(rows, {key: value.numpy() for key, value in sums.items()})

    def finish(self, statistics: FitStatistics, stage: int = 0) -> KroneckerPreconditioner:
        """Pass ``factors``: normalize and eigendecompose the estimated factors; pass ``eigenvalues``:
        replace the eigenvalues by the corrected ones."""
        rows = statistics.rows
        if rows == 0:
            raise ValueError("cannot fit a preconditioner on zero rows")
        self.n_rows = rows
        sums = {key: torch.from_numpy(value) for key, value in statistics.sums.items()}
        if self.stages[stage] == "eigenvalues":
            self._decompose_given_factors()
            self.eigenvalues = {name: sums[f"E:{name}"] / rows for name, *_ in self.layout}
        else:
            factors = {}
            for name, *_ in self.layout:
                a, s = sums[f"A:{name}"], sums[f"S:{name}"]
                total = float(torch.trace(a))
                factors[name] = (a / rows, s / total if total > 0 else s / rows)
            self._decompose(factors)
            self.factor_count = rows
        self._cache = DeviceCache()
        return self

    def _decompose_given_factors(self) -> None:
        """Eigendecompose the factors given at construction, once (nothing to do when estimated). Also
        runs on first use, so a fit of no passes (given factors, no correction) needs no ``fit`` call."""
        if not self.basis and self.factors is not None:
            self._decompose(self.factors)

    def _decompose(self, factors: KroneckerFactors) -> None:
        self.basis, self.eigenvalues = {}, {}
        for name, _, k_in, k_out in self.layout:
            a, s = (torch.as_tensor(np.asarray(f), dtype=torch.float64) for f in factors[name])
            if a.shape != (k_in, k_in) or s.shape != (k_out, k_out):
                raise ValueError(
                    f"layer {name}: factors have shapes {tuple(a.shape)}, {tuple(s.shape)}; "
                    f"expected ({k_in}, {k_in}) and ({k_out}, {k_out})"
                )
            values_a, q_a = torch.linalg.eigh(a)
            values_s, q_s = torch.linalg.eigh(s)
            self.basis[name] = (q_a, q_s)
            self.eigenvalues[name] = torch.outer(values_s.clamp_min(0.0), values_a.clamp_min(0.0))
        spans = [(offset, k_in * k_out) for _, offset, k_in, k_out in self.layout]
        check_tiling(spans, sum(size for _, size in spans), "kronecker_layout layers")
        self.dim = sum(size for _, size in spans)

    def _layer_views(self, block: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        check_tiling(
            [(offset, k_in * k_out) for _, offset, k_in, k_out in self.layout],
            block.shape[1],
            "kronecker_layout layers",
        )
        for name, offset, k_in, k_out in self.layout:
            yield name, block[:, offset : offset + k_in * k_out].reshape(-1, k_out, k_in)

    def with_damping(self, damping: float) -> KroneckerPreconditioner:
        """A copy with another damping, sharing the eigenbases, eigenvalues and the cache of their converted
        copies (no pass over the data, nothing converted again)."""
        other = copy.copy(self)
        other.damping = check_damping(damping)
        return other

    def _basis(self, name: str, which: int) -> torch.Tensor:
        return self.basis[name][which]

    def _weights(self, name: str, power: float) -> torch.Tensor:
        values = self.eigenvalues[name]
        return (values + absolute_damping(self.damping, values)).pow(-power)

    def _apply(self, x: torch.Tensor, power: float, variant: str) -> torch.Tensor:
        self._decompose_given_factors()
        if self.dim is None or not self.eigenvalues:
            raise NotFittedError("fit the kfac preconditioner before applying or saving it")

        def transform(rows: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(rows)
            for name, offset, k_in, k_out in self.layout:
                q_a = self._cache.get(f"qa:{name}", "", partial(self._basis, name, 0), rows)
                q_s = self._cache.get(f"qs:{name}", "", partial(self._basis, name, 1), rows)
                weights = self._cache.get_damped(
                    f"w:{name}", variant, self.damping, partial(self._weights, name, power), rows
                )
                grads = rows[:, offset : offset + k_in * k_out].reshape(-1, k_out, k_in)
                rotated = (q_s.T @ grads @ q_a) * weights
                out[:, offset : offset + k_in * k_out] = (q_s @ rotated @ q_a.T).reshape(-1, k_in * k_out)
            return out

        return apply_rows(x, transform)

    def apply_function(self, x: torch.Tensor, function: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``f(S (x) A) x`` layer by layer for a spectral function ``f`` of the *undamped* Kronecker curvature
        (EK-FAC: its corrected eigenvalues), float64: ``x`` rotated into the layer's eigenbasis, scaled by ``f`` of
        the eigenvalues, rotated back (SOURCE's segment terms, :mod:`gradstore.methods.trajectory`)."""
        self._decompose_given_factors()
        if self.dim is None or not self.eigenvalues:
            raise NotFittedError("fit the kfac preconditioner before applying it")
        x = x.to(torch.float64)
        out = torch.empty_like(x)
        for name, offset, k_in, k_out in self.layout:
            q_a, q_s = (self.basis[name][which].to(torch.float64) for which in (0, 1))
            grads = x[:, offset : offset + k_in * k_out].reshape(-1, k_out, k_in)
            rotated = (q_s.T @ grads @ q_a) * function(self.eigenvalues[name].to(torch.float64))
            out[:, offset : offset + k_in * k_out] = (q_s @ rotated @ q_a.T).reshape(-1, k_in * k_out)
        return out

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        """``P^-1 q`` layer by layer, in the Kronecker eigenbasis."""
        return self._apply(q, 1.0, "query")

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 x`` layer by layer (the symmetric square root)."""
        return self._apply(x, 0.5, "both")

    def save(self, path: str | os.PathLike) -> None:
        """Write layout, damping, ``n_rows`` (rows the fit read; ``null`` when it read none: given factors, no
        eigenvalue correction), ``factor_count`` (what the factors are means over: the rows of the factors pass, or
        the count given with them, e.g. a capture's token count; ``null`` if none was), the eigenbases (float32:
        what applying to float32 rows needs; half the bytes of float64) and the (possibly corrected) eigenvalues
        (float64)."""
        self._decompose_given_factors()
        if self.dim is None or not self.eigenvalues:
            raise NotFittedError("fit the kfac preconditioner before applying or saving it")
        config = {
            "name": self.name,
            "damping": self.damping,
            "layout": self.layout,
            "dim": self.dim,
            "n_rows": self.n_rows,
            "factor_count": self.factor_count,
            "eigen_correction": self.eigen_correction,
        }
        arrays = {}
        for index, (name, *_) in enumerate(self.layout):
            # this fit scores from now on as its saved copy does
            q_a, q_s = self.basis[name] = tuple(q.to(torch.float32) for q in self.basis[name])
            arrays[f"q_a_{index}"], arrays[f"q_s_{index}"] = q_a.numpy(), q_s.numpy()
            arrays[f"eigenvalues_{index}"] = self.eigenvalues[name].numpy()
        save_state(path, config, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> KroneckerPreconditioner:
        """Read a saved kfac preconditioner (the raw factors are not kept, only their eigendecompositions)."""
        config, arrays = load_state(path, cls.name)
        loaded = cls(config["layout"], damping=config["damping"], eigen_correction=config["eigen_correction"])
        loaded.dim, loaded.n_rows = config["dim"], config["n_rows"]
        loaded.factor_count = config.get("factor_count")  # absent from fits saved before it was recorded
        for index, (name, *_) in enumerate(loaded.layout):
            q_a, q_s = (torch.from_numpy(np.asarray(arrays[f"{key}_{index}"])) for key in ("q_a", "q_s"))
            values = torch.from_numpy(np.asarray(arrays[f"eigenvalues_{index}"], np.float64))
            loaded.basis[name], loaded.eigenvalues[name] = (q_a, q_s), values
        return loaded
