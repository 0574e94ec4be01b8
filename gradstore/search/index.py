"""Attribution indexes: a fitted preconditioner plus a top-k structure over one selection of training rows.

An index is built from the rows of one run/checkpoint/split (optionally a SQL ``where``); its manifest
(side files ``indexes/<name>/``) names exactly what it was built from (run, checkpoint, split, filter,
projection fingerprint, method, damping, kind, rows). The preconditioner comes from the store's
:class:`~gradstore.preconditioning.fitting.FitCache` (one fit per rows and method, re-damped on use), so an index of
another damping costs no pass over the data and no second copy of the fit. Building is
:mod:`gradstore.search.building`, loading :mod:`gradstore.search.loading`; loading an index whose manifest does
not match the store (another projection, another dimension) raises ``IndexMismatchError``.

Kinds: ``"exact"`` (blocked matmul + running top-k over the stored rows, which the first search reads once
into the store's in-memory :class:`~gradstore.core.row_cache.RowCache` when they fit its budget), or a FAISS
factory string of the forms :data:`indexers.faiss_index.FACTORY_FORMS` describes (``"Flat"``, ``"HNSW32,Flat"``,
``"IVF1024,Flat"``, ...: others are refused before FAISS sees them); ``"auto"`` picks by
:func:`indexers.choose_index_kind` and reports the recall of an ANN index against exact search. A FAISS index
holds the rows in the balanced space (:meth:`~gradstore.preconditioning.scoring.ScoringSpace.balanced`: ``P^-1/2`` on
rows and queries alike, manifest ``first_stage: "balanced"``); indexes built before it hold the prepared rows and are
searched with prepared queries. Rows appended since the build enter the FAISS index in the build's fit (manifest
``fit_state``: the rows it was made of), and a search without ``rerank`` then warns that its scores are that fit's
(:class:`~gradstore.errors.StaleIndexWarning`). On real gradients only an exhaustive compressed scan or an HNSW
graph over the balanced rows holds the neighbours (``docs/scale.md``): IVF partitions do not. A FAISS search can
find fewer than ``k`` rows for a query (the IVF lists probed, or the HNSW graph search, hold fewer): it warns, and
:func:`valid_entries` keeps only the rows found.

Where searches run (``device=``, :func:`check_device`; :attr:`AttributionIndex.search_path` says where they do):
exact search on the torch device asked for, by default CUDA when torch sees a GPU; FAISS on every GPU where faiss
can use them, except HNSW graphs (no GPU version) and with ``device="cpu"``.
"""

from __future__ import annotations

import json
import logging
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from gradstore.core import StoreCore
from gradstore.core.engine import Engine, EngineName, LocalEngine, resolve_engine
from gradstore.core.index_cache import LoadedIndex
from gradstore.core.row_cache import cache_file_name, dataset_content
from gradstore.core.sidefiles import CHECKSUM_SUFFIX
from gradstore.core.stored_rows import stored_blocks
from gradstore.errors import (
    InvalidArgumentError,
    StaleIndexWarning,
    StorePermissionError,
    surface,
)
from gradstore.preconditioning import Preconditioning
from gradstore.preconditioning.fitting import FitCache, FitSpec, Selection
from gradstore.preconditioning.scoring import ScoringSpace, as_float32
from gradstore.search.arguments import check_k, check_query_vectors, check_rerank, query_array
from gradstore.search.rerank import RowLocator
from gradstore.search.rerank import rerank as exact_rerank
from gradstore.search.scan_tasks import TopK, top_k
from indexers import (
    MISSING_ID,
    UNIT_BF16_NORM,
    ExactIndex,
    FaissIndex,
    FewerResultsWarning,
    Preconditioner,
    PreparedRows,
    VectorBlocks,
    found_counts,
    gpu_available,
    packed,
    prefetched,
    resolve_device,
)
from indexers.saved_rows import rows_from_state

log = logging.getLogger(__name__)

