"""Attribution indexes: a fitted preconditioner plus a top-k structure over one selection of training rows.

An index is built from the rows of one run/checkpoint/split (optionally a SQL ``where``), persisted in the
store's side directory ``_gradstore/indexes/<name>/`` with a manifest naming exactly what it was built from
(run, checkpoint, split, filter, projection fingerprint, method, damping, kind, rows). Loading an index whose
manifest does not match the store (another projection, another dimension) raises ``IndexMismatchError``.

Kinds: ``"exact"`` (blocked matmul + running top-k over the stored rows, which are cached in memory when
they fit ``cache_bytes``), or any FAISS factory string (``"Flat"``, ``"IVF1024,Flat"``, ...); ``"auto"``
picks by :func:`indexers.choose_index_kind` and reports the recall of an ANN index against exact search.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import asdict, astuple, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradstore.methods import DEFAULT_DAMPING, FULL_FISHER_MAX_DIM, Method, resolve_method
from gradstore.stored_rows import in_memory, stored_blocks
from indexers import (
    ExactIndex,
    FaissIndex,
    IndexMismatchError,
    PreparedRows,
    VectorBlocks,
    choose_index_kind,
    gpu_available,
    load_preconditioner,
    make_preconditioner,
    manifest_diff,
    prefetched,
)
from indexers.preconditioners import Preconditioner

if TYPE_CHECKING:
    from gradstore.store import GradStore

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
IDS_FILE = "ids.npy"
DEFAULT_CACHE_BYTES = 2 << 30


@dataclass(frozen=True)
class Selection:
    """Which training rows an index covers."""

    run: str
    checkpoint: str
    split: str = "train"
    where: str | None = None

    def blocks(self, store: GradStore, block_rows: int = 65536) -> VectorBlocks:
        """A re-iterable source of ``(grad_ids, float32 vectors)`` blocks of the selected rows."""

        def source() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for block in store.iter_gradients(self.run, checkpoint=self.checkpoint, split=self.split,
                                              where=self.where, columns=(), block_rows=block_rows):
                yield block.grad_ids, block.vectors

        return source

    def count(self, store: GradStore) -> int:
        """Rows currently selected."""
        from gradstore.store import gradient_filter

        return store.count("gradients", gradient_filter(self.run, self.checkpoint, self.split, None, self.where))


def default_index_name(selection: Selection, method: Method, damping: float | None, kind: str) -> str:
    """A readable, file-system safe name for an index."""
    parts = [selection.run, selection.checkpoint, selection.split, method.name]
    if method.damped:
        parts.append(f"d{damping:g}")
    parts.append(kind.replace(",", "_"))
    if selection.where:
        import hashlib

        parts.append(hashlib.sha256(selection.where.encode()).hexdigest()[:8])
    return "-".join(p.replace("/", "_") for p in parts)


def make_method_preconditioner(store: GradStore, selection: Selection, method: Method, damping: float,
                               eigen_correction: bool = False) -> Preconditioner:
    """An unfitted preconditioner for ``method`` laid out by the run's projection spec."""
    if method.preconditioner == "fisher":
        spec = store.run_spec(selection.run)
        blocks = None if spec.dim <= FULL_FISHER_MAX_DIM else [(s.offset, s.size) for s in spec.layers]
        return make_preconditioner("fisher", damping=damping, blocks=blocks)
    if method.preconditioner == "kfac":
        spec = store.run_spec(selection.run)
        dense = [s.name for s in spec.layers if s.mode == "dense"]
        if dense:
            raise ValueError(f"kfac needs Kronecker-structured rows; layers {dense} use a dense projection")
        layout = [(s.name, s.offset, s.k_in, s.k_out) for s in spec.layers]
        try:
            factors = {name: (a, s) for name, (a, s, _) in
                       store.load_curvature(selection.run, selection.checkpoint).items()}
        except FileNotFoundError:
            factors = None  # estimated from the gradients themselves
        return make_preconditioner("kfac", damping=damping, kronecker_layout=layout, kronecker_factors=factors,
                                   eigen_correction=eigen_correction)
    if method.damped:
        return make_preconditioner(method.preconditioner, damping=damping)
    return make_preconditioner(method.preconditioner)


