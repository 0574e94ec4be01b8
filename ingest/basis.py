"""Curvature-aware projection: the K-FAC eigenbasis of each layer as a fixed :class:`ProjectionBasis`.

For a layer with inputs ``a = [x, 1]`` and output gradients ``g``, the per-example gradient is
``G = sum_t g_t a_t^T``. K-FAC approximates its second moment by ``S kron A`` with ``A = E[a a^T]`` and
``S = E[g g^T]``; projecting ``G`` onto the top ``k_in`` eigenvectors of ``A`` (rows of ``P_in``) and the top
``k_out`` eigenvectors of ``S`` (rows of ``P_out``) keeps the directions that carry most of the gradient's
energy (PCA-initialised LoGra), at the same ``k_in * k_out`` bytes per example as a random projection.
A uniform scale of ``A`` or ``S`` (the loss's mean reduction) leaves the eigenvectors unchanged.

Optionally the last ``tail`` rows of each side are seeded random directions orthogonal to the leading
eigenvectors. Sources of ``A`` and ``S``: a short pre-pass (:func:`estimate_basis`) or a previous capture's
``curvature=True`` statistics (:func:`basis_from_curvature`). Embedding inputs are one-hot, so their ``A``
is diagonal (token counts) and is kept as a vector.

The top eigenvectors keep the directions most of the pre-pass's gradient energy lies in. Where an example's
identity lives in rare directions they discard exactly those: a one-hot side (an embedding's tokens, the
unembedding's vocabulary) keeps its ``k`` most frequent tokens and drops the rest, and a layer fed sequences
weighs every position's token, so the directions shared by all sentences win — and a damped inverse
``(F + delta)^-1`` shrinks those top directions anyway. :func:`estimate_basis` therefore keeps the seeded random
projection (the capture's own matrices) on token-indexed sides (``layers``, :data:`EIGEN_LAYERS`) and, on
layers fed sequences, keeps the eigenvectors a damped inverse weighs most (``select="influence"``,
:func:`ranked_rows`) instead of the top ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ingest.capture import ProjectionConfig
from ingest.ids import find_inputs, find_mask
from ingest.layers import LayerInfo, select_layers
from ingest.misuse import CaptureUsageError
from ingest.output_hooks import on_gradient
from ingest.per_example import tokens_view
from ingest.projection import LayerSizes, ProjectionBasis, ProjectionSpec, projection_matrix, slot_sizes

Covariances = Mapping[str, tuple[np.ndarray, np.ndarray]]


def eigenbasis(cov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (clipped at zero, largest first) and eigenvectors as rows ``[d, d]`` (float64) of a
    symmetric ``cov [d, d]``; a 1-D ``cov`` is a diagonal, whose eigenvectors are unit vectors (ties keep
    index order)."""
    cov = np.asarray(cov, dtype=np.float64)
    if cov.ndim == 1:
        order = np.argsort(-cov, kind="stable")
        rows = np.zeros((len(order), cov.shape[0]))
        rows[np.arange(len(order)), order] = 1.0
        return np.clip(cov[order], 0.0, None), rows
    values, vectors = np.linalg.eigh((cov + cov.T) / 2)
    return np.clip(values[::-1], 0.0, None), vectors[:, ::-1].T.copy()


#: How :func:`ranked_rows` orders a side's eigenvectors: by eigenvalue (``"energy"``: PCA, the directions most
#: of the gradients' energy lies in) or by their share of a damped inverse's scores (``"influence"``).
#: ``estimate_basis(select="auto")`` (default) takes ``"influence"`` for layers fed sequences and ``"energy"``
#: for layers that see one position per example.
SELECTIONS = ("energy", "influence")


