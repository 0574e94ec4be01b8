"""Loading a saved attribution index: its manifest checked against the store, its FAISS files read once per process
(:mod:`gradstore.core.index_cache`) (:mod:`gradstore.search.index`)."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import torch

from gradstore.core import StoreCore
from gradstore.core.sidefiles import check_component
from gradstore.errors import (
    IndexMismatchError,
    StoreCorruptError,
    UnknownIndexError,
)
from gradstore.preconditioning import Preconditioning
from gradstore.preconditioning.fitting import FitCache, Selection, fit_spec
from gradstore.preconditioning.scoring import ScoringSpace
from gradstore.search.index import (
    BALANCED,
    FAISS_FILES,
    FAISS_PREFIX,
    FIRST_STAGE,
    IDS_FILE,
    INDEXES,
    MANIFEST_FILE,
    AttributionIndex,
    check_device,
    expected_manifest,
    files_identity,
    loaded_entry,
)
from indexers import (
    FaissIndex,
    load_preconditioner,
    manifest_diff,
)
from indexers import IndexMismatchError as LowerIndexMismatchError


def load_index(
    store: StoreCore,
    fits: FitCache,
    name: str,
    methods: Callable[[str], Preconditioning | None],
    *,
    missing_ok: bool = False,
    device: str | torch.device | None = None,
) -> AttributionIndex | None:
    """Load index ``name``; raises ``IndexMismatchError`` if it does not match the store's run. Not while another
    process saves it (the manifest and the FAISS files it names are read as one). ``methods``: the
    :class:`Preconditioning` of the method a manifest names (the registry's, above search: an unknown name raises
    there; ``None``: not the one wanted, and nothing is loaded). ``device``: where its searches run
    (:func:`check_device`)."""
    check_component(name, "index name")
    with store.files.reading(INDEXES, name):
        return _load_index(store, fits, name, methods, missing_ok, device)


def _load_index(
    store: StoreCore,
    fits: FitCache,
    name: str,
    methods: Callable[[str], Preconditioning | None],
    missing_ok: bool,
    device: str | torch.device | None = None,
) -> AttributionIndex | None:
    try:
        manifest_bytes = store.files.read_bytes(INDEXES, name, MANIFEST_FILE)
        manifest = json.loads(manifest_bytes)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise UnknownIndexError(f"no index {name!r} in store {store.uri}: build it with build_index") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise IndexMismatchError({"manifest": ("valid JSON", f"corrupt ({error})")}) from None
    if not isinstance(manifest, dict) or manifest.get("name") != name:
        raise IndexMismatchError({"name": (name, manifest.get("name") if isinstance(manifest, dict) else None)})
    expected = expected_manifest(store, manifest["run_id"])
    differences = manifest_diff(expected, {k: manifest.get(k) for k in expected})
    if differences:
        raise IndexMismatchError(differences)
    device = check_device(manifest["kind"], manifest["dim"], device)  # before the fit is read
    method = methods(manifest["method"])
    if method is None:
        return None
    selection = Selection(manifest["run_id"], manifest["checkpoint"], manifest["split"], manifest["where"])
    spec = fit_spec(store, selection, method, manifest.get("blocks") or "auto")
    preconditioner = fits.get(spec, manifest.get("damping"))
    index = AttributionIndex(store, manifest, ScoringSpace(method, preconditioner), device=device, fits=fits, spec=spec)
    if manifest["kind"] != "exact":
        identity = files_identity(store, name, manifest_bytes)
        cached = None if identity is None else store.index_cache.get(name, identity)
        if cached is not None:  # the same files as loaded before: not read (nor hashed) again
            cached.faiss_index.nprobe, cached.faiss_index.ef_search = cached.nprobe, cached.ef_search
            index.faiss_index, index.indexed_ids = cached.faiss_index, cached.indexed_ids
            if cached.first_preconditioner is not None:
                index.first_space = ScoringSpace(method, cached.first_preconditioner)
            return index
        try:
            with store.files.local_directory(INDEXES, name, manifest.get(FAISS_FILES, FAISS_PREFIX)) as directory:
                index.faiss_index = FaissIndex.load(directory, expected_manifest=manifest, mmap=False)
                index.indexed_ids = np.load(directory / IDS_FILE, allow_pickle=False)
                if manifest.get(FIRST_STAGE) == BALANCED:
                    index.first_space = ScoringSpace(method, load_preconditioner(directory))
        except LowerIndexMismatchError as error:
            raise IndexMismatchError(error.differences) from error
        except (OSError, ValueError, RuntimeError) as error:
            raise StoreCorruptError(f"FAISS index {name!r} of store {store.uri} cannot be read: {error}") from error
        if identity is not None:
            store.index_cache.put(name, loaded_entry(index, identity))
    return index