INDEXES = "indexes"
MANIFEST_FILE = "manifest.json"
IDS_FILE = "ids.npy"
#: The manifest key naming the directory of the index's FAISS files (``faiss`` before it was written).
FAISS_FILES = "faiss_files"
FAISS_PREFIX = "faiss"
#: The manifest key saying what space the FAISS index's rows are in; ``BALANCED`` for every index built now.
FIRST_STAGE = "first_stage"
BALANCED = "balanced"
#: The manifest key of a FAISS index's ``[rows, digest of their grad_ids]`` of the rows its fit was made of when built
#: (rows appended since enter the index in that fit's space: :meth:`AttributionIndex._warn_if_stale`).
FIT_STATE = "fit_state"
#: The manifest key of the ``[rows, digest of their grad_ids]`` of the index's selection when last built or brought up
#: to date (a change of the rows it covers: :meth:`AttributionIndex._warn_if_stale`).
ROWS_STATE = "rows_state"
READ_BLOCK_ROWS = 65536  # rows per Lance read: the next read overlaps preparing (or scoring) this one
#: The share of a GPU's free memory that one selection's prepared rows may take in the row cache; the rest stays
#: for the search's own buffers and whatever else runs on the device (training, other caches).
DEVICE_CACHE_SHARE = 0.5


