"""The preconditioner protocol and the plumbing its implementations share (dtypes, damping, files).

A preconditioner ``P`` approximates the curvature of the loss in the projected gradient space. Scores are
``q^T P^-1 g``: either apply ``P^-1`` to the query only (the stored vectors stay raw) or ``P^-1/2`` to both
sides (cosine in the whitened space, self-influence ``g^T P^-1 g``). All statistics are accumulated in
float64 while streaming over blocks of rows; applying runs in float32 (float64 for float64 inputs).

Fitting is split so that it can run on shards of the rows (processes, machines): ``fit`` makes
``passes`` passes; pass ``stage`` computes :class:`FitStatistics` (float64 sums) over any subset of the
rows with ``statistics(rows, stage)``, the partial statistics of disjoint subsets are merged exactly (sums
add), and ``finish(merged, stage)`` folds them into the state. ``fit(rows)`` is exactly that composition
on one subset (:func:`fit_in_passes`), so a fit over shards equals a fit over all rows up to the order of
float64 additions.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from indexers.blocks import Rows, VectorBlocks, as_source, as_tensor, unpack_block

CONFIG_FILE = "preconditioner.json"
STATE_FILE = "state.npz"
DAMPED_BYTES = 512 << 20  # damping-dependent tensors a DeviceCache keeps (its newest entry in any case)


@runtime_checkable
class Preconditioner(Protocol):
    """What every preconditioner offers; see the module docstring for the two ways of applying it."""

    name: str
    passes: int  # passes over the rows a fit makes

    def fit(self, blocks: Rows) -> Preconditioner:
        """Accumulate statistics over the rows of a block source or array (streaming, float64); returns self."""
        ...

    def statistics(self, blocks: Rows, stage: int = 0) -> FitStatistics:
        """Partial statistics of pass ``stage`` over these rows (earlier passes must be finished)."""
        ...

    def finish(self, statistics: FitStatistics, stage: int = 0) -> Preconditioner:
        """Fold the merged statistics of pass ``stage`` (over all rows) into the state; returns self."""
        ...

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        """``P^-1 q`` for ``q`` of shape ``[dim]`` or ``[m, dim]``."""
        ...

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 x``, applied to queries and stored vectors alike."""
        ...

    def save(self, path: str | os.PathLike) -> None:
        """Write the fitted state to the directory ``path`` (JSON config + npz arrays)."""
        ...

    @classmethod
    def load(cls, path: str | os.PathLike) -> Preconditioner:
        """Read a preconditioner written by :meth:`save`."""
        ...


#: Prefix of a :class:`FitStatistics` key that holds a stack of rows rather than a sum.
STACKED = "stack_"


@dataclass
class FitStatistics:
    """Float64 sums of one fitting pass over some rows, keyed by name, and the row count.

    Statistics of disjoint sets of rows merge by adding their sums (:meth:`merge`); an empty set has no
    sums and merges as the identity. A key starting with :data:`STACKED` holds rows themselves (a part with fewer
    rows than their sum would take): stacks are concatenated, and where either part holds one, a sum present in
    one part only is taken as it is (the preconditioner adds the stack's contribution in ``finish``)."""

    rows: int = 0
    sums: dict[str, np.ndarray] = field(default_factory=dict)

    def merge(self, other: FitStatistics) -> FitStatistics:
        """The statistics of both sets of rows (the sums added; keys and shapes must agree)."""
        if not other.sums:
            return FitStatistics(self.rows + other.rows, dict(self.sums))
        if not self.sums:
            return FitStatistics(self.rows + other.rows, dict(other.sums))
        stacked = any(key.startswith(STACKED) for key in (*self.sums, *other.sums))
        if self.sums.keys() != other.sums.keys() and not stacked:
            raise ValueError(f"statistics disagree on their sums: {sorted(self.sums)} vs {sorted(other.sums)}")
        merged = {**self.sums, **other.sums}
        for key in self.sums.keys() & other.sums.keys():
            value, more = self.sums[key], other.sums[key]
            if key.startswith(STACKED):
                if value.shape[1:] != more.shape[1:]:
                    raise ValueError(f"statistics {key!r} stack rows of shapes {value.shape} and {more.shape}")
                merged[key] = np.concatenate([value, more])
            elif value.shape != more.shape:
                raise ValueError(f"statistics {key!r} have shapes {value.shape} and {more.shape}")
            else:
                merged[key] = value + more
        return FitStatistics(self.rows + other.rows, merged)

    @staticmethod
    def combine(parts: Iterable[FitStatistics]) -> FitStatistics:
        """All parts merged, in order."""
        total = FitStatistics()
        for part in parts:
            total = total.merge(part)
        return total


def fit_in_passes(preconditioner: Preconditioner, blocks: Rows) -> Preconditioner:
    """``fit`` as the composition every preconditioner uses: each pass's statistics over all the rows,
    then ``finish``."""
    source: VectorBlocks = as_source(blocks)
    for stage in range(preconditioner.passes):
        preconditioner.finish(preconditioner.statistics(source, stage), stage)
    return preconditioner


