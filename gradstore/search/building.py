"""Building an attribution index: fit (or reuse the fit of) the method's preconditioner over a selection of training
rows, then the exact index's manifest or a FAISS structure over the balanced rows; an index built the same way before
gets the rows appended since (:mod:`gradstore.search.index`)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from gradstore.core import StoreCore
from gradstore.core.engine import Engine, LocalEngine
from gradstore.core.sidefiles import check_component
from gradstore.errors import (
    InvalidArgumentError,
)
from gradstore.preconditioning import DEFAULT_DAMPING, GRAD_DOT, BlockStructure, Preconditioning
from gradstore.preconditioning.fitting import FitCache, FitSpec, Selection, fit_spec
from gradstore.preconditioning.scoring import ScoringSpace
from gradstore.search.index import (
    BALANCED,
    FIRST_STAGE,
    FIT_STATE,
    ROWS_STATE,
    AttributionIndex,
    check_device,
    expected_manifest,
)
from gradstore.search.loading import load_index
from gradstore.search.scan_tasks import faiss_parts, top_k
from indexers import (
    FaissIndex,
    VectorBlocks,
    choose_index_kind,
)

log = logging.getLogger(__name__)


def default_index_name(
    selection: Selection, method: Preconditioning, damping: float | None, kind: str, blocks: str | None = None
) -> str:
    """A readable, file-system safe name: the selection, method, Fisher block structure (``blocks``, when the
    method has one) and damping in words plus a hash of the exact values."""
    parts = [selection.run, selection.checkpoint or "", selection.split, method.name]  # None: unlabelled rows
    if blocks is not None:
        parts.append(blocks)
    if method.damped:
        parts.append(f"d{damping:g}")
    parts.append(kind)
    readable = re.sub(r"[^A-Za-z0-9._=+-]+", "_", "-".join(parts)).strip("._-")[:120] or "index"
    digest = hashlib.sha256(json.dumps([*parts, selection.where]).encode()).hexdigest()[:8]
    return f"{readable}-{digest}"


def build_index(
    store: StoreCore,
    fits: FitCache,
    selection: Selection,
    method: Preconditioning = GRAD_DOT,
    *,
    damping: float | None = None,
    kind: str = "exact",
    name: str | None = None,
    blocks: BlockStructure = "auto",
    refit: bool = False,
    recall_queries: int = 64,
    engine: Engine | None = None,
    device: str | torch.device | None = None,
) -> AttributionIndex:
    """Fit (or reuse the fit of) the method's preconditioner over the selected rows (on ``engine``) and build
    the search structure. An index of the same name built the same way gets the rows appended since added.
    ``device``: where its searches run (:func:`check_device`; checked before anything is fitted or built)."""
    resolved = method
    spec = fit_spec(store, selection, resolved, blocks)
    damping = DEFAULT_DAMPING if damping is None else float(damping)
    rows = selection.count(store)
    if rows == 0:
        raise InvalidArgumentError(f"no training rows match {selection}: capture the run first")
    if kind == "auto":
        kind = choose_index_kind(rows, store.run_dim(selection.run))
    faiss_index = None if kind == "exact" else _faiss_index(kind, store.run_dim(selection.run), rows)
    device = check_device(kind, store.run_dim(selection.run), device)
    name = (
        check_component(name, "index name")
        if name is not None
        else default_index_name(selection, resolved, damping, kind, spec.blocks)
    )
    preconditioner = fits.get(spec, damping, refit=refit, engine=engine)
    if not refit:
        same = {resolved.name: resolved}.get  # another method's index of this name is rebuilt, not loaded
        existing = load_index(store, fits, name, same, missing_ok=True, device=device)
        if existing is not None and _same_build(existing.manifest, spec, resolved, damping, kind):
            existing.use_fit(preconditioner)
            if _add_new_rows(existing):
                return existing  # else rows were deleted since: a FAISS index is built again without them
    manifest = {
        "name": name,
        "run_id": selection.run,
        "checkpoint": selection.checkpoint,
        "split": selection.split,
        "where": selection.where,
        "method": resolved.name,
        "damping": damping if resolved.damped else None,
        "kind": kind,
        "metric": "ip",
        "rows": rows,
        ROWS_STATE: list(selection.state(store)),
        "blocks": spec.blocks,
        "eigen_correction": spec.eigen_correction,
        "fit": spec.key(),
        **({FIRST_STAGE: BALANCED, FIT_STATE: list(spec.selection.state(store))} if kind != "exact" else {}),
        "gradients_version": store.gradient_dataset(selection.run).version,
        "built_at": datetime.now(timezone.utc).isoformat(),
        **expected_manifest(store, selection.run),
    }
    index = AttributionIndex(
        store, manifest, ScoringSpace(resolved, preconditioner), device=device, fits=fits, spec=spec
    )
    if faiss_index is not None:
        engine = engine or LocalEngine()
        _build_faiss(index, faiss_index, selection.blocks(store), engine)
        index.manifest["recall_at_10"] = _measure_recall(index, engine, recall_queries)
        log.info("index %s: FAISS %s recall@10 vs exact = %.3f", name, kind, index.manifest["recall_at_10"])
    index.save()
    return index


def _same_build(
    manifest: dict[str, Any], spec: FitSpec, method: Preconditioning, damping: float | None, kind: str
) -> bool:
    return (
        Selection(manifest["run_id"], manifest["checkpoint"], manifest["split"], manifest["where"]) == spec.selection
        and manifest["method"] == method.name
        and manifest["kind"] == kind
        and manifest.get("fit") == spec.key()
        and (not method.damped or manifest["damping"] == damping)
        and (kind == "exact" or FIT_STATE in manifest)  # FAISS indexes of before: rebuilt, their fit is unknown
    )


def _faiss_index(kind: str, dim: int, rows: int) -> FaissIndex:
    """A new, empty FAISS index of ``kind`` over ``dim`` dims, checked before anything is fitted: a kind FAISS
    cannot build (:data:`indexers.faiss_index.FACTORY_FORMS`), or cannot train on the selection's ``rows``, is an
    :class:`~gradstore.errors.InvalidArgumentError` saying what to pass."""
    try:
        faiss_index = FaissIndex(kind, dim, metric="ip")
        faiss_index.check_training_rows(rows)
    except ValueError as error:
        raise InvalidArgumentError(str(error)) from error
    return faiss_index


def _build_faiss(index: AttributionIndex, faiss_index: FaissIndex, source: VectorBlocks, engine: Engine) -> None:
    """Train the empty ``faiss_index`` on a sample of the balanced rows here (only the sampled rows are read), then
    add the rows: here, or per shard on ``engine`` (each task fills a copy of the trained index; the copies are
    merged in shard order). HNSW graphs cannot be merged: their rows are added here whatever the engine."""
    ids, stored = _sample(index, faiss_index.training_rows, seed=0)
    sample = (ids, index.first_stage(stored, rows=True))
    faiss_index.train(lambda: iter([sample]), sample_size=len(ids))
    added = [np.empty(0, np.int64)]
    if isinstance(engine, LocalEngine) or not faiss_index.mergeable:
        for ids, vectors in source():
            faiss_index.add(ids, index.first_stage(vectors, rows=True))
            added.append(ids)
    else:
        parts = faiss_parts(
            engine, index.selection.shards(index.store, engine.parallelism, ()), index.space, faiss_index
        )
        if parts:  # merged into the first part: FAISS merges only indexes of one type (as deserialized)
            faiss_index = parts[0][0]
        for position, (part, ids) in enumerate(parts):
            if position:
                faiss_index.merge_from(part)
            added.append(ids)
    index.faiss_index, index.indexed_ids = faiss_index, np.concatenate(added)


def _sample(index: AttributionIndex, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A uniform random sample of the selected rows as stored: ``(grad_ids, float32 rows)``.

    One pass over the ``grad_id`` column, then only the sampled rows are read (Lance ``take``)."""
    ids = index.selection.grad_ids(index.store)
    chosen = np.sort(np.random.default_rng(seed).choice(ids, size=min(size, len(ids)), replace=False))
    found, stored = index._locator.read(index.store, index.selection.run, chosen)
    return chosen[found], stored