class AttributionIndex:
    """A fitted preconditioner and a search structure over a :class:`Selection` of a store."""

    def __init__(
        self,
        store: StoreCore,
        manifest: dict[str, Any],
        space: ScoringSpace,
        faiss_index: FaissIndex | None = None,
        indexed_ids: np.ndarray | None = None,
        cache_bytes: int | None = None,
        first_space: ScoringSpace | None = None,
        device: str | torch.device | None = None,
        *,
        fits: FitCache,
        spec: FitSpec,
    ) -> None:
        self.device = check_device(manifest["kind"], manifest["dim"], device)
        """The device searches were asked to run on (:func:`check_device`), ``None`` for the default; where they
        do run: :attr:`search_path`."""
        self.store = store
        self.manifest = manifest
        self.space = space
        self.first_space = first_space or space
        """The space the FAISS rows were made in: the fit as it was when the index was built (a refit of rows
        appended since re-scores candidates, it does not move the rows already indexed)."""
        self.fits = fits
        self.spec = spec
        """What the method's fit depends on (:class:`~gradstore.preconditioning.fitting.FitSpec`), taken from
        ``fits`` (the store's :class:`~gradstore.preconditioning.fitting.FitCache`) again when its rows change."""
        self.fit_selection = spec.selection
        """The rows the method's fit is made of: the index's own, or the checkpoint's true-Fisher rows for
        methods fitted on those (:func:`~gradstore.preconditioning.fitting.curvature_selection`)."""
        self._fit_state = list(self.fit_selection.state(store))  # the rows the fit of ``space`` was made of
        self.faiss_index = faiss_index
        self.indexed_ids = np.empty(0, np.int64) if indexed_ids is None else indexed_ids  # grad_ids in FAISS
        self.cache_bytes = cache_bytes
        self._gpu_copy: FaissIndex | None = None
        self._locator = RowLocator()  # grad_id -> stored row, for re-ranking FAISS candidates

    @property
    def name(self) -> str:
        """The index's name."""
        return self.manifest["name"]

    @property
    def method(self) -> Preconditioning:
        """The attribution method the index scores with."""
        return self.space.method

    @property
    def preconditioner(self):
        """The fitted (and damped) preconditioner."""
        return self.space.preconditioner

    @property
    def selection(self) -> Selection:
        """The rows the index covers."""
        m = self.manifest
        return Selection(m["run_id"], m["checkpoint"], m["split"], m["where"])

    @property
    def search_path(self) -> str:
        """Where and how a search of this index runs on this machine, e.g. ``"exact, bfloat16 kernel on cpu"``
        (the bf16 screen where the CPU multiplies bf16 natively, float32 elsewhere and on CUDA; the torch device
        the search uses, ``"cuda:1"`` when asked for) or ``"faiss IVF1024,Flat on gpu"`` (a copy on every GPU, where
        faiss has GPU support and a driver answers, unless ``device="cpu"``; once searched, where the copy searched
        is). HNSW graphs are searched on the CPU: FAISS has no GPU version of them. Exact searches on an engine
        other than this process score on its workers' CPUs; FAISS GPU searches of ``k`` above
        :data:`indexers.faiss_index.GPU_MAX_K` on a CPU copy."""
        if self.faiss_index is not None:
            on_gpu = self._gpu_copy.on_gpu if self._gpu_copy is not None else self._faiss_on_gpu()
            return f"faiss {self.manifest['kind']} on {'gpu' if on_gpu else 'cpu'}"
        exact = self._exact()
        return f"exact, {exact.kernel} kernel on {exact.device}"

    def prepare_queries(self, queries: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Queries in the space the stored rows are searched in."""
        return self.space.queries(queries)

    @surface
    def search(
        self,
        queries: np.ndarray | torch.Tensor,
        k: int,
        largest: bool = True,
        engine: EngineName | Engine | None = None,
        rerank: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (``largest``) or bottom-k scores and ``grad_id``s for raw query vectors ``[q, dim]``. ``engine``
        (``"local"``, ``"ray"`` or an :class:`~gradstore.core.engine.Engine`): where an exact index reads and scores
        its rows; a FAISS index searches in this process (its ``rerank=`` too), so it takes none but the local one.
        ``largest`` is ``True`` or ``False`` (anything else is an ``InvalidArgumentError``)."""
        engine = None if engine is None else resolve_engine(engine)
        if self.faiss_index is not None and engine is not None and not isinstance(engine, LocalEngine):
            raise InvalidArgumentError(
                f"index {self.name!r} ({self.manifest['kind']}) is searched by FAISS in this process: engine= applies "
                f"to exact indexes; leave it unset or 'local' (got {type(engine).__name__})"
            )
        return self.search_sides(queries, k, (largest,), engine, rerank)[largest]

    def search_sides(
        self,
        queries: np.ndarray | torch.Tensor,
        k: int,
        sides: tuple[bool, ...] = (True,),
        engine: Engine | None = None,
        rerank: int = 0,
    ) -> TopK:
        """Top-k (``True`` in ``sides``) and bottom-k (``False``) in one scan of the rows.

        Exact search reads the rows on ``engine`` (default: this process, from the rows the store's row
        cache holds, see :meth:`_rows`); FAISS search runs here, and with ``rerank=m`` its
        ``m * k`` best candidates are re-scored exactly from the stored rows (:mod:`gradstore.search.rerank`).

        Every side is ``(scores [q, k'], grad_ids [q, k'])``, best first, ``k' = min(k, rows)``. A FAISS search may
        find fewer than ``k'`` rows for some queries (the IVF lists probed, or the HNSW graph search, hold fewer;
        reranked candidates deleted since the build): their rows end in entries of ``grad_id`` ``-1``
        (:data:`~indexers.faiss_index.MISSING_ID`, score ``-inf``), which :func:`valid_entries` leaves out, and one
        :class:`~indexers.FewerResultsWarning` per call says how many queries and what finds more; a FAISS index
        whose selection changed since it was built warns too (:meth:`_warn_if_stale`).

        ``queries``: a numeric array or tensor ``[q, dim]`` of finite values; ``k`` a whole number >= 1; ``rerank``
        one >= 0, and 0 for an exact index: the checks of ``attribute`` (:mod:`gradstore.search.arguments`)."""
        k = check_k(k)
        rerank = check_rerank(rerank, self.manifest["kind"])
        queries = check_query_vectors(query_array(queries), self.manifest["dim"], f"index {self.name!r}")
        if self.faiss_index is not None:
            if False in sides:
                raise InvalidArgumentError(
                    "opponents (bottom-k) need an exact index: FAISS returns the largest scores only"
                )
            self._warn_if_stale(rerank)
            first = self.first_stage(queries, rows=False)
            if rerank > 0:
                prepared = self._current_space().queries(queries)
                _, candidates = self._searchable().search(first, rerank * k, warn=False)
                scores, ids = exact_rerank(
                    self.store, self.selection.run, self.space, prepared, candidates, k, self._locator
                )
                scores, ids = packed(scores, ids, (ids == MISSING_ID) | np.isneginf(scores))
            else:
                scores, ids = self._searchable().search(first, k, warn=False)
            self._warn_if_short(ids, k, rerank)
            return {True: (scores, ids)}
        prepared = self._current_space().queries(queries)
        engine = engine or LocalEngine()
        if not isinstance(engine, LocalEngine) and self.device is not None and self.device.type != "cpu":
            raise InvalidArgumentError(
                f"device={str(self.device)!r} is where this process searches; engine {type(engine).__name__} "
                "scores the rows on its workers' CPUs: search with engine='local' or leave device unset"
            )
        if isinstance(engine, LocalEngine):  # stream the stored rows with read-ahead, or search the cache
            rows = self._rows()
            return {side: self._exact().search(prepared, rows, k, largest=side) for side in sides}
        shards = self.selection.shards(self.store, engine.parallelism)
        return top_k(engine, shards, self.space, prepared, k, sides)

    def _current_space(self) -> ScoringSpace:
        """:attr:`space` with the fit of the rows the method is fitted on now: where rows were appended to (or
        deleted from) them since this index got its fit, in this process or another, the store's fit of the rows
        now (:class:`~gradstore.preconditioning.fitting.FitCache`: a pass over them when none is stored), as
        ``attribute`` and a newly loaded index score with. Exact search and ``rerank=`` score in it; a FAISS index's
        own rows stay in the fit they were added in (:meth:`_warn_if_stale`)."""
        if self.space.preconditioner.passes == 0:  # a method without a fit
            return self.space
        now = list(self.fit_selection.state(self.store))
        if now != self._fit_state:
            self.space = ScoringSpace(self.method, self.fits.get(self.spec, self.manifest.get("damping")))
            self._fit_state = now
        return self.space

    def use_fit(self, preconditioner: Preconditioner) -> None:
        """Score with ``preconditioner``, the fit of the rows :attr:`fit_selection` holds now."""
        self.space = ScoringSpace(self.method, preconditioner)
        self._fit_state = list(self.fit_selection.state(self.store))

    def _warn_if_short(self, ids: np.ndarray, k: int, rerank: int) -> None:
        """One :class:`~indexers.FewerResultsWarning` when some queries of a FAISS search got fewer than
        ``min(k, rows indexed)`` rows: how many, why, and what finds more."""
        wanted = min(k, self.faiss_index.ntotal)
        short = int((found_counts(ids) < wanted).sum())
        if not short:
            return
        faiss_index = self._searchable()
        if faiss_index.nlist is not None:
            fix = (
                f"probe more lists (index.faiss_index.nprobe, now {faiss_index.nprobe}; {faiss_index.nlist} probes "
                "every list) or build with fewer lists (the N of kind='IVFN,...')"
            )
        elif faiss_index.graph:
            fix = (
                f"rerank more candidates (rerank=m searches the graph for m * k: now {max(rerank, 1)} * {k}) or raise "
                f"index.faiss_index.ef_search (now {faiss_index.ef_search})"
            )
        else:
            fix = "use another kind"
        deleted = " or candidates deleted since the index was built" if rerank > 0 else ""
        warnings.warn(
            f"index {self.name!r} ({self.manifest['kind']}) found fewer than k={k} rows for {short} of {len(ids)} "
            f"queries ({faiss_index.shortfall_reason()}{deleted}): those queries get fewer rows. For k rows, "
            f"search exactly (kind='exact'), {fix}",
            FewerResultsWarning,
            stacklevel=3,
        )

    def _warn_if_stale(self, rerank: int) -> None:
        """One :class:`~gradstore.errors.StaleIndexWarning` per kind of change when the rows of this FAISS index's
        selection changed since it was built or last brought up to date: rows it does not hold (build it again), or
        (without ``rerank``) rows appended since the fit its FAISS rows and queries are balanced with (manifest
        ``fit_state``: the fit's ``(rows, digest)`` then), whose scores are then not the current fit's."""
        indexed, selected = self.manifest["rows"], self.selection.state(self.store)
        if list(selected) != self.manifest.get(ROWS_STATE, [indexed, selected[1]]):
            changed = "" if selected[0] != indexed else " (as many rows deleted as appended)"
            warnings.warn(
                f"index {self.name!r} holds {indexed} rows and its selection {selected[0]} now{changed}: build it "
                "again (store.build_index with the same arguments) to add the rows appended since and drop the "
                "deleted ones",
                StaleIndexWarning,
                stacklevel=3,
            )
        if rerank or self.first_space.preconditioner.passes == 0:  # exact scores, or a method without a fit
            return
        built = self.manifest.get(FIT_STATE)
        now = list(self.fit_selection.state(self.store))
        if built == now:
            return
        since = (
            "were never recorded (an index of an older gradstore)"
            if built is None
            else f"were {built[0]} then and are {now[0]} now"
        )
        warnings.warn(
            f"index {self.name!r} ({self.manifest['kind']}) searches in the space of the {self.method.name} fit it "
            f"was built with, whose rows {since}: its scores are that fit's, not those of the current fit, which "
            "exact search and rerank= score with. Pass rerank=m to re-score m * k candidates with the current fit, "
            "or rebuild the index with store.build_index(..., refit=True)",
            StaleIndexWarning,
            stacklevel=3,
        )

    def first_stage(self, vectors: np.ndarray | torch.Tensor, rows: bool) -> np.ndarray:
        """Raw ``vectors`` (stored ``rows``, or queries) as the FAISS index holds and searches them: in the balanced
        space, or (indexes built before it) the prepared rows and queries."""
        if self.manifest.get(FIRST_STAGE) == BALANCED:
            return self.first_space.balanced(vectors).numpy()
        raw = as_float32(vectors)
        return (self.space.rows(raw) if rows else self.space.queries(raw)).to(torch.float32).numpy()

    def _rows(self) -> VectorBlocks | PreparedRows:
        """The rows to search: from the store's :class:`~gradstore.core.row_cache.RowCache` (rows prepared by an
        earlier search of the same rows at the same table version, by any index over them when the method
        searches the rows as stored), else from a row file an earlier process wrote (rows searched as stored,
        on the CPU: :mod:`gradstore.core.row_cache`), else read with read-ahead and prepared block by block as the
        search reaches them (the search of one block overlaps the read of the next) and kept there (and written
        to a row file) once all are prepared, or streamed when they exceed the cache's budget (``cache_bytes``
        of this index, when set, caps it)."""
        cache = self.store.row_cache
        key = self._cache_key()
        cached = cache.get(key)
        if cached is not None:
            return cached
        kernel = self._exact()
        stored = self.store.storage_dtype if self.method.query_only else "float32"
        selected = self.selection.count(self.store)
        nbytes = selected * self.manifest["dim"] * prepared_bytes(stored, kernel)
        too_large = not cache.admits(nbytes) or (self.cache_bytes is not None and nbytes > self.cache_bytes)
        kept = not too_large and device_admits(nbytes, kernel.device)
        if self.method.query_only:  # rows searched as stored: the kernel converts (or screens) them itself
            return self._stored_rows(kernel, key, selected, nbytes if kept else None)
        source = prepared_source(self.space, self.selection.blocks(self.store, READ_BLOCK_ROWS))
        if not kept:
            return prefetched(source)
        return kernel.prepare_blocks(prefetched(source), on_complete=lambda rows: cache.put(key, rows, nbytes))

    def _stored_rows(
        self, kernel: ExactIndex, key: tuple, selected: int, nbytes: int | None
    ) -> VectorBlocks | PreparedRows:
        """:meth:`_rows` of rows searched as stored: from their row file, else read (``nbytes``: what they take
        once prepared, ``None`` when they are not kept) and, once prepared, kept in the row cache and written to
        a row file, whose mapping then takes the place of the rows in memory."""
        cache, files = self.store.row_cache, self.store.row_files
        dataset = self.store.gradient_dataset(self.selection.run)
        name = self._row_file_name(dataset, kernel) if nbytes is not None and dataset.version == key[0] else None

        def check(state: Any) -> PreparedRows:
            return rows_from_state(state, kernel.kernel, self.manifest["dim"], selected)

        found = None if name is None else files.load(name, check)
        if found is not None:
            cache.put(key, found, nbytes)
            return found
        source = stored_blocks(
            self.store, *astuple(self.selection), block_rows=READ_BLOCK_ROWS, selected_rows=selected, dataset=dataset
        )
        if nbytes is None:
            return prefetched(source)

        def complete(rows: PreparedRows) -> None:
            cache.put(key, rows, nbytes)
            if name is not None:
                files.save_later(name, rows, nbytes, then=lambda: map_written(rows))

        def map_written(rows: PreparedRows) -> None:
            mapped = files.load(name, check)  # the same searches, as fast, in pages the system can drop and reread
            if mapped is not None:
                cache.replace(key, rows, mapped)

        return kernel.prepare_blocks(prefetched(source), on_complete=complete)

    def _row_file_name(self, dataset: Any, kernel: ExactIndex) -> str | None:
        """The name of the row file of this index's rows as ``dataset`` (the run's Lance dataset at one version)
        holds them: what the rows are (store, table, selection, kernel) and exactly what they are read from (the
        version and its fragments' immutable data and deletion files). ``None`` where rows get no file: methods
        that transform them, or rows prepared on a GPU."""
        if not self.method.query_only or kernel.device.type != "cpu":
            return None
        uri = self.store.uri if "://" in self.store.uri else str(Path(self.store.uri).resolve())
        identity = {
            "store": uri,
            "table": self.store.gradient_table_name(self.selection.run),
            "selection": astuple(self.selection),
            "kernel": kernel.kernel,
            "max_norm": kernel.max_norm,
            "block_rows": READ_BLOCK_ROWS,
        }
        return cache_file_name(identity, dataset_content(dataset))

    def warm(self) -> Path | None:
        """Prepare this exact index's rows now, as its first search would (into the store's row cache), and wait
        for their row file, so that the first search of a later process maps it. Returns the row file, or
        ``None`` (a FAISS index, rows beyond the cache's budget, no row files for these rows or this store)."""
        if self.faiss_index is not None:
            return None
        rows = self._rows()
        if not isinstance(rows, PreparedRows):
            return None
        for _ in rows:  # prepares every block; the last one files the rows
            pass
        self.store.row_files.wait()
        name = self._row_file_name(self.store.gradient_dataset(self.selection.run), self._exact())
        path = None if name is None else self.store.row_files.path(name)
        return path if path is not None and path.is_file() else None

    def _exact(self) -> ExactIndex:
        """The exact kernel for this index's rows: rows searched as stored in the bfloat16 encoding are unit rows
        rounded to bf16, so their norms are known without measuring them."""
        bf16_units = self.method.query_only and self.store.storage_dtype == "bfloat16"
        return ExactIndex(
            device=self.device, block_rows=READ_BLOCK_ROWS, max_norm=UNIT_BF16_NORM if bf16_units else None
        )

    def cached_rows(self) -> PreparedRows | None:
        """The rows an exact search of this index finds in the store's row cache now (``None``: the next search
        reads them)."""
        return self.store.row_cache.get(self._cache_key())

    def _cache_key(self) -> tuple:
        """``(gradients version, selection, what the rows are, device)``: the stored rows themselves for methods that
        search them as stored (shared by every such index), else this index's method, fit and damping; rows
        prepared on one torch device are kept apart from those of another."""
        what = (
            ("stored",)
            if self.method.query_only
            else (self.method.name, self.manifest.get("fit"), self.manifest.get("damping"))
        )
        device = str(resolve_device(self.device))  # rows prepared on one device are searched there
        return (self.store.gradient_dataset(self.selection.run).version, astuple(self.selection), what, device)

    def example_ids(self, grad_ids: np.ndarray) -> pa.Array:
        """The ``example_id`` of each of ``grad_ids`` (rows of this index's selection, any shape), looked up in
        the selection's ``(grad_id, example_id)`` table (a :meth:`~gradstore.core.StoreCore.scan`, sorted once per
        table version in the store's row cache); ids outside it are looked up in the store (``KeyError`` for unknown
        ones). Entries a search did not fill (``-1``, :data:`~indexers.faiss_index.MISSING_ID`) get a null."""
        flat = np.asarray(grad_ids, np.int64).reshape(-1)
        missing = flat == MISSING_ID
        if missing.any():
            names = np.full(len(flat), None, dtype=object)
            names[~missing] = self.example_ids(flat[~missing]).to_numpy(zero_copy_only=False)
            return pa.array(names, pa.string())
        key = self.selection.cache_key(self.store, "example_ids")
        table = self.store.row_cache.get(key)
        if table is None:
            table = self._example_table()
            self.store.row_cache.put(key, table, table.nbytes)
        known = table.column("grad_id").to_numpy()
        positions = np.minimum(np.searchsorted(known, flat), max(len(known) - 1, 0))
        if len(known) and (known[positions] == flat).all():
            return table.column("example_id").take(pa.array(positions))
        example_of = self.store.example_ids_for(flat, self.selection.run)
        return pa.array([example_of[g] for g in flat.tolist()], pa.string())

    def _example_table(self) -> pa.Table:
        """The selection's ``(grad_id, example_id)`` table in ``grad_id`` order."""
        name = self.store.gradient_table_name(self.selection.run)
        table = self.store.scan(name, ["grad_id", "example_id"], self.selection.filter).combine_chunks()
        ids = table.column("grad_id").to_numpy()
        return table if bool(np.all(ids[1:] >= ids[:-1])) else table.sort_by("grad_id").combine_chunks()

    def _searchable(self) -> FaissIndex:
        """The FAISS index to search: a copy on all GPUs when :meth:`_faiss_on_gpu`, else the index itself."""
        if self._gpu_copy is None:
            self._gpu_copy = self.faiss_index.to_gpu() if self._faiss_on_gpu() else self.faiss_index
        return self._gpu_copy

    def _faiss_on_gpu(self) -> bool:
        """Whether the FAISS index is to be searched on the GPUs: ``device="cuda"``, or no device and faiss can use
        a GPU here and has a GPU version of the kind (not of HNSW graphs)."""
        if self.device is not None:
            return self.device.type == "cuda"
        return not self.faiss_index.graph and gpu_available()

    def save(self) -> None:
        """Write the FAISS index (if any) to a new directory, then the manifest that names it, then delete
        the FAISS files of earlier saves: a save killed part-way leaves the previous index whole and in use. On a
        store this process may not write (or where the storage refuses the files) the index stays in memory only."""
        files = self.store.files
        if not self.store.writable:
            log.debug("store %s is read-only for this process: index %s kept in memory", self.store.uri, self.name)
            return
        try:
            with files.writing(INDEXES, self.name):  # processes saving the same index at once take turns
                self._save_files(files)
        except StorePermissionError as error:
            log.debug("index %s kept in memory: %s", self.name, error)

    def _save_files(self, files: Any) -> None:
        if self.faiss_index is not None:
            self.manifest[FAISS_FILES] = f"{FAISS_PREFIX}{uuid.uuid4().hex[:16]}"
            with tempfile.TemporaryDirectory(prefix="gradstore-index-") as scratch:
                self.faiss_index.save(Path(scratch), self.manifest)
                np.save(Path(scratch) / IDS_FILE, self.indexed_ids)
                if self.manifest.get(FIRST_STAGE) == BALANCED:  # beside the FAISS files: the space of their rows
                    self.first_space.preconditioner.save(Path(scratch))
                files.put_directory(Path(scratch), INDEXES, self.name, self.manifest[FAISS_FILES])
        manifest_bytes = json.dumps(self.manifest, indent=2, sort_keys=True, default=str).encode()
        files.write_bytes(manifest_bytes, INDEXES, self.name, MANIFEST_FILE)
        for child in files.children(INDEXES, self.name):
            if child.startswith(FAISS_PREFIX) and child != self.manifest.get(FAISS_FILES):
                files.remove(INDEXES, self.name, child)
        identity = files_identity(self.store, self.name, manifest_bytes) if self.faiss_index is not None else None
        if identity is not None:  # the next load of these files in this process uses them as they are here
            self.store.index_cache.put(self.name, loaded_entry(self, identity))


def device_admits(nbytes: int, device: torch.device) -> bool:
    """Whether ``nbytes`` of prepared rows may be kept on ``device``: on the CPU the row cache's budget alone
    decides; on a CUDA device they must also fit in :data:`DEVICE_CACHE_SHARE` of its free memory (the row
    cache's budget is a share of the host's memory, which may be far larger than the GPU's), else the rows are
    streamed to it block by block."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= DEVICE_CACHE_SHARE * free


def prepared_bytes(stored: str, kernel: ExactIndex) -> int:
    """Bytes a value of rows stored as ``stored`` takes once ``kernel`` prepared them: the float32 kernel keeps the
    rows as stored on the CPU and float32 rows on a GPU; the bfloat16 kernel keeps the rows plus their bf16 copy,
    or the rows alone when they are bf16."""
    width = getattr(torch, stored).itemsize
    if kernel.kernel == "float32":
        return width if kernel.device.type == "cpu" else 4
    return width if stored == "bfloat16" else width + 2


def prepared_source(space: ScoringSpace, source: VectorBlocks) -> VectorBlocks:
    """``source`` with its rows in the searched space (float32 tensors)."""

    def prepared() -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        for ids, vectors in source():
            yield ids, space.rows(torch.from_numpy(vectors))

    return prepared


def valid_entries(scores: np.ndarray, grad_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The found entries of one side of a search, ``scores`` and ``grad_ids [q, w]`` (see
    :meth:`AttributionIndex.search_sides`), as flat arrays in row order, best first per query: ``(query positions
    int64, ranks int32 (1-based), scores, grad_ids)``. Entries a FAISS search did not fill (``grad_id`` ``-1``, at
    the end of their rows) are left out, so a query may have fewer than ``w`` entries, ranked ``1..found``."""
    scores, grad_ids = np.asarray(scores), np.asarray(grad_ids)
    found = grad_ids != MISSING_ID
    queries, columns = np.nonzero(found)
    return queries.astype(np.int64), (columns + 1).astype(np.int32), scores[found], grad_ids[found]


def check_device(kind: str, dim: int, device: str | torch.device | None) -> torch.device | None:
    """The device a search of an index of ``kind`` (``"exact"`` or a FAISS factory string) over rows of ``dim``
    is asked to run on, checked; ``None`` stays ``None``: the default, exact search on CUDA when torch sees a GPU
    (else the CPU) and FAISS on every GPU when faiss can use them and has a GPU version of the kind (else the
    CPU). ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (exact search only) or a :class:`torch.device`. A device
    this machine lacks, or that the kind cannot run on (HNSW graphs: CPU only), is an
    :class:`~gradstore.errors.InvalidArgumentError`."""
    if device is None:
        return None
    try:
        asked = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(
            f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}"
        ) from None
    if asked.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    if kind == "exact":
        try:
            return resolve_device(asked)
        except ValueError as error:
            raise InvalidArgumentError(str(error)) from None
    if asked.type == "cpu":
        return asked
    if asked.index is not None:
        raise InvalidArgumentError(
            f"device={str(device)!r}: a FAISS index is searched on every GPU faiss sees; pass device='cuda' "
            "(CUDA_VISIBLE_DEVICES chooses the GPUs) or search exactly (kind='exact') on that GPU"
        )
    try:
        graph = FaissIndex(kind, dim).graph
    except ValueError as error:  # says which kind
        raise InvalidArgumentError(str(error)) from error
    if graph:
        raise InvalidArgumentError(
            f"device='cuda': FAISS has no GPU version of {kind!r} (an HNSW graph); search it with device='cpu' "
            "(or leave device unset), or use an exact or IVF kind on the GPU"
        )
    if not gpu_available():
        raise InvalidArgumentError(
            "device='cuda': FAISS cannot use a GPU here (faiss without GPU support, no CUDA driver or no GPU); "
            "pass device='cpu' (or leave device unset), or install 'gradstore[gpu]' on a machine with a GPU"
        )
    return asked