def tensor_sums(sums: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """float64 tensors as numpy arrays (what :class:`FitStatistics` holds)."""
    return {key: value.numpy() for key, value in sums.items()}


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else (float16, bfloat16, float32) is computed in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def float64_blocks(rows: Rows) -> Iterator[torch.Tensor]:
    """Each block of a source (or the one array) as a float64 CPU ``[rows, dim]`` tensor (scales applied),
    checking the dimension is constant."""
    dim = None
    for block in as_source(rows)():
        _, vectors, scales = unpack_block(block)
        tensor = as_tensor(vectors, torch.float64, "cpu")
        if scales is not None:
            tensor = tensor * torch.from_numpy(scales).to(torch.float64)[:, None]
        if dim is not None and tensor.shape[1] != dim:
            raise ValueError(f"blocks disagree on the vector dimension: {dim} then {tensor.shape[1]}")
        dim = tensor.shape[1]
        yield tensor


def apply_rows(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run ``fn`` on ``x`` as a ``[m, dim]`` tensor in the compute dtype; a 1-D ``x`` gives a 1-D result."""
    rows = x.to(compute_dtype(x))
    if rows.ndim == 1:
        return fn(rows.unsqueeze(0)).squeeze(0)
    if rows.ndim != 2:
        raise ValueError(f"expected a vector or a [m, dim] matrix, got shape {tuple(x.shape)}")
    return fn(rows)


def check_damping(damping: float) -> float:
    """Damping must be a finite non-negative number."""
    damping = float(damping)
    if not np.isfinite(damping) or damping < 0:
        raise ValueError(f"damping must be finite and >= 0, got {damping}")
    return damping


def absolute_damping(damping: float, eigenvalues: torch.Tensor, size: int | None = None) -> float:
    """The damping added to the eigenvalues: ``damping * mean(eigenvalues)``.

    ``size``: how many eigenvalues there are in all when only the largest are given (a low-rank fit: the others
    are zero), so the mean is ``sum / size``. If every eigenvalue is zero (e.g. all-zero gradients) the damping
    is used as an absolute value."""
    if size is None or size == eigenvalues.numel():
        mean = float(eigenvalues.mean()) if eigenvalues.numel() else 0.0
    else:
        mean = float(eigenvalues.sum()) / size if size else 0.0
    return damping * mean if mean > 0 else damping


def check_tiling(spans: Sequence[tuple[int, int]], dim: int, what: str) -> None:
    """Raise unless the ``(offset, size)`` spans cover ``[0, dim)`` exactly, without overlap."""
    position = 0
    for offset, size in sorted(spans):
        if offset != position or size <= 0:
            raise ValueError(f"{what} must tile the {dim}-dim vector without gaps or overlaps; got {list(spans)}")
        position = offset + size
    if position != dim:
        raise ValueError(f"{what} cover {position} of {dim} dims; they must cover the whole vector")


def save_state(path: str | os.PathLike, config: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Write ``config`` (JSON, must contain ``name``) and ``arrays`` (npz) into the directory ``path``."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / STATE_FILE, **arrays)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON config of a saved preconditioner."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no saved preconditioner at {path} (missing {CONFIG_FILE})")
    return json.loads(config_path.read_text())


def load_state(path: str | os.PathLike, name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read ``(config, arrays)`` written by :func:`save_state`, checking the saved name."""
    config = read_config(path)
    if config.get("name") != name:
        raise ValueError(f"{path} holds a {config.get('name')!r} preconditioner, not {name!r}")
    with np.load(Path(path) / STATE_FILE) as state:
        arrays = {key: state[key] for key in state.files}
    return config, arrays


class DeviceCache:
    """Copies of state tensors, converted once per (device, dtype) for applying, and tensors that depend on the
    damping (weights, a dense matrix), kept for the most recently used dampings within ``damped_bytes``.

    A preconditioner's re-damped copies (``with_damping``) share its cache, so a repeat call at a damping already
    used converts and builds nothing. Thread-safe (two threads may both build an entry; one copy is kept). Not
    pickled: a copy sent to another process starts empty."""

    def __init__(self, damped_bytes: int = DAMPED_BYTES) -> None:
        self.damped_bytes = damped_bytes
        self._copies: dict[tuple[str, str, torch.device, torch.dtype], torch.Tensor] = {}
        self._damped: OrderedDict[tuple[str, str, float, torch.device, torch.dtype], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, variant: str, make: Callable[[], torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """The tensor ``make()`` (CPU) as ``like``'s device and compute dtype, built on first use."""
        dtype = compute_dtype(like)
        cache_key = (key, variant, like.device, dtype)
        with self._lock:
            found = self._copies.get(cache_key)
        if found is None:
            found = make().to(device=like.device, dtype=dtype)
            with self._lock:
                found = self._copies.setdefault(cache_key, found)
        return found

    def peek_damped(self, key: str, variant: str, damping: float, like: torch.Tensor) -> torch.Tensor | None:
        """The entry :meth:`get_damped` would return, if it is held now (``None`` otherwise; nothing is built)."""
        cache_key = (key, variant, float(damping), like.device, compute_dtype(like))
        with self._lock:
            found = self._damped.get(cache_key)
            if found is not None:
                self._damped.move_to_end(cache_key)
        return found

    def get_damped(
        self, key: str, variant: str, damping: float, make: Callable[[], torch.Tensor], like: torch.Tensor
    ) -> torch.Tensor:
        """As :meth:`get` for a tensor of one damping; the least recently used are dropped beyond the budget
        (the newest entry is kept whatever its size)."""
        found = self.peek_damped(key, variant, damping, like)
        if found is not None:
            return found
        dtype = compute_dtype(like)
        cache_key = (key, variant, float(damping), like.device, dtype)
        made = make().to(device=like.device, dtype=dtype)
        with self._lock:
            self._damped[cache_key] = made
            held = sum(t.numel() * t.element_size() for t in self._damped.values())
            while held > self.damped_bytes and len(self._damped) > 1:
                _, dropped = self._damped.popitem(last=False)
                held -= dropped.numel() * dropped.element_size()
        return made

    def __getstate__(self) -> dict[str, Any]:
        return {"damped_bytes": self.damped_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["damped_bytes"])