def _measure_recall(index: AttributionIndex, engine: Engine, n_queries: int) -> float:
    """Recall@10 of the FAISS index against exact search (on ``engine``), with stored rows as queries."""
    from indexers import recall_at_k

    _, rows = _sample(index, n_queries, seed=1)
    prepared = index.space.queries(torch.from_numpy(rows))
    _, approx = index.faiss_index.search(index.first_stage(rows, rows=False), 10, warn=False)  # misses: recall
    shards = index.selection.shards(index.store, engine.parallelism)
    _, exact = top_k(engine, shards, index.space, prepared, 10)[True]
    return recall_at_k(approx, exact)


def _add_new_rows(index: AttributionIndex) -> bool:
    """Incremental update: add the rows appended to the selection since the index was built. ``False`` (nothing
    changed) where a FAISS index holds rows deleted since: it must be built again."""
    state = list(index.selection.state(index.store))
    if state == index.manifest.get(ROWS_STATE):
        return True
    if index.faiss_index is not None:
        current = index.selection.grad_ids(index.store)
        if not np.isin(index.indexed_ids, current).all():
            return False
        for ids, vectors in index.selection.blocks(index.store)():
            fresh = ~np.isin(ids, index.indexed_ids)
            if fresh.any():
                if index.store.index_cache.holds(index.faiss_index):  # shared with other loads: change a copy
                    index.faiss_index = _copied(index.faiss_index)
                index.faiss_index.add(ids[fresh], index.first_stage(vectors[fresh], rows=True))
                index._gpu_copy = None
                index.indexed_ids = np.concatenate([index.indexed_ids, ids[fresh]])
    index.manifest.update(rows=state[0], gradients_version=index.store.gradient_dataset(index.selection.run).version)
    index.manifest[ROWS_STATE] = state
    index.save()
    return True


def _copied(faiss_index: FaissIndex) -> FaissIndex:
    """A copy of ``faiss_index`` that can be changed without changing it."""
    copy = FaissIndex.__new__(FaissIndex)
    copy.__setstate__(faiss_index.__getstate__())
    return copy