def ranked_rows(cov: np.ndarray, select: str = "energy", damping: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The eigenvectors of a symmetric ``cov [d, d]`` (or a diagonal ``[d]``) as rows ``[d, d]`` (float64), best
    first, with their ranking weights.

    ``"energy"``: by eigenvalue ``l``. ``"influence"``: by ``l / (l + delta)^2`` with ``delta = damping *
    mean(l)``, the variance a direction adds to scores ``q^T (F + delta)^-1 g`` when ``q`` and ``g`` are drawn
    with second moment ``F``: largest where ``l`` is near ``delta``, small for the top directions (which the
    inverse shrinks) and for the null space. Ties keep eigenvalue order."""
    values, rows = eigenbasis(cov)
    if select == "energy":
        return values, rows
    delta = damping * float(values.mean()) or damping  # an all-zero side: any positive delta
    weights = values / (values + delta) ** 2
    order = np.argsort(-weights, kind="stable")
    return weights[order], rows[order]


def leading_rows(cov: np.ndarray, k: int) -> np.ndarray:
    """The top-``k`` eigenvectors of a symmetric ``cov [d, d]`` (or a diagonal ``[d]``) as rows ``[k, d]``
    (float64), largest eigenvalue first."""
    return eigenbasis(cov)[1][:k]


def energy_split(a_values: np.ndarray, s_values: np.ndarray, k_in: int, k_out: int) -> tuple[int, int]:
    """The ``(k_in', k_out')`` with ``k_in' * k_out' == k_in * k_out`` (each within its side's width) whose
    leading eigenvalues keep most of the Kronecker model's energy, ``sum(a[:k_in']) * sum(s[:k_out'])``.

    Same bytes per example as ``(k_in, k_out)``, which is kept unless another split keeps strictly more (by a
    relative 1e-9). ``a_values``/``s_values``: each side's eigenvalues, largest first."""
    budget = k_in * k_out
    kept_in, kept_out = np.cumsum(a_values), np.cumsum(s_values)
    best, best_energy = (k_in, k_out), kept_in[k_in - 1] * kept_out[k_out - 1]
    for size_in in range(1, len(a_values) + 1):
        size_out, rest = divmod(budget, size_in)
        if rest == 0 and size_out <= len(s_values):
            energy = kept_in[size_in - 1] * kept_out[size_out - 1]
            if energy > best_energy * (1 + 1e-9):
                best, best_energy = (size_in, size_out), energy
    return best


def random_tail(top: np.ndarray, tail: int, seed: int, layer: str, side: str) -> np.ndarray:
    """``tail`` seeded Gaussian directions orthogonal to the rows of ``top [r, d]``, orthonormalised."""
    d = top.shape[1]
    draws = projection_matrix(seed, layer, side, tail, d, dtype=torch.float64).numpy()
    if len(top):
        q, _ = np.linalg.qr(top.T)  # orthonormal basis of the span of the top rows
        draws = draws - (draws @ q) @ q.T
    q, _ = np.linalg.qr(draws.T)
    return q.T[:tail]


def side_rows(
    cov: np.ndarray,
    k: int,
    tail: int,
    seed: int,
    layer: str,
    side: str,
    select: str = "energy",
    damping: float = 0.1,
) -> np.ndarray:
    """``k`` projection rows of one side: the ``k - tail`` best eigenvectors (:func:`ranked_rows`) then ``tail``
    random ones."""
    d = cov.shape[0]
    k = min(k, d)
    tail = min(tail, k)
    top = ranked_rows(cov, select, damping)[1][: k - tail]
    return np.concatenate([top, random_tail(top, tail, seed, layer, side)]) if tail else top


SPLITS = ("fixed", "energy")

#: ``estimate_basis(layers=...)``: where the eigenbasis replaces the random projection. ``"all"``: every
#: captured layer. ``"non-token"`` (default): all but the token-indexed sides, i.e. an embedding's input side
#: (one-hot tokens) and the output side of a linear layer as wide as an embedding's vocabulary (the
#: unembedding), which keep the seeded random rows. ``"single-position"``: moreover only layers that saw one
#: position per example in the pre-pass (no sequence dimension); layers fed sequences keep the random
#: projection on both sides.
EIGEN_LAYERS = ("single-position", "non-token", "all")

#: Per layer, whether its (input, output) side keeps the seeded random projection instead of the eigenbasis.
RandomSides = Mapping[str, tuple[bool, bool]]


def check_eigen_layers(eigen_layers: str) -> str:
    """``eigen_layers`` if it is one of :data:`EIGEN_LAYERS`, else a :class:`CaptureUsageError` naming them."""
    if eigen_layers not in EIGEN_LAYERS:
        raise CaptureUsageError(
            f"estimate_basis: layers must be one of {EIGEN_LAYERS} (where the eigenbasis replaces the random "
            f"projection), got {eigen_layers!r}"
        )
    return eigen_layers


def random_sides(
    layers: list[LayerInfo], positions: Mapping[str, int], vocabularies: set[int], eigen_layers: str
) -> dict[str, tuple[bool, bool]]:
    """Which sides of ``layers`` keep the random projection under ``estimate_basis(layers=eigen_layers)``.

    ``positions``: the most positions per example each layer saw in the pre-pass; ``vocabularies``: the
    ``num_embeddings`` of the model's embeddings (a linear layer with that many outputs is an unembedding)."""
    check_eigen_layers(eigen_layers)
    sides = {}
    for info in layers:
        token_in = info.kind == "embedding"
        token_out = info.kind != "embedding" and info.d_out in vocabularies
        if eigen_layers == "all":
            sides[info.name] = (False, False)
        elif eigen_layers == "single-position" and positions.get(info.name, 1) > 1:
            sides[info.name] = (True, True)
        else:
            sides[info.name] = (token_in, token_out)
    return sides


def random_rows(seed: int, layer: str, side: str, k: int, d: int) -> np.ndarray:
    """The capture's own seeded random projection rows ``[k, d]`` of one side (float32, entries N(0, 1/k))."""
    return projection_matrix(seed, layer, side, k, d).numpy()


def basis_from_covariances(
    covariances: Covariances,
    k_in: int = 16,
    k_out: int = 16,
    layer_sizes: LayerSizes | None = None,
    tail: int = 0,
    seed: int = 0,
    split: str = "fixed",
    random: RandomSides | None = None,
    select: str | Mapping[str, str] = "energy",
    damping: float = 0.1,
) -> ProjectionBasis:
    """The eigenbasis of per-layer ``(A, S)`` (``A`` may be a vector: a diagonal), sizes as in a capture
    (:func:`ingest.projection.slot_sizes`, capped at the layer's width).

    ``split="energy"`` re-divides each layer's ``k_in * k_out`` dims between the two sides by
    :func:`energy_split` (same bytes per layer and in total); ``"fixed"`` keeps the requested sizes.
    ``random``: per layer, the sides that keep the seeded random projection (:func:`random_rows`, equal to a
    capture's without a basis); a layer with a random side keeps the requested sizes. ``select``/``damping``:
    which eigenvectors each side keeps (:func:`ranked_rows`; the energy split then weighs the ranking weights);
    ``select`` may map each layer name to its own selection."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    matrices = {}
    for name, (a_cov, s_cov) in covariances.items():
        random_in, random_out = (random or {}).get(name, (False, False))
        order = select if isinstance(select, str) else select[name]
        layer_k_in, layer_k_out = slot_sizes(name, k_in, k_out, layer_sizes)
        layer_k_in, layer_k_out = min(layer_k_in, a_cov.shape[0]), min(layer_k_out, s_cov.shape[0])
        if split == "energy" and not (random_in or random_out):
            layer_k_in, layer_k_out = energy_split(
                ranked_rows(a_cov, order, damping)[0], ranked_rows(s_cov, order, damping)[0], layer_k_in, layer_k_out
            )
        matrices[name] = (
            random_rows(seed, name, "in", layer_k_in, a_cov.shape[0])
            if random_in
            else side_rows(a_cov, layer_k_in, tail, seed, name, "in", order, damping),
            random_rows(seed, name, "out", layer_k_out, s_cov.shape[0])
            if random_out
            else side_rows(s_cov, layer_k_out, tail, seed, name, "out", order, damping),
        )
    return ProjectionBasis(matrices)


def basis_from_curvature(
    stats: Mapping[str, tuple[np.ndarray, np.ndarray, int]],
    spec: ProjectionSpec,
    k_in: int = 16,
    k_out: int = 16,
    layer_sizes: LayerSizes | None = None,
    previous: ProjectionBasis | None = None,
    split: str = "fixed",
) -> ProjectionBasis:
    """The eigenbasis from a previous capture's ``curvature=True`` statistics (``store.load_curvature``).

    ``spec`` is that capture's projection spec. Statistics of exact slots are the full ``A``/``S``; those of
    a factorized slot live in its projected coordinates (``P A P^T``), so their eigenvectors ``v`` are lifted
    to the layer's coordinates as ``v^T P`` (within the span of that capture's matrices: ``previous`` when
    it used a basis, else its seeded random ones). ``split="energy"``: per-layer sizes re-divided as in
    :func:`basis_from_covariances` (within that capture's dims).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    matrices = {}
    for name, (a_cov, s_cov, _) in stats.items():
        slot = spec.slot(name)
        layer_k_in, layer_k_out = slot_sizes(name, k_in, k_out, layer_sizes)
        (a_values, a_rows), (s_values, s_rows) = eigenbasis(a_cov), eigenbasis(s_cov)
        layer_k_in, layer_k_out = min(layer_k_in, len(a_values)), min(layer_k_out, len(s_values))
        if split == "energy":
            layer_k_in, layer_k_out = energy_split(a_values, s_values, layer_k_in, layer_k_out)
        rows = [a_rows[:layer_k_in], s_rows[:layer_k_out]]
        if slot.mode == "factorized":
            if previous is not None:
                lifts = [p.astype(np.float64) for p in previous.matrices[name]]
            else:
                lifts = [
                    projection_matrix(spec.seed, name, "in", slot.k_in, slot.d_in_eff, dtype=torch.float64).numpy(),
                    projection_matrix(spec.seed, name, "out", slot.k_out, slot.d_out, dtype=torch.float64).numpy(),
                ]
            rows = [r @ lift for r, lift in zip(rows, lifts)]
        elif slot.mode != "exact":
            raise ValueError(f"layer {name!r} was captured with a {slot.mode} projection: no Kronecker statistics")
        matrices[name] = tuple(rows)
    return ProjectionBasis(matrices)


FACTORS = ("kfac", "gradient", "unit")


class _CovarianceHooks:
    """Forward/backward hooks summing each layer's input-side and output-side second moments, padding excluded:
    ``a a^T`` (or token counts) and ``g g^T`` for ``"kfac"``; ``G^T G`` and ``G G^T`` of the per-example
    gradients ``G = sum_t g_t a_t^T`` for ``"gradient"``."""

    def __init__(self, layers: list[LayerInfo], factors: str) -> None:
        self.layers = layers
        self.factors = factors
        self.a: dict[str, torch.Tensor] = {}
        self.s: dict[str, torch.Tensor] = {}
        self.positions: dict[str, int] = {}  # the most positions per example each layer saw
        self.mask: torch.Tensor | None = None

    def attach(self, model: nn.Module) -> list[Any]:
        handles = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True)]
        for info in self.layers:
            handles.append(info.module.register_forward_hook(self._layer_forward(info)))
        return handles

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.mask = find_mask(kwargs, find_inputs(args, kwargs))

    def _weights(self, batch: int, tokens: int, device: torch.device) -> torch.Tensor | None:
        mask = self.mask
        if mask is None or tuple(mask.shape) != (batch, tokens):
            return None
        return mask.reshape(-1).to(device=device, dtype=torch.float64)

    def _layer_forward(self, info: LayerInfo) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            x = args[0].detach()
            batch = x.shape[0]
            with torch.no_grad():
                tokens = x.numel() // batch if info.kind == "embedding" else x.numel() // (batch * info.d_in)
                self.positions[info.name] = max(self.positions.get(info.name, 0), tokens)
                weights = self._weights(batch, tokens, x.device)
                if info.kind == "embedding":
                    a = x.reshape(-1)
                    keep = torch.ones_like(a, dtype=torch.float64) if weights is None else weights
                    padding = getattr(module, "padding_idx", None)
                    weights = keep if padding is None else keep * (a != padding)
                else:
                    a = tokens_view(x, batch).reshape(-1, info.d_in).double()
                    if info.has_bias:
                        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)], 1)
                    if weights is not None:
                        a = a * weights.unsqueeze(1)  # padding tokens get zero inputs (their G part is zero)
                if self.factors == "kfac":
                    self._accumulate(self.a, info.name, self._input_moment(info, a, weights))
            on_gradient(output, lambda g: self._output_gradient(info, batch, a, g, weights))

        return hook

    def _input_moment(self, info: LayerInfo, a: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """``sum_t a_t a_t^T`` (embeddings: the diagonal, i.e. the weighted count of every index)."""
        if info.kind == "embedding":
            keep = torch.ones_like(a, dtype=torch.float64) if weights is None else weights
            return torch.zeros(info.d_in, dtype=torch.float64, device=a.device).index_add_(0, a, keep)
        return a.T @ a

    def _output_gradient(
        self, info: LayerInfo, batch: int, a: torch.Tensor, g: torch.Tensor, weights: torch.Tensor | None
    ) -> None:
        with torch.no_grad():
            g = g.detach().reshape(-1, info.d_out).double()
            if weights is not None:
                g = g * weights.unsqueeze(1)
            if self.factors == "kfac":
                self._accumulate(self.s, info.name, g.T @ g)
                return
            if info.kind == "embedding":
                # G_b = sum_t g_t e_{idx_t}^T: with M_b[t, t'] = [idx_t == idx_t'], G_b G_b^T = g_b^T M_b g_b and
                # the diagonal of G_b^T G_b at index v is sum_{t: idx_t = v} g_t . (M_b g_b)_t (no [V, d] matrices)
                idx = a.reshape(batch, -1)
                g = g.reshape(batch, -1, info.d_out)
                summed = torch.bmm((idx.unsqueeze(2) == idx.unsqueeze(1)).to(g.dtype), g)
                if self.factors == "unit":  # ||G_b||^2 = sum_t g_t . (M_b g_b)_t
                    norms = (g * summed).sum((1, 2)).clamp_min(1e-60).sqrt().view(-1, 1, 1)
                    g, summed = g / norms, summed / norms
                energy = (g * summed).sum(2).reshape(-1)
                part = torch.zeros(info.d_in, dtype=torch.float64, device=g.device).index_add_(0, a, energy)
                self._accumulate(self.a, info.name, part)
                self._accumulate(self.s, info.name, torch.einsum("bto,btp->op", g, summed))
                return
            grads = torch.einsum("bto,bti->boi", g.reshape(batch, -1, info.d_out), a.reshape(batch, -1, a.shape[1]))
            if self.factors == "unit":
                grads = grads / grads.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, 1, 1)
            self._accumulate(self.a, info.name, torch.einsum("boi,boj->ij", grads, grads))
            self._accumulate(self.s, info.name, torch.einsum("boi,bpi->op", grads, grads))

    @staticmethod
    def _accumulate(sums: dict[str, torch.Tensor], name: str, part: torch.Tensor) -> None:
        if name in sums:
            sums[name] += part
        else:
            sums[name] = part


