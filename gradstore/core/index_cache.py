"""Loaded FAISS indexes of one open store, kept in memory between searches (``store.index_cache``).

Loading a FAISS index reads and checks (SHA-256) every one of its side files, which for a large index takes far
longer than a search. Each entry is keyed by the index name and the identity of what is on disk: the bytes of its
``manifest.json`` (which names the directory of its FAISS files, a fresh one per save, and the gradients version
and rows the index covers) and the checksums kept beside those files. A load reads the small manifest and
checksum files every time and uses the entry only when both match, so an index saved again by this or another
process (rebuilt, rows appended) is read again; what a hit skips is reading and hashing the FAISS files.

Entries are shared: a caller that changes a loaded FAISS index in place (adds rows) copies it first
(:meth:`IndexCache.holds`). At most :data:`MAX_INDEXES` indexes are kept, least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: How many loaded indexes one store keeps in memory.
MAX_INDEXES = 4


@dataclass(frozen=True)
class LoadedIndex:
    """What loading an index's FAISS files gave, and the search parameters it had then."""

    identity: tuple[bytes, tuple[tuple[str, str], ...]]  # manifest bytes, (file, checksum) of its FAISS files
    faiss_index: Any
    indexed_ids: Any
    first_preconditioner: Any | None
    nprobe: int | None
    ef_search: int | None


class IndexCache:
    """Loaded indexes by name, each valid for one on-disk identity; safe to use from several threads."""

    def __init__(self, max_indexes: int = MAX_INDEXES) -> None:
        self.max_indexes = max_indexes
        self._entries: OrderedDict[str, LoadedIndex] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str, identity: tuple) -> LoadedIndex | None:
        """The entry of ``name`` if it was loaded from files of this ``identity`` (now the most recently used);
        an entry of another identity is dropped (the index changed on disk)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            if entry.identity != identity:
                del self._entries[name]
                return None
            self._entries.move_to_end(name)
            return entry

    def put(self, name: str, entry: LoadedIndex) -> None:
        """Keep ``entry`` for ``name`` (replacing any other), dropping the least recently used beyond the bound."""
        with self._lock:
            self._entries.pop(name, None)
            self._entries[name] = entry
            while len(self._entries) > self.max_indexes:
                self._entries.popitem(last=False)

    def discard(self, name: str) -> None:
        """Forget ``name``'s entry, if any."""
        with self._lock:
            self._entries.pop(name, None)

    def holds(self, faiss_index: Any) -> bool:
        """Whether ``faiss_index`` is an entry's (shared: copy it before changing it)."""
        with self._lock:
            return any(entry.faiss_index is faiss_index for entry in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
