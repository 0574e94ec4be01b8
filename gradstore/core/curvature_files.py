"""Kronecker curvature statistics of a run's checkpoint as one ``.npz`` side file per split: the store's side of
:mod:`ingest.curvature`, which accumulates them during a capture with ``curvature=True``.

A checkpoint has the factors of its training rows (split ``"train"``, the empirical Fisher's: the key stores made
before true-Fisher factors existed use) and, where a capture with ``curvature=True`` wrote true-Fisher rows, those of
split ``"true-fisher"`` (the true Fisher's), each in its own file. :class:`Curvature` is the store's part that keeps
them for its runs."""

from __future__ import annotations

import hashlib
import io

import numpy as np

from gradstore.core.catalog import RunCatalog
from gradstore.core.sidefiles import SideFiles
from gradstore.core.tables import writes
from gradstore.errors import InvalidArgumentError, MissingCurvatureError, StoreCorruptError
from ingest.curvature import CURVATURE_SPLITS

LayerCurvature = dict[str, tuple[np.ndarray, np.ndarray, int]]
"""``{layer: (A [k_in, k_in], S [k_out, k_out], count)}``."""


def _key(run_id: str, checkpoint: str, split: str) -> tuple[str, str]:
    """Side-file key of a run's checkpoint and split: hashes, so any run or checkpoint name is a safe file name
    (the training split keeps the key of stores written before splits were kept apart)."""
    if split not in CURVATURE_SPLITS:
        raise InvalidArgumentError(f"curvature statistics are kept for the splits {CURVATURE_SPLITS}, not {split!r}")
    text = f"{run_id}\0{checkpoint}" if split == "train" else f"{run_id}\0{checkpoint}\0{split}"
    return ("curvature", hashlib.sha256(text.encode()).hexdigest()[:32] + ".npz")


def save_curvature(files: SideFiles, run_id: str, checkpoint: str, stats: LayerCurvature, split: str = "train") -> None:
    """Write per-layer ``(A, S, count)`` of a run's checkpoint over its rows of ``split``."""
    arrays: dict[str, np.ndarray] = {}
    for layer, (a_cov, s_cov, count) in stats.items():
        arrays[f"{layer}|A"], arrays[f"{layer}|S"] = a_cov, s_cov
        arrays[f"{layer}|count"] = np.asarray(count)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    key = _key(run_id, checkpoint, split)
    with files.writing(*key):  # ranks saving at once take turns (file and checksum stay one pair)
        files.write_bytes(buffer.getvalue(), *key)


def has_curvature(files: SideFiles, run_id: str, checkpoint: str, split: str = "train") -> bool:
    """Whether a capture with ``curvature=True`` saved factors of the checkpoint's rows of ``split``."""
    return files.exists(*_key(run_id, checkpoint, split))


def load_curvature(files: SideFiles, run_id: str, checkpoint: str, split: str = "train") -> LayerCurvature:
    """Per layer ``(A, S, count)`` of the checkpoint's rows of ``split`` saved by a capture with ``curvature=True``."""
    key = _key(run_id, checkpoint, split)
    of = f"run {run_id!r} checkpoint {checkpoint!r}" + ("" if split == "train" else f" split {split!r}")
    try:
        with files.reading(*key):
            data = files.read_bytes(*key)
    except FileNotFoundError:
        raise MissingCurvatureError(f"no curvature statistics for {of}: capture with curvature=True") from None
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
        raise StoreCorruptError(f"curvature of {of} is damaged: {error}") from error


class Curvature:
    """The curvature statistics of a store's runs' checkpoints (one side file per checkpoint and split)."""

    def __init__(self, catalog: RunCatalog) -> None:
        self.catalog = catalog
        self.tables = catalog.tables

    @writes("save curvature statistics")
    def save(self, run_id: str, checkpoint: str, stats: LayerCurvature, split: str = "train") -> None:
        """Save per-layer Kronecker curvature statistics of a run's checkpoint over its rows of ``split``
        (``"train"`` or ``"true-fisher"``, one side file each)."""
        self.catalog.run(run_id)
        save_curvature(self.tables.files, run_id, checkpoint, stats, split)

    def load(self, run_id: str, checkpoint: str, split: str = "train") -> LayerCurvature:
        """Per layer ``(A, S, count)`` of the checkpoint's rows of ``split`` saved by a capture with
        ``curvature=True`` (``MissingCurvatureError`` if none was)."""
        return load_curvature(self.tables.files, run_id, checkpoint, split)

    def has(self, run_id: str, checkpoint: str, split: str = "train") -> bool:
        """Whether a capture with ``curvature=True`` saved statistics of the checkpoint's rows of ``split``."""
        return has_curvature(self.tables.files, run_id, checkpoint, split)
