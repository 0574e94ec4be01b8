"""One fitted-preconditioner cache for every way of scoring (attribute, self-influence, select, indexes).

A fit is keyed by a frozen :class:`FitSpec` (the selected rows, the preconditioner, its block structure and
eigenvalue correction). Damping is not part of the key: a fit keeps its eigendecomposition and is re-damped
when it is used, so one fit serves every damping. Fits are held in memory and persisted as side files
(``fits/<key>/``, a manifest written last) with the row count and largest ``grad_id`` they were fitted
on; rows appended to the selection since make the fit stale, and it is fitted again.

A fit runs on an :mod:`engine <gradstore.core.engine>`: each pass of the preconditioner computes partial
statistics per shard of the selection (in this process, or as Ray tasks) and merges them exactly on the
caller's side (:func:`fit_on`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import asdict, astuple, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import numpy as np

from gradstore.core import StoreCore, gradient_filter, storage
from gradstore.core.engine import Engine, LocalEngine
from gradstore.core.shards import Shard, fragment_shards
from gradstore.errors import InvalidArgumentError, StoreCorruptError, StorePermissionError
from gradstore.preconditioning import (
    BLOCKED_PRECONDITIONER,
    DEFAULT_DAMPING,
    KRONECKER_PRECONDITIONER,
    TRUE_FISHER_SPLIT,
    BlockStructure,
    Preconditioning,
    check_blocks,
)
from gradstore.preconditioning.scoring import ScoringSpace
from indexers import FitStatistics, Preconditioner, VectorBlocks, load_preconditioner, make_preconditioner
from ingest.curvature import CURVATURE_SPLITS

log = logging.getLogger(__name__)

FITS = "fits"
MANIFEST = "manifest.json"
FIT_FORMAT = 2
"""The manifest's ``format``: stored fits of another (format 1: a low-rank Fisher's eigenvectors saved in float32,
wrong at small damping) are fitted again."""


def ids_digest(ids: np.ndarray) -> int:
    """An order-free 63-bit digest of a set of ``grad_id``s: the wrapped sum of each id's splitmix64 mix."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return int(z.sum(dtype=np.uint64) >> np.uint64(1))


@dataclass(frozen=True)
class Selection:
    """Which stored rows a fit or an index covers."""

    run: str
    checkpoint: str | None  # None: every row of the run (rows written without a checkpoint label)
    split: str = "train"
    where: str | None = None

    @property
    def filter(self) -> str:
        """The filter expression selecting the rows."""
        return gradient_filter(self.run, self.checkpoint, self.split, None, self.where)

    def blocks(self, store: StoreCore, block_rows: int = 65536) -> VectorBlocks:
        """A re-iterable source of ``(grad_ids, float32 vectors)`` blocks of the selected rows."""

        def source() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for block in store.iter_gradients(
                self.run,
                checkpoint=self.checkpoint,
                split=self.split,
                where=self.where,
                columns=(),
                block_rows=block_rows,
                selected_rows=self.count(store),
            ):
                yield block.grad_ids, block.vectors

        return source

    def shards(self, store: StoreCore, parts: int, columns: tuple[str, ...] = ()) -> list[Shard]:
        """The selected rows as at most ``parts`` shards of fragments (see :mod:`gradstore.core.shards`)."""
        return fragment_shards(store, self.run, self.filter, parts, columns=columns)

    def state(self, store: StoreCore) -> tuple[int, int]:
        """``(rows, digest of their grad_ids)`` of the selection now: a fit of other rows is stale. The digest
        (:func:`ids_digest`) changes with any row appended or deleted, also where as many were deleted as appended
        (``grad_id``s are not increasing: each writer draws its prefix at random). Kept per table version in the
        store's row cache (repeated calls on unchanged rows read nothing)."""

        def read() -> tuple[int, int]:
            ids = self.grad_ids(store)
            return len(ids), ids_digest(ids)

        return store.row_cache.memo(self.cache_key(store, "state"), read)

    def grad_ids(self, store: StoreCore) -> np.ndarray:
        """The ``grad_id``s of the selected rows (one pass over the id column)."""
        return store.scan(store.gradient_table_name(self.run), ["grad_id"], self.filter).column(0).to_numpy()

    def count(self, store: StoreCore) -> int:
        """Rows currently selected."""
        if not store.has_table(store.gradient_table_name(self.run)):
            return 0
        return self.state(store)[0]

    def cache_key(self, store: StoreCore, what: str) -> tuple:
        """The store's row cache key of ``what`` about this selection at its gradient table's current version."""
        return (store.gradient_dataset(self.run).version, astuple(self), (what,))


