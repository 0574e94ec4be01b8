"""Projection spec and seeded random projection matrices.

A captured row is the concatenation of one slice per captured layer. Layer ``l`` owns
``row[offset : offset + size]``. For ``exact`` and ``factorized`` slots that slice is the row-major
flattening of a ``[k_out, k_in]`` matrix, so ``row[offset + o * k_in + i]`` is entry ``(o, i)``:

* ``exact``: the per-example gradient of the layer's linear map, ``G = sum_t dy_t x_t^T`` with the
  bias treated as an extra input column of ones (``k_in = d_in + 1`` when the layer has a bias,
  ``k_out = d_out``). For ``nn.Linear`` this is ``[weight.grad | bias.grad]``; for Hugging Face
  ``Conv1D`` (weight stored ``[in, out]``) and ``nn.Embedding`` (weight ``[num_embeddings, dim]``,
  input = one-hot of the index) it is ``weight.grad.T``.
* ``factorized``: ``P_out G P_in^T`` with ``P_in: [k_in, d_in (+1)]`` and ``P_out: [k_out, d_out]``,
  i.e. ``(P_out kron P_in) vec(G)``; the bias column is projected with the inputs.
* ``dense``: ``P vec(G)`` with one ``[size, d_out * (d_in + 1)]`` matrix; no Kronecker structure,
  so ``k_in`` and ``k_out`` are ``None``.

Projection sizes are capped at the layer's width (``k_in <= d_in + bias``, ``k_out <= d_out``, also in
the ``k_in * k_out`` dims of a dense slot) and may be set per layer (:func:`slot_sizes`).

Random matrices are never stored: they are regenerated from ``(seed, layer name, side)``. A spec whose
``basis`` is set uses fixed per-layer factorized matrices instead (:mod:`ingest.basis`, e.g. the K-FAC
eigenbasis); ``basis`` is the digest of those matrices, so it is part of the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

LAYER_KINDS = ("linear", "conv1d", "embedding", "conv", "attention", "recurrent", "parameter", "norm")
#: The kinds a capture takes by default: every kind but ``norm`` (norm scales and shifts are opt-in).
DEFAULT_LAYER_KINDS = LAYER_KINDS[:-1]
SLOT_MODES = ("exact", "factorized", "dense")
SPEC_KINDS = ("none", "factorized", "dense")
SIDES = ("in", "out", "dense")
# Names the generator of the matrices; changing how matrices are drawn must change this.
GENERATOR = "torch-cpu-randn/sqrt(k)-sha256-v1"


class ProjectionMismatchError(ValueError):
    """Two projection specs differ, so their vectors are not comparable."""


@dataclass(frozen=True)
class LayerSlot:
    """Where one captured layer lives in the row vector, and how it was projected."""

    name: str
    kind: str
    d_in: int
    d_out: int
    k_in: int | None
    k_out: int | None
    mode: str
    offset: int
    size: int
    has_bias: bool

    @property
    def d_in_eff(self) -> int:
        """Input width including the bias column of ones."""
        return self.d_in + int(self.has_bias)


@dataclass(frozen=True)
class ProjectionSpec:
    """Everything needed to reproduce (and check) the layout of captured vectors."""

    seed: int
    kind: str
    layers: tuple[LayerSlot, ...]
    basis: str | None = None  # digest of the fixed factorized matrices (None: seeded random ones)

    @property
    def dim(self) -> int:
        """Total length of a captured row."""
        return sum(slot.size for slot in self.layers)

    def slot(self, name: str) -> LayerSlot:
        """The slot of layer ``name`` (KeyError if absent)."""
        for slot in self.layers:
            if slot.name == name:
                return slot
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (round-trips through :meth:`from_dict`); ``basis`` only when set."""
        out = {
            "generator": GENERATOR,
            "seed": self.seed,
            "kind": self.kind,
            "dim": self.dim,
            "layers": [asdict(slot) for slot in self.layers],
        }
        if self.basis is not None:
            out["basis"] = self.basis
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProjectionSpec:
        """Inverse of :meth:`to_dict`; refuses specs drawn by another matrix generator."""
        if d.get("generator", GENERATOR) != GENERATOR:
            raise ProjectionMismatchError(
                f"spec was made with projection generator {d['generator']!r}, this code uses {GENERATOR!r}"
            )
        if d["kind"] not in SPEC_KINDS:
            raise ValueError(f"spec kind must be one of {SPEC_KINDS}, got {d['kind']!r}")
        return cls(
            seed=int(d["seed"]), kind=d["kind"], layers=tuple(LayerSlot(**s) for s in d["layers"]), basis=d.get("basis")
        )

    def fingerprint(self) -> str:
        """Stable hex hash of :meth:`to_dict`."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def check_matches(self, other: ProjectionSpec) -> None:
        """Raise :class:`ProjectionMismatchError` naming what differs between the two specs."""
        problems = []
        for field in ("seed", "kind", "basis"):
            if getattr(self, field) != getattr(other, field):
                problems.append(f"{field}: {getattr(self, field)!r} != {getattr(other, field)!r}")
        mine, theirs = [s.name for s in self.layers], [s.name for s in other.layers]
        if mine != theirs:
            missing = sorted(set(mine) - set(theirs))
            extra = sorted(set(theirs) - set(mine))
            problems.append(f"layers differ (only in this spec: {missing}, only in other: {extra}, or order)")
        else:
            for a, b in zip(self.layers, other.layers):
                diffs = [f for f in asdict(a) if getattr(a, f) != getattr(b, f)]
                if diffs:
                    detail = ", ".join(f"{f} {getattr(a, f)!r} != {getattr(b, f)!r}" for f in diffs)
                    problems.append(f"layer {a.name!r}: {detail}")
        if problems:
            raise ProjectionMismatchError("projection specs differ: " + "; ".join(problems))


def _stream_seed(seed: int, layer_name: str, side: str) -> int:
    digest = hashlib.sha256(f"{seed}\x00{layer_name}\x00{side}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def projection_matrix(
    seed: int,
    layer_name: str,
    side: str,
    k: int,
    d: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``[k, d]`` Gaussian projection for ``(seed, layer_name, side)``, entries N(0, 1/k).

    Drawn on the CPU with its own ``torch.Generator`` (so it is identical on every device and
    run), then moved to ``device``/``dtype``. ``side`` is ``"in"``, ``"out"`` or ``"dense"``.
    """
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    gen = torch.Generator(device="cpu").manual_seed(_stream_seed(seed, layer_name, side))
    mat = torch.randn(k, d, generator=gen, dtype=torch.float32) / math.sqrt(k)
    return mat.to(device=device, dtype=dtype)