class _Passes:
    """Blocks of a source as a re-iterable collection (each ``iter`` starts a new pass)."""

    def __init__(self, source: VectorBlocks) -> None:
        self._source = source

    def __iter__(self):
        return (vectors for _, vectors in self._source())


class AttributionIndex:
    """A fitted preconditioner and a search structure over a :class:`Selection` of a store."""

    def __init__(self, store: GradStore, manifest: dict[str, Any], preconditioner: Preconditioner,
                 faiss_index: FaissIndex | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.store = store
        self.manifest = manifest
        self.preconditioner = preconditioner
        self.faiss_index = faiss_index
        self.indexed_ids = np.empty(0, np.int64)  # grad_ids in the FAISS index (for incremental adds)
        self._gpu_copy: FaissIndex | None = None
        self.cache_bytes = cache_bytes
        self._cache: tuple[int, PreparedRows] | None = None  # (version, rows ready for the exact kernel)
        self._passes = 0

    # ------------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        """The index's name (its directory under ``_gradstore/indexes``)."""
        return self.manifest["name"]

    @property
    def method(self) -> Method:
        """The attribution method the index scores with."""
        return resolve_method(self.manifest["method"])

    @property
    def selection(self) -> Selection:
        """The rows the index covers."""
        m = self.manifest
        return Selection(m["run_id"], m["checkpoint"], m["split"], m["where"])

    @property
    def directory(self) -> Path:
        """Where the index lives."""
        return index_directory(self.store, self.name)

    # ------------------------------------------------------------------ scoring
    def prepare_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """Queries in the space the stored rows are searched in."""
        queries = queries.to(torch.float32)
        if self.method.query_only:
            return self.preconditioner.apply_query(queries).to(torch.float32)
        return self.preconditioner.apply_both(queries).to(torch.float32)

    def prepare_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows in the searched space (identity for query-side preconditioning)."""
        return rows if self.method.query_only else self.preconditioner.apply_both(rows).to(torch.float32)

    def search(self, queries: np.ndarray | torch.Tensor, k: int, largest: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (``largest``) or bottom-k scores and ``grad_id``s for raw query vectors ``[q, dim]``."""
        prepared = self.prepare_queries(torch.as_tensor(np.asarray(queries, dtype=np.float32)))
        if self.faiss_index is not None:
            if not largest:
                raise ValueError("opponents (bottom-k) need an exact index: FAISS returns the largest scores only")
            return self._searchable().search(prepared.numpy(), k)
        return ExactIndex().search(prepared, self._rows(), k, largest=largest)

    def _rows(self) -> VectorBlocks | PreparedRows:
        version = self.store.table("gradients").version
        if self._cache is not None and self._cache[0] == version:
            return self._cache[1]
        source, stored = self.selection.blocks(self.store), stored_blocks(self.store, *astuple(self.selection))
        rows = self.manifest["rows_now"] = self.selection.count(self.store)
        self._passes += 1  # the first search streams (one-shot attribute calls); later ones fill the cache
        if rows * self.manifest["dim"] * 4 > self.cache_bytes or self._passes == 1:
            if self.method.query_only:  # rows searched as stored: the kernel reads float16 tiles itself
                return prefetched(stored)

            def prepared() -> Iterator[tuple[np.ndarray, torch.Tensor]]:
                for ids, vectors in source():
                    yield ids, self.prepare_rows(torch.from_numpy(vectors))

            return prefetched(prepared)
        if self.method.query_only:  # cached as stored (float16 unit rows + norms) next to their bf16 copy
            self._cache = (version, ExactIndex().prepare(*in_memory(stored)))
            return self._cache[1]
        blocks = list(source())
        ids = np.concatenate([b[0] for b in blocks]) if blocks else np.empty(0, np.int64)
        vectors = (torch.from_numpy(np.concatenate([b[1] for b in blocks])) if blocks
                   else torch.empty(0, self.manifest["dim"]))
        self._cache = (version, ExactIndex().prepare(ids, self.prepare_rows(vectors)))
        return self._cache[1]

    def _searchable(self) -> FaissIndex:
        """The FAISS index to search: a copy on all GPUs when faiss-gpu and a CUDA driver are present."""
        if self._gpu_copy is None:
            self._gpu_copy = self.faiss_index.to_gpu() if gpu_available() else self.faiss_index
        return self._gpu_copy

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        """Write manifest, preconditioner state and FAISS index to the index directory."""
        directory = self.directory
        self.preconditioner.save(directory / "preconditioner")
        if self.faiss_index is not None:
            self.faiss_index.save(directory / "faiss", self.manifest)
            np.save(directory / "faiss" / IDS_FILE, self.indexed_ids)
        (directory / MANIFEST_FILE).write_text(json.dumps(self.manifest, indent=2, sort_keys=True, default=str))


def index_directory(store: GradStore, name: str) -> Path:
    """The directory of index ``name`` (created on demand)."""
    return store.sidecar("indexes", name)


def _expected_manifest(store: GradStore, selection: Selection) -> dict[str, Any]:
    spec = store.run_spec(selection.run)
    return {"projection_fingerprint": spec.fingerprint(), "dim": spec.dim}


def build_index(store: GradStore, selection: Selection, method: str = "grad-dot", *,
                damping: float | None = None, kind: str = "exact", name: str | None = None,
                eigen_correction: bool = False, refit: bool = False, recall_queries: int = 64) -> AttributionIndex:
    """Fit the method's preconditioner over the selected rows and build the search structure.

    If an index of the same name exists and matches, rows appended since are added to it (the
    preconditioner keeps its fit unless ``refit``); otherwise it is built from scratch.
    """
    resolved = resolve_method(method)
    damping = DEFAULT_DAMPING if damping is None else float(damping)
    rows = selection.count(store)
    if rows == 0:
        raise ValueError(f"no training rows match {selection}: capture the run first")
    if kind == "auto":
        kind = choose_index_kind(rows, store.dim)
    name = name or default_index_name(selection, resolved, damping, kind)
    if not refit:
        existing = load_index(store, name, missing_ok=True)
        if existing is not None and _same_build(existing.manifest, selection, resolved, damping, kind):
            _add_new_rows(existing)
            return existing
    shutil.rmtree(index_directory(store, name), ignore_errors=True)
    source = selection.blocks(store)
    preconditioner = None if refit else _redamped_sibling(store, selection, resolved, damping, rows, eigen_correction)
    if preconditioner is None:
        preconditioner = make_method_preconditioner(store, selection, resolved, damping, eigen_correction)
        preconditioner.fit(_Passes(source))
    manifest = {"name": name, "run_id": selection.run, "checkpoint": selection.checkpoint, "split": selection.split,
                "where": selection.where, "method": resolved.name, "damping": damping if resolved.damped else None,
                "kind": kind, "metric": "ip", "rows": rows, "eigen_correction": eigen_correction,
                "gradients_version": store.table("gradients").version,
                "built_at": datetime.now(timezone.utc).isoformat(), **_expected_manifest(store, selection)}
    index = AttributionIndex(store, manifest, preconditioner)
    if kind != "exact":
        index.faiss_index = _build_faiss(index, kind, source)
        index.manifest["recall_at_10"] = _measure_recall(index, source, recall_queries)
        log.info("index %s: FAISS %s recall@10 vs exact = %.3f", name, kind, index.manifest["recall_at_10"])
    index.save()
    return index


def _redamped_sibling(store: GradStore, selection: Selection, method: Method, damping: float, rows: int,
                      eigen_correction: bool) -> Preconditioner | None:
    """The preconditioner of an up-to-date index of the same rows and method, re-damped without a data pass
    (its eigendecomposition is kept), or ``None`` if there is none."""
    if not method.damped:
        return None
    root = Path(store.uri, "_gradstore", "indexes")
    for manifest_path in sorted(root.glob(f"*/{MANIFEST_FILE}")) if root.exists() else []:
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError:
            continue
        same_rows = Selection(manifest["run_id"], manifest["checkpoint"], manifest["split"], manifest["where"])
        if (same_rows == selection and manifest["method"] == method.name and manifest["rows"] == rows
                and manifest.get("eigen_correction") == eigen_correction
                and manifest.get("gradients_version") == store.table("gradients").version):
            fitted = load_preconditioner(manifest_path.parent / "preconditioner")
            if hasattr(fitted, "with_damping"):
                return fitted.with_damping(damping)
    return None


def _same_build(manifest: dict[str, Any], selection: Selection, method: Method, damping: float, kind: str) -> bool:
    return (Selection(manifest["run_id"], manifest["checkpoint"], manifest["split"], manifest["where"]) == selection
            and manifest["method"] == method.name and manifest["kind"] == kind
            and (not method.damped or manifest["damping"] == damping))


def _build_faiss(index: AttributionIndex, kind: str, source: VectorBlocks) -> FaissIndex:
    faiss_index = FaissIndex(kind, index.manifest["dim"], metric="ip")
    prepared = _prepared_source(index, source)
    faiss_index.train(prepared)
    added = []
    for ids, vectors in prepared():
        faiss_index.add(ids, vectors)
        added.append(ids)
    index.indexed_ids = np.concatenate(added)
    return faiss_index


def _prepared_source(index: AttributionIndex, source: VectorBlocks) -> VectorBlocks:
    def prepared() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for ids, vectors in source():
            yield ids, index.prepare_rows(torch.from_numpy(vectors)).numpy()

    return prepared


def _measure_recall(index: AttributionIndex, source: VectorBlocks, n_queries: int) -> float:
    """Recall@10 of the FAISS index against exact search, with stored rows as queries."""
    from indexers import recall_at_k
    from indexers.faiss_index import sample_rows

    queries = torch.from_numpy(sample_rows(source, n_queries, seed=1))
    prepared = index.prepare_queries(queries)
    _, approx = index.faiss_index.search(prepared.numpy(), 10)
    _, exact = ExactIndex().search(prepared, _prepared_source(index, source), 10)
    return recall_at_k(approx, exact)


def _add_new_rows(index: AttributionIndex) -> None:
    """Incremental update: add rows appended to the selection since the index was built."""
    rows = index.selection.count(index.store)
    if rows == index.manifest["rows"]:
        return
    if index.faiss_index is not None:
        for ids, vectors in index.selection.blocks(index.store)():
            fresh = ~np.isin(ids, index.indexed_ids)
            if fresh.any():
                index.faiss_index.add(ids[fresh], index.prepare_rows(torch.from_numpy(vectors[fresh])).numpy())
                index._gpu_copy = None
                index.indexed_ids = np.concatenate([index.indexed_ids, ids[fresh]])
    index.manifest.update(rows=rows, gradients_version=index.store.table("gradients").version)
    index.save()


def load_index(store: GradStore, name: str, *, missing_ok: bool = False) -> AttributionIndex | None:
    """Load index ``name``; raises ``IndexMismatchError`` if it does not match the store's run."""
    directory = Path(store.uri, "_gradstore", "indexes", name)
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.exists():
        if missing_ok:
            return None
        raise FileNotFoundError(f"no index {name!r} in store {store.uri}: build it with build_index")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise IndexMismatchError({"manifest": ("valid JSON", f"corrupt ({error})")}) from None
    expected = _expected_manifest(store, Selection(manifest["run_id"], manifest["checkpoint"]))
    differences = manifest_diff(expected, {k: manifest.get(k) for k in expected})
    if differences:
        raise IndexMismatchError(differences)
    preconditioner = load_preconditioner(directory / "preconditioner")
    index = AttributionIndex(store, manifest, preconditioner)
    if manifest["kind"] != "exact":
        index.faiss_index = FaissIndex.load(directory / "faiss", expected_manifest=manifest)
        index.indexed_ids = np.load(directory / "faiss" / IDS_FILE)
    return index


def index_summary(index: AttributionIndex) -> dict[str, Any]:
    """The manifest fields people look at."""
    keys = ("name", "run_id", "checkpoint", "split", "method", "damping", "kind", "rows", "recall_at_10")
    return {k: index.manifest.get(k) for k in keys}


__all__ = ["AttributionIndex", "Selection", "asdict", "build_index", "index_summary", "load_index"]