KroneckerSource = Literal["train", "true-fisher", "rows"]
"""Where a ``kfac`` fit's factors come from: the Kronecker statistics a capture with ``curvature=True`` saved for the
checkpoint's training rows (``"train"``) or for its true-Fisher rows (``"true-fisher"``), or, where none were saved,
estimated from the selected rows themselves (``"rows"``: ``A = E[G^T G]``, ``S = E[G G^T] / E[|G|^2]``,
:mod:`indexers.kfac`)."""


@dataclass(frozen=True)
class FitSpec:
    """Everything a fitted preconditioner depends on, except the damping."""

    selection: Selection
    preconditioner: str
    blocks: Literal["layer", "full"] | None = None  # fisher only
    eigen_correction: bool = False  # kfac only
    factors: KroneckerSource | None = None  # kfac only: where its Kronecker factors come from (kronecker_source)

    def key(self) -> str:
        """A stable file-system safe key (``factors`` counts only where set: keys of other fits are unchanged)."""
        fields = {name: value for name, value in asdict(self).items() if name != "factors" or value is not None}
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def fit_spec(
    store: StoreCore, selection: Selection, method: Preconditioning, blocks: BlockStructure = "auto"
) -> FitSpec:
    """The :class:`FitSpec` of ``method`` over ``selection`` (``blocks="auto"``: :func:`auto_blocks`): over the
    selection's true-Fisher rows instead (:func:`curvature_selection`) for methods that fit on them, with the
    Kronecker factors of those rows for ``kfac`` fits (:func:`kronecker_source`)."""
    check_blocks(blocks)
    if method.true_fisher:
        selection = curvature_selection(store, selection)
    structure = None
    if method.blocked:
        structure = blocks if blocks != "auto" else auto_blocks(store, selection.run)
    elif blocks != "auto":
        raise InvalidArgumentError(f"blocks={blocks!r} applies to the fisher method, not {method.name!r}")
    factors = kronecker_source(store, selection) if method.kronecker else None
    return FitSpec(selection, method.preconditioner, structure, method.eigen_correction, factors)


def kronecker_source(store: StoreCore, selection: Selection) -> KroneckerSource:
    """Where a ``kfac`` fit over ``selection`` takes its Kronecker factors (:data:`KroneckerSource`): the factors a
    capture with ``curvature=True`` saved for the checkpoint's rows of the selection's split (the true-Fisher rows'
    own factors when :func:`curvature_selection` chose them, so eigenbasis and EK-FAC eigenvalues come from the same
    rows); else the checkpoint's training-row factors (a store whose true-Fisher rows were captured without
    curvature, or before true-Fisher factors were kept: its eigenbasis is the empirical Fisher's, and a warning says
    so when it is fitted); else estimated from the selected rows (rows captured without ``curvature=True``)."""
    if selection.checkpoint is None:
        return "rows"
    if selection.split in CURVATURE_SPLITS and store.has_curvature(
        selection.run, selection.checkpoint, selection.split
    ):
        return selection.split  # type: ignore[return-value]
    if store.has_curvature(selection.run, selection.checkpoint, "train"):
        return "train"
    return "rows"


def curvature_selection(store: StoreCore, selection: Selection) -> Selection:
    """The rows a curvature is fitted on for the training rows ``selection``: the checkpoint's rows of split
    ``"true-fisher"`` (labels sampled from the model: the true Fisher, a GGN) when it has any (all of them:
    ``where`` selects training rows, not the model's curvature), else ``selection`` itself (the empirical
    Fisher of the training rows)."""
    curvature = Selection(selection.run, selection.checkpoint, TRUE_FISHER_SPLIT)
    if selection.split != TRUE_FISHER_SPLIT and curvature.count(store) > 0:
        return curvature
    return selection


def auto_blocks(store: StoreCore, run: str) -> Literal["layer", "full"]:
    """``blocks="auto"``: one Fisher block per layer for a run captured with a projection spec (per-layer blocks
    scored a higher held-out LDS than one full block at every size measured, bench/fidelity.py), one full block
    for a run written without layers."""
    return "layer" if store.run_projection(run) is not None else "full"


