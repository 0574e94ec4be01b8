"""A read-only server writes nothing into the store (``gradstore serve`` without ``--allow-writes``).

The store is taken as one this process may not write (as for a store on a read-only mount): fits a request needs
(a ``fisher`` fit of a new ``where``) are made in memory and kept in a bounded LRU (:class:`BoundedFits`,
``Limits.fit_cache_bytes``), never saved under ``_gradstore/``; what costs too much to make per request and cannot
be kept is refused with a :class:`~gradstore.serve.errors.NotBuiltError` (409) naming the command that builds it
on the store: the derived run of ``method="dvemb"`` and FAISS indexes (``kind`` other than ``exact``)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gradstore.core.database import StoreCore, connect
from gradstore.errors import GradstoreError, StorePermissionError
from gradstore.serve.errors import NotBuiltError

FIT_CACHE_ENTRIES = 64  # at most this many fits whatever their size


def nbytes(value: Any, depth: int = 4) -> int:
    """The bytes of the arrays (numpy, torch) held by ``value`` and its attributes, lists and dicts (``depth``
    levels down): what a kept fit costs in memory."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if hasattr(value, "element_size") and hasattr(value, "nelement"):  # a torch tensor
        return int(value.element_size() * value.nelement())
    if depth == 0:
        return 0
    if isinstance(value, dict):
        return sum(nbytes(item, depth - 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(item, depth - 1) for item in value)
    if hasattr(value, "__dict__"):
        return sum(nbytes(item, depth - 1) for item in vars(value).values())
    return 0


class BoundedFits(OrderedDict):
    """A fit cache's ``spec -> (state, fit)`` map that keeps at most ``budget_bytes`` of fits (and
    :data:`FIT_CACHE_ENTRIES` of them), dropping the least recently used: a client asking for fits of ever new
    ``where`` filters makes the server fit again, not grow. Safe to use from several threads."""

    def __init__(self, budget_bytes: int, entries: dict | None = None) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self._sizes: dict[Any, int] = {}
        self._lock = threading.RLock()
        for key, value in (entries or {}).items():
            self[key] = value

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return super().__contains__(key)

    def __getitem__(self, key: Any) -> Any:
        with self._lock:
            value = super().__getitem__(key)
            self.move_to_end(key)
            return value

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            self._sizes[key] = nbytes(value)
            while len(self) > 1 and (len(self) > FIT_CACHE_ENTRIES or sum(self._sizes.values()) > self.budget_bytes):
                oldest = next(iter(self))
                super().__delitem__(oldest)
                self._sizes.pop(oldest, None)

    def __delitem__(self, key: Any) -> None:
        with self._lock:
            super().__delitem__(key)
            self._sizes.pop(key, None)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())