def index_summary(index: AttributionIndex) -> dict[str, Any]:
    """The manifest fields people look at."""
    keys = ("name", "run_id", "checkpoint", "split", "method", "damping", "kind", "rows", FIT_STATE, "recall_at_10")
    return {**{k: index.manifest.get(k) for k in keys}, "search": index.search_path}


def expected_manifest(store: StoreCore, run: str) -> dict[str, Any]:
    """What an index of run ``run`` must match: its projection and dimension."""
    row = store.run(run)
    return {"projection_fingerprint": row["projection_fingerprint"], "dim": row["dim"]}


def files_identity(store: StoreCore, name: str, manifest_bytes: bytes) -> tuple | None:
    """What identifies index ``name``'s files on disk, read cheaply (the small files only): the bytes of its
    manifest and the checksums kept beside its FAISS files (:mod:`gradstore.core.index_cache`); ``None`` when they
    cannot be read (the index is then neither cached nor taken from the cache)."""
    try:
        manifest = json.loads(manifest_bytes)
        directory = store.files.path(INDEXES, name, manifest.get(FAISS_FILES, FAISS_PREFIX))
        selector = pafs.FileSelector(directory, recursive=True, allow_not_found=True)
        checksums = []
        for info in store.files.filesystem.get_file_info(selector):
            if info.type == pafs.FileType.File and info.path.endswith(CHECKSUM_SUFFIX):
                with store.files.filesystem.open_input_stream(info.path) as stream:
                    checksums.append((info.path[len(directory) :], stream.read().decode(errors="replace")))
    except (OSError, ValueError, UnicodeDecodeError, AttributeError, TypeError):
        return None
    return manifest_bytes, tuple(sorted(checksums))


def loaded_entry(index: AttributionIndex, identity: tuple) -> LoadedIndex:
    first = index.first_space.preconditioner if index.manifest.get(FIRST_STAGE) == BALANCED else None
    faiss_index = index.faiss_index
    return LoadedIndex(identity, faiss_index, index.indexed_ids, first, faiss_index.nprobe, faiss_index.ef_search)