class FitCache:
    """Fitted preconditioners of one store, by :class:`FitSpec`, in memory and in side files."""

    def __init__(self, store: StoreCore) -> None:
        self.store = store
        self._fits: dict[FitSpec, tuple[tuple[int, int], Preconditioner]] = {}
        self.fitted = 0  # passes over the data made by this cache (for tests and logs)

    def space(
        self,
        selection: Selection,
        method: Preconditioning,
        blocks: BlockStructure = "auto",
        damping: float | None = None,
        engine: Engine | None = None,
    ) -> ScoringSpace:
        """The scoring space of ``method`` over ``selection``: its fit from this cache, re-damped."""
        return ScoringSpace(method, self.get(fit_spec(self.store, selection, method, blocks), damping, engine=engine))

    def get(
        self, spec: FitSpec, damping: float | None = None, *, refit: bool = False, engine: Engine | None = None
    ) -> Preconditioner:
        """The preconditioner of ``spec`` re-damped to ``damping`` (default 0.1; ignored by undamped ones),
        fitted now (on ``engine``, default in this process) only if no up-to-date fit exists (or ``refit``)."""
        state = spec.selection.state(self.store)
        if state[0] == 0:
            raise InvalidArgumentError(f"no rows match {spec.selection}: capture the run first")
        fitted = None if refit else self._cached(spec, state)
        if fitted is None:
            fitted = self._fit(spec, engine or LocalEngine())
            self._save(spec, state, fitted)
        self._fits[spec] = (state, fitted)
        damping = DEFAULT_DAMPING if damping is None else float(damping)
        return fitted.with_damping(damping) if hasattr(fitted, "with_damping") else fitted

    def _cached(self, spec: FitSpec, state: tuple[int, int]) -> Preconditioner | None:
        if spec in self._fits and self._fits[spec][0] == state:
            return self._fits[spec][1]
        key = spec.key()
        with self.store.files.reading(FITS, key):  # not while another process replaces it
            return self._stored(key, state)

    def _stored(self, key: str, state: tuple[int, int]) -> Preconditioner | None:
        """The fit stored under ``key`` if it was made of the rows ``state`` describes."""
        try:
            manifest = json.loads(self.store.files.read_bytes(FITS, key, MANIFEST))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            log.warning("fit %s has a damaged manifest; fitting again", key)
            return None
        if (manifest.get("rows"), manifest.get("max_grad_id")) != state or manifest.get("format", 1) != FIT_FORMAT:
            return None
        try:
            with self.store.files.local_directory(FITS, key, "preconditioner") as directory:
                return load_preconditioner(directory)
        except StorePermissionError:
            raise
        except (OSError, ValueError, KeyError) as error:
            refused = storage.permission_error(error, self.store.uri, f"read fitted preconditioner {key}")
            if refused is not None:
                raise refused from error
            raise StoreCorruptError(
                f"fitted preconditioner {key} of store {self.store.uri} is damaged: {error}"
            ) from error

    def _fit(self, spec: FitSpec, engine: Engine) -> Preconditioner:
        preconditioner = self._unfitted(spec)
        self.fitted += 1
        return fit_on(engine, spec.selection.shards(self.store, engine.parallelism), preconditioner)

    def _unfitted(self, spec: FitSpec) -> Preconditioner:
        """A new preconditioner for ``spec``: the projected Fisher with its blocks, K-FAC over the run's Kronecker
        layout, or any other by name."""
        if spec.preconditioner == BLOCKED_PRECONDITIONER:
            return self._blocked(spec)
        if spec.preconditioner == KRONECKER_PRECONDITIONER:
            return self._kronecker(spec)
        return make_preconditioner(spec.preconditioner, damping=DEFAULT_DAMPING)  # identity, cosine: not damped

    def _blocked(self, spec: FitSpec) -> Preconditioner:
        blocks = None
        if spec.blocks == "layer":
            layers = self.store.run_spec(spec.selection.run, "a per-layer Fisher (blocks='layer')").layers
            blocks = [(s.offset, s.size) for s in layers]
        return make_preconditioner(spec.preconditioner, damping=DEFAULT_DAMPING, blocks=blocks)

    def _kronecker(self, spec: FitSpec) -> Preconditioner:
        layers = self.store.run_spec(
            spec.selection.run, f"method {spec.preconditioner!r} (its Kronecker layout)"
        ).layers
        dense = [s.name for s in layers if s.mode == "dense"]
        if dense:
            raise InvalidArgumentError(f"kfac needs Kronecker-structured rows; layers {dense} use a dense projection")
        layout = [(s.name, s.offset, s.k_in, s.k_out) for s in layers]
        selection, source = spec.selection, spec.factors or "rows"
        factors, count = None, None  # "rows": estimated from the selected rows themselves
        if source != "rows":
            curvature = self.store.load_curvature(selection.run, str(selection.checkpoint), source)
            factors = {name: (a, s) for name, (a, s, _) in curvature.items()}
            counts = {tokens for _, _, tokens in curvature.values()}  # the captured tokens, one count for every layer
            count = counts.pop() if len(counts) == 1 else None
            missing = [name for name, *_ in layout if name not in factors]
            if missing:  # layers whose per-example gradients capture formed whole (a parameter meeting the batch)
                warnings.warn(
                    f"run {selection.run!r} checkpoint {selection.checkpoint!r}: the captured Kronecker factors "
                    f"leave out layers {missing[:5]}{' ...' if len(missing) > 5 else ''} (captured whole per example, "
                    "with no input/output-gradient structure): every layer's factors are estimated from the rows "
                    "instead",
                    stacklevel=2,
                )
                factors, count, source = None, None, "rows"
        if selection.split == TRUE_FISHER_SPLIT and source == "train":
            uses = (
                "ekfac uses their eigenbasis (the empirical Fisher's) with eigenvalues refitted on the true-Fisher rows"
                if spec.eigen_correction
                else "kfac uses them (the empirical Fisher's)"
            )
            warnings.warn(
                f"run {selection.run!r} checkpoint {selection.checkpoint!r} has true-Fisher rows but only the training "
                f"rows' Kronecker factors: {uses}; capture the true-Fisher rows with curvature=True for the true "
                "Fisher's own factors",
                stacklevel=2,
            )
        elif source == "rows":
            log.info("%s: no Kronecker factors captured (curvature=True); estimated from the rows", selection)
        return make_preconditioner(
            "kfac",
            damping=DEFAULT_DAMPING,
            kronecker_layout=layout,
            kronecker_factors=factors,
            eigen_correction=spec.eigen_correction,
            kronecker_factor_count=count,
        )

    def _save(self, spec: FitSpec, state: tuple[int, int], fitted: Preconditioner) -> None:
        """Replace the stored fit of ``spec`` (its files, then the manifest that puts them in use), holding the
        key's writers' lock: processes fitting the same rows at once save one after the other. On a store this
        process may not write (or where the storage refuses the fit's files) the fit stays in memory only."""
        key = spec.key()
        if not self.store.writable:
            log.debug("store %s is read-only for this process: fit %s kept in memory", self.store.uri, key)
            return
        try:
            self._write(spec, key, state, fitted)
        except StorePermissionError as error:
            log.debug("fit %s kept in memory: %s", key, error)

    def _write(self, spec: FitSpec, key: str, state: tuple[int, int], fitted: Preconditioner) -> None:
        manifest = {
            **asdict(spec),
            "rows": state[0],
            "max_grad_id": state[1],
            "format": FIT_FORMAT,
            "projection_fingerprint": self.store.run(spec.selection.run)["projection_fingerprint"],
            "fitted_at": datetime.now(timezone.utc).isoformat(),
        }
        with self.store.files.writing(FITS, key), tempfile.TemporaryDirectory(prefix="gradstore-fit-") as scratch:
            self.store.files.remove(FITS, key)
            fitted.save(Path(scratch))
            self.store.files.put_directory(Path(scratch), FITS, key, "preconditioner")
            self.store.files.write_bytes(json.dumps(manifest, indent=2, sort_keys=True).encode(), FITS, key, MANIFEST)


def fit_on(engine: Engine, shards: list[Shard], preconditioner: Preconditioner) -> Preconditioner:
    """Fit ``preconditioner`` over the rows of ``shards``: per pass, statistics per shard on ``engine``,
    merged in shard order, then finished here."""
    for stage in range(preconditioner.passes):
        parts = engine.map(_statistics, shards, (preconditioner, stage))
        preconditioner.finish(FitStatistics.combine(parts), stage)
    return preconditioner


def _statistics(shard: Shard, payload: tuple[Preconditioner, int]) -> FitStatistics:
    preconditioner, stage = payload
    return preconditioner.statistics(shard.source(), stage)
