"""Kronecker curvature statistics of a run's checkpoint as one ``.npz`` side file: the store's side of
:mod:`ingest.curvature`, which accumulates them during a capture with ``curvature=True``."""

from __future__ import annotations

import hashlib
import io

import numpy as np

from gradstore.core.sidefiles import SideFiles
from gradstore.errors import MissingCurvatureError, StoreCorruptError

LayerCurvature = dict[str, tuple[np.ndarray, np.ndarray, int]]
"""``{layer: (A [k_in, k_in], S [k_out, k_out], count)}``."""


def _key(run_id: str, checkpoint: str) -> tuple[str, str]:
    """Side-file key of a run's checkpoint: hashes, so any run or checkpoint name is a safe file name."""
    return ("curvature", hashlib.sha256(f"{run_id}\0{checkpoint}".encode()).hexdigest()[:32] + ".npz")


def save_curvature(files: SideFiles, run_id: str, checkpoint: str, stats: LayerCurvature) -> None:
    """Write per-layer ``(A, S, count)`` of a run's checkpoint."""
    arrays: dict[str, np.ndarray] = {}
    for layer, (a_cov, s_cov, count) in stats.items():
        arrays[f"{layer}|A"], arrays[f"{layer}|S"] = a_cov, s_cov
        arrays[f"{layer}|count"] = np.asarray(count)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    key = _key(run_id, checkpoint)
    with files.writing(*key):  # ranks saving at once take turns (file and checksum stay one pair)
        files.write_bytes(buffer.getvalue(), *key)


def load_curvature(files: SideFiles, run_id: str, checkpoint: str) -> LayerCurvature:
    """Per layer ``(A, S, count)`` saved by a capture with ``curvature=True``."""
    try:
        with files.reading(*_key(run_id, checkpoint)):
            data = files.read_bytes(*_key(run_id, checkpoint))
    except FileNotFoundError:
        raise MissingCurvatureError(
            f"no curvature statistics for run {run_id!r} checkpoint {checkpoint!r}: capture with curvature=True"
        ) from None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            layers = sorted({key.rsplit("|", 1)[0] for key in arrays.files})
            return {
                layer: (
                    np.asarray(arrays[f"{layer}|A"]),
                    np.asarray(arrays[f"{layer}|S"]),
                    int(arrays[f"{layer}|count"]),
                )
                for layer in layers
            }
    except (ValueError, KeyError, OSError) as error:
        raise StoreCorruptError(f"curvature of run {run_id!r} checkpoint {checkpoint!r} is damaged: {error}") from error
