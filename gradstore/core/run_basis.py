"""A run's projection basis (curvature-aware projection) kept as a side file of the store.

A run captured with a fixed :class:`ingest.projection.ProjectionBasis` records the basis digest in its
projection spec; the matrices themselves live in the side file ``bases/<spec fingerprint>.npz`` (local disk
or object storage alike). Later captures of the run (queries, other checkpoints) load them from there, so
they project exactly like the first one, and a capture with other matrices is refused by the spec check. The
basis itself is computed by :mod:`ingest.basis` (this module is its store side).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from gradstore.core import StoreCore, as_core
from gradstore.errors import InvalidArgumentError, StoreCorruptError
from ingest.basis import basis_from_curvature
from ingest.projection import LayerSizes, ProjectionBasis, ProjectionSpec

BASES = "bases"


def basis_key(spec: ProjectionSpec) -> tuple[str, str]:
    """The side-file key of the basis of ``spec`` (by its fingerprint)."""
    return BASES, f"{spec.fingerprint()}.npz"


def save_basis(store: StoreCore, spec: ProjectionSpec, basis: ProjectionBasis) -> None:
    """Keep ``basis`` with the store for ``spec`` (written once; ``spec.basis`` must be its digest)."""
    if spec.basis != basis.digest():
        raise InvalidArgumentError(f"basis {basis.digest()} is not the one of this projection spec ({spec.basis})")
    if not store.files.exists(*basis_key(spec)):
        buffer = io.BytesIO()
        np.savez(buffer, **basis.to_arrays())
        store.files.write_bytes(buffer.getvalue(), *basis_key(spec))  # whole-file write: ranks may race harmlessly


def load_basis(store: StoreCore, spec: ProjectionSpec) -> ProjectionBasis | None:
    """The basis of ``spec`` (``None`` when the spec uses seeded random matrices); checked against its digest."""
    if spec.basis is None:
        return None
    try:
        data = store.files.read_bytes(*basis_key(spec))
    except FileNotFoundError:
        raise StoreCorruptError(f"the projection basis {spec.basis} of this run is missing from the store") from None
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        basis = ProjectionBasis.from_arrays(arrays)
    if basis.digest() != spec.basis:
        raise StoreCorruptError(f"the projection basis file of {spec.basis} does not match its digest")
    return basis


def run_basis(store: StoreCore | Any, run: str) -> ProjectionBasis | None:
    """The projection basis run ``run`` was captured with (``None``: seeded random matrices or exact rows);
    ``store``: a store or its core."""
    store = as_core(store)
    if store.run_projection(run) is None:
        return None
    return load_basis(store, store.run_spec(run))


def basis_from_run(
    store: StoreCore | Any,
    run: str,
    checkpoint: str,
    k_in: int = 16,
    k_out: int = 16,
    layer_sizes: LayerSizes | None = None,
    split: str = "fixed",
) -> ProjectionBasis:
    """The curvature-aware basis from a run's ``curvature=True`` statistics at ``checkpoint``
    (:func:`ingest.basis.basis_from_curvature` with that run's spec and basis; ``split`` as there); ``store``: a
    store or its core."""
    store = as_core(store)
    return basis_from_curvature(
        store.load_curvature(run, checkpoint),
        store.run_spec(run),
        k_in,
        k_out,
        layer_sizes,
        previous=run_basis(store, run),
        split=split,
    )