class ReadOnlyCore(StoreCore):
    """A :class:`~gradstore.core.database.StoreCore` this process never writes, from its first step: a fixed table
    the store lacks (a store made by an earlier version) reads as empty instead of being created at open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tables._writable = False


def open_read_only(uri: str | Path, read_consistency: timedelta) -> Any:
    """The store at ``uri`` (a ``GradStore``) opened without a write, taken as read-only (:func:`make_read_only`)."""
    from gradstore.store import GradStore

    store = GradStore(connect(uri, ReadOnlyCore, create=False, read_consistency=read_consistency))
    make_read_only(store)
    return store


def make_read_only(store: Any) -> None:
    """Take ``store`` (a ``GradStore``) as one this process may not write: fits and indexes stay in memory,
    writes raise ``StorePermissionError`` (``StoreCore.writable``), and reading a side file takes the writers' lock
    only where a writer made one (:func:`existing_lock_file`): no lock file is created per key read (a read token
    naming ever new ``where`` filters would otherwise add a file to the store for each)."""
    store.core.tables._writable = False
    files = store.core.files
    files._lock_file = lambda parts: existing_lock_file(files, parts)


def lock_file_path(files: Any, parts: tuple[str, ...]) -> Path:
    """Where ``SideFiles`` keeps the lock file of a key (``gradstore.core.sidefiles.SideFiles._lock_file``)."""
    from gradstore.core.sidefiles import LOCKS

    return Path(files.root) / LOCKS / f"{hashlib.sha256(files.path(*parts).encode()).hexdigest()[:32]}.lock"


def existing_lock_file(files: Any, parts: tuple[str, ...]) -> BinaryIO | None:
    """The key's lock file opened for a shared lock if a writer made one, else ``None`` (nothing created)."""
    try:
        descriptor = os.open(lock_file_path(files, parts), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    return os.fdopen(descriptor, "rb")


def bound_fits(store: Any, budget_bytes: int) -> BoundedFits:
    """Keep at most ``budget_bytes`` of fits in ``store``'s fit cache (least recently used dropped)."""
    bounded = BoundedFits(budget_bytes, dict(store.fits._fits))
    store.fits._fits = bounded
    return bounded


def refusal(error: StorePermissionError, name: str, args: dict[str, Any]) -> GradstoreError:
    """The error a read-only server answers when a call ran into a write: the command that builds what it lacks
    (no server path in the message)."""
    from gradstore.methods import DEFAULT_METHOD, resolve_method

    try:
        method = resolve_method(args.get("method", DEFAULT_METHOD))
    except (GradstoreError, TypeError):
        method = None
    built_first = method.read_only_refusal(str(args.get("run", "RUN")), error) if method is not None else None
    if built_first is not None:  # what the method builds on first use (dvemb: its derived run)
        return NotBuiltError(built_first)
    return NotBuiltError(f"{name} needs to write the store and this server is read-only (start it with --allow-writes)")


def check_index_built(store: Any, args: dict[str, Any]) -> None:
    """On a read-only server, an ``attribute`` with a FAISS ``kind`` reads an index already built in the store
    (building one per request would cost minutes and never be kept): ``NotBuiltError`` with the command otherwise.
    Arguments the store refuses anyway are left to it."""
    from gradstore.methods import DEFAULT_DAMPING, DEFAULT_METHOD, resolve_method
    from gradstore.preconditioning.fitting import Selection, fit_spec
    from gradstore.search.building import default_index_name
    from gradstore.search.index import INDEXES, MANIFEST_FILE
    from indexers import choose_index_kind

    kind = args.get("kind", "exact")
    if kind == "exact" or not isinstance(kind, str) or not isinstance(args.get("run"), str):
        return
    try:
        method = resolve_method(args.get("method", DEFAULT_METHOD))
        if method.reads_history:  # no index of one checkpoint's rows serves it
            return
        core, run = store.core, args["run"]
        checkpoint = args.get("checkpoint") or core.default_checkpoint(run)
        selection = Selection(run, checkpoint, args.get("split", "train"), args.get("where"))
        if kind == "auto":
            kind = choose_index_kind(selection.count(core), core.run_dim(run))
            if kind == "exact":
                return
        spec = fit_spec(core, selection, method, args.get("blocks", "auto"))
        damping = DEFAULT_DAMPING if args.get("damping") is None else float(args["damping"])
        name = default_index_name(selection, method, damping, kind, spec.blocks)
        built = core.files.exists(INDEXES, name, MANIFEST_FILE)
    except (GradstoreError, TypeError, ValueError):
        return  # the call itself says what is wrong
    if built:
        return
    options = f"--run {run} --method {method.name} --kind '{kind}'"
    if args.get("checkpoint"):
        options += f" --checkpoint {args['checkpoint']}"
    if args.get("damping") is not None:
        options += f" --damping {args['damping']}"
    if args.get("blocks", "auto") != "auto":
        options += f" --blocks {args['blocks']}"
    how = (
        f"`gradstore build-index STORE {options}`"
        if not args.get("where") and args.get("split", "train") == "train"
        else "store.build_index(...) with the same run, checkpoint, split, where, method and kind"
    )
    raise NotBuiltError(
        f"no {kind!r} index of these rows is built and this server is read-only (it builds no index per request): "
        f"the operator builds it with {how}, or use kind='exact'"
    )