LayerSizes = Mapping[str, Sequence[int]]


def slot_sizes(name: str, k_in: int, k_out: int, per_layer: LayerSizes | None = None) -> tuple[int, int]:
    """The requested ``(k_in, k_out)`` of layer ``name``: the first pattern of ``per_layer`` (name regex ->
    ``(k_in, k_out)``, matched with ``re.search`` in mapping order) that matches, else the defaults."""
    for pattern, sizes in (per_layer or {}).items():
        if re.search(pattern, name):
            if len(sizes) != 2 or min(sizes) < 1:
                raise ValueError(f"layer sizes for {pattern!r} must be two positive ints (k_in, k_out), got {sizes}")
            return int(sizes[0]), int(sizes[1])
    return k_in, k_out


def make_slot(
    name: str, kind: str, d_in: int, d_out: int, has_bias: bool, mode: str, k_in: int, k_out: int, offset: int
) -> LayerSlot:
    """Build the slot of one layer; ``k_in``/``k_out`` are the requested projection sizes.

    ``exact`` slots record ``k_in = d_in + bias``, ``k_out = d_out``. ``factorized`` sizes are capped at
    the layer's width (``k_in <= d_in + bias``, ``k_out <= d_out``). ``dense`` slots have the
    same capped ``size = k_in * k_out`` and no factor sizes.
    """
    if kind not in LAYER_KINDS:
        raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {kind!r}")
    d_in_eff = d_in + int(has_bias)
    if mode == "exact":
        return LayerSlot(name, kind, d_in, d_out, d_in_eff, d_out, mode, offset, d_in_eff * d_out, has_bias)
    if mode == "factorized":
        k_in, k_out = min(k_in, d_in_eff), min(k_out, d_out)
        return LayerSlot(name, kind, d_in, d_out, k_in, k_out, mode, offset, k_in * k_out, has_bias)
    if mode == "dense":
        size = min(k_in, d_in_eff) * min(k_out, d_out)
        return LayerSlot(name, kind, d_in, d_out, None, None, mode, offset, size, has_bias)
    raise ValueError(f"slot mode must be one of {SLOT_MODES}, got {mode!r}")


class ProjectionBasis:
    """Fixed factorized projection matrices, per layer ``(P_in [k_in, d_in (+1)], P_out [k_out, d_out])``.

    Used instead of the seeded Gaussian matrices when a capture is given one (``CaptureConfig.basis``), e.g.
    the K-FAC eigenbasis of :func:`ingest.basis.estimate_basis`. :meth:`digest` identifies the matrices and
    goes into the projection spec, so captures with different bases are refused as mismatched.
    """

    __slots__ = ("matrices", "_digest")

    def __init__(self, matrices: Mapping[str, tuple[Any, Any]]) -> None:
        self.matrices: dict[str, tuple[Any, Any]] = {}
        for name, (p_in, p_out) in matrices.items():
            pair = tuple(np.ascontiguousarray(np.asarray(p, dtype=np.float32)) for p in (p_in, p_out))
            if any(p.ndim != 2 for p in pair):
                raise ValueError(f"basis matrices of layer {name!r} must be 2-D")
            self.matrices[name] = pair
        self._digest: str | None = None

    def sizes(self, name: str) -> tuple[int, int]:
        """``(k_in, k_out)`` of layer ``name`` (KeyError if the basis has no such layer)."""
        p_in, p_out = self.matrices[name]
        return p_in.shape[0], p_out.shape[0]

    def tensors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``name``'s ``(P_in, P_out)`` as float32 CPU tensors."""
        return tuple(torch.from_numpy(p) for p in self.matrices[name])  # type: ignore[return-value]

    def digest(self) -> str:
        """Stable hex hash of the layer names, shapes and float32 bytes of every matrix."""
        if self._digest is None:
            h = hashlib.sha256(b"projection-basis-v1")
            for name in sorted(self.matrices):
                for side, p in zip(("in", "out"), self.matrices[name]):
                    h.update(f"\x00{name}\x00{side}\x00{p.shape}".encode())
                    h.update(p.tobytes())
            self._digest = h.hexdigest()[:32]
        return self._digest

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Named arrays ``"<layer>|in"`` / ``"<layer>|out"`` (for an ``.npz`` file)."""
        return {f"{name}|{side}": p for name, pair in self.matrices.items() for side, p in zip(("in", "out"), pair)}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> ProjectionBasis:
        """Inverse of :meth:`to_arrays`."""
        names = sorted({key.rsplit("|", 1)[0] for key in arrays})
        return cls({name: (arrays[f"{name}|in"], arrays[f"{name}|out"]) for name in names})

    def __repr__(self) -> str:
        return f"ProjectionBasis({len(self.matrices)} layers, digest {self.digest()})"
