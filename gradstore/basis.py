"""A run's projection basis (curvature-aware projection) kept as a side file beside the tables.

A run captured with a fixed :class:`ingest.projection.ProjectionBasis` records the basis digest in its
projection spec; the matrices themselves live in ``store.sidecar("bases")/<spec fingerprint>.npz``. Later
captures of the run (queries, other checkpoints) load them from there, so they project exactly like the
first one, and a capture with other matrices is refused by the spec check.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gradstore.errors import StoreCorruptError
from ingest.basis import basis_from_curvature
from ingest.projection import LayerSizes, ProjectionBasis, ProjectionSpec

if TYPE_CHECKING:
    from gradstore.store import GradStore


def basis_path(store: GradStore, spec: ProjectionSpec) -> Path:
    """Where the basis of projection ``spec`` is kept (keyed by the spec's fingerprint)."""
    return store.sidecar("bases") / f"{spec.fingerprint()}.npz"


def save_basis(store: GradStore, spec: ProjectionSpec, basis: ProjectionBasis) -> Path:
    """Keep ``basis`` with the store for ``spec`` (written once; ``spec.basis`` must be its digest)."""
    if spec.basis != basis.digest():
        raise ValueError(f"basis {basis.digest()} is not the one of this projection spec ({spec.basis})")
    path = basis_path(store, spec)
    if not path.exists():
        partial = path.with_name(f"{path.stem}.{uuid.uuid4().hex}.partial.npz")  # ranks may write it together
        np.savez(partial, **basis.to_arrays())
        partial.replace(path)
    return path


def load_basis(store: GradStore, spec: ProjectionSpec) -> ProjectionBasis | None:
    """The basis of ``spec`` (``None`` when the spec uses seeded random matrices); checked against its digest."""
    if spec.basis is None:
        return None
    path = basis_path(store, spec)
    if not path.exists():
        raise StoreCorruptError(f"the projection basis {spec.basis} of this run is missing from the store ({path})")
    with np.load(path) as arrays:
        basis = ProjectionBasis.from_arrays(arrays)
    if basis.digest() != spec.basis:
        raise StoreCorruptError(f"the projection basis file {path} does not match its digest {spec.basis}")
    return basis


def run_basis(store: GradStore, run: str) -> ProjectionBasis | None:
    """The projection basis run ``run`` was captured with (``None``: seeded random matrices or exact rows)."""
    if store.run_projection(run) is None:
        return None
    return load_basis(store, store.run_spec(run))


def basis_from_run(store: GradStore, run: str, checkpoint: str, k_in: int = 16, k_out: int = 16,
                   layer_sizes: LayerSizes | None = None) -> ProjectionBasis:
    """The curvature-aware basis from a run's ``curvature=True`` statistics at ``checkpoint``
    (:func:`ingest.basis.basis_from_curvature` with that run's spec and basis)."""
    return basis_from_curvature(store.load_curvature(run, checkpoint), store.run_spec(run), k_in, k_out,
                                layer_sizes, previous=run_basis(store, run))