def estimate_basis(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    config: ProjectionConfig | None = None,
    tail: int = 0,
    factors: str = "kfac",
    split: str = "fixed",
    layers: str = "non-token",
    select: str = "auto",
    damping: float = 0.1,
) -> ProjectionBasis:
    """A short pre-pass estimating each captured layer's K-FAC eigenbasis.

    ``factors="kfac"``: eigenvectors of ``A = E[a a^T]`` and ``S = E[g g^T]``. ``factors="gradient"``:
    eigenvectors of the partial traces of the layer's gradient second moment, ``E[G^T G]`` (input side) and
    ``E[G G^T]`` (output side), i.e. the Kronecker-structured subspace keeping most of the per-example
    gradients' energy (each token's input weighted by its gradient; per-example gradients are materialised
    in the pre-pass). ``factors="unit"``: the same with every example's gradient normalised to unit norm.

    For every batch, ``loss_fn(model, batch)`` returns a scalar loss whose backward is run, or a 1-D tensor
    of losses each backpropagated on its own with their second moments summed (e.g. one loss per label,
    weighted by the square root of its predicted probability, for the exact true-Fisher factors). Gradients
    are cleared afterwards; parameters are not updated. The layers, ``k_in``/``k_out``/``layer_sizes`` and
    ``seed`` (for a random ``tail``) come from ``config`` (default :class:`ProjectionConfig`), so the basis fits
    a capture with the same config. Using the model's loss with the true labels gives the empirical-Fisher
    ``S``; sampling labels from the model's predictions in ``loss_fn`` gives the true Fisher's.

    ``split="energy"`` lets each layer trade input-side for output-side dims at the same ``k_in * k_out``
    (:func:`energy_split`): e.g. the output gradients of a layer under a ``C``-way classifier head span about
    ``C - 1`` directions, so dims beyond those are better spent on the input side.

    ``layers`` (:data:`EIGEN_LAYERS`) says where the eigenbasis replaces the seeded random projection:
    ``"non-token"`` (default) on every layer except token-indexed sides (embedding inputs, the unembedding's
    vocabulary outputs); ``"single-position"`` only on layers that see one position per example, except
    token-indexed sides; ``"all"`` everywhere. The other sides keep exactly the random rows a capture with the
    same ``seed`` uses. ``select`` says which eigenvectors a side keeps (:func:`ranked_rows`): ``"energy"``
    the top ones, ``"influence"`` those of the largest ``l / (l + delta)^2`` with ``delta = damping *`` the
    side's mean eigenvalue, ``"auto"`` (default) ``"influence"`` on layers fed sequences and ``"energy"`` on
    layers that see one position per example. Measured (docs/concepts.md): on a classifier MLP the top
    eigenvectors gain held-out LDS over a random projection and ``"influence"`` loses it; on a small language
    model's fact tracing the top eigenvectors lose recall on every layer, most on the token-indexed sides, and
    ``"influence"`` with random token sides gains. ``tail=k//2`` gives the mixed basis (top half
    eigenvectors, random complement). Layers captured at their ops rather than by a module hook (convolutions,
    attention in-projections, bare parameters, Embedding subclasses; :mod:`ingest.layers`) keep the capture's
    seeded random projection.
    """
    if factors not in FACTORS:
        raise ValueError(f"factors must be one of {FACTORS}, got {factors!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    check_eigen_layers(layers)  # before the pre-pass
    if select not in (*SELECTIONS, "auto"):
        raise CaptureUsageError(f"estimate_basis: select must be one of {(*SELECTIONS, 'auto')}, got {select!r}")
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not math.isfinite(damping) or damping <= 0:
        raise CaptureUsageError(
            f"estimate_basis: damping must be a finite number > 0 (relative to each side's mean eigenvalue), "
            f"got {damping!r}"
        )
    config = config or ProjectionConfig()
    selected = select_layers(model, tuple(config.layer_types), config.include, config.exclude, config.include_frozen)
    if not selected:
        raise ValueError("estimate_basis: no supported layer matches the layer selection")
    infos = [info for info in selected if info.hooked]
    hooks = _CovarianceHooks(infos, factors)
    covariances = _moments(model, infos, batches, loss_fn, hooks)
    vocabularies = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    basis = basis_from_covariances(
        covariances,
        config.k_in,
        config.k_out,
        config.layer_sizes,
        tail,
        config.seed,
        split=split,
        random=random_sides(infos, hooks.positions, vocabularies, layers),
        select={
            name: ("influence" if count > 1 else "energy") if select == "auto" else select
            for name, count in hooks.positions.items()
        },
        damping=damping,
    )
    return ProjectionBasis({**basis.matrices, **_seeded(selected, config)})


def _seeded(layers: list[LayerInfo], config: ProjectionConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The capture's own seeded random matrices of the layers captured at their ops (:mod:`ingest.uses`: no module
    hook for the pre-pass to read), so the basis covers every layer of the capture."""
    out = {}
    for info in layers:
        if info.hooked:
            continue
        d_in = info.d_in + int(info.has_bias)
        k_in, k_out = slot_sizes(info.name, config.k_in, config.k_out, config.layer_sizes)
        k_in, k_out = min(k_in, d_in), min(k_out, info.d_out)
        out[info.name] = (
            random_rows(config.seed, info.name, "in", k_in, d_in),
            random_rows(config.seed, info.name, "out", k_out, info.d_out),
        )
    return out


def _moments(
    model: nn.Module,
    layers: list[LayerInfo],
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    hooks: _CovarianceHooks,
) -> Covariances:
    """One pass over ``batches`` with ``hooks`` attached: per-layer (input-side, output-side) moments."""
    handles = hooks.attach(model)
    try:
        for batch in batches:
            losses = loss_fn(model, batch).reshape(-1)
            for i, loss in enumerate(losses):
                loss.backward(retain_graph=i + 1 < len(losses))
            model.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    missing = [info.name for info in layers if info.name not in hooks.a or info.name not in hooks.s]
    if missing:
        raise ValueError(f"estimate_basis: layers {missing} saw no forward and backward in the pre-pass")
    return {info.name: (hooks.a[info.name].cpu().numpy(), hooks.s[info.name].cpu().numpy()) for info in layers}
