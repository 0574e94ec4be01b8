"""Rows made ready for search, kept in memory between calls (one cache per open store).

Exact search over a selection of the gradients table reads every selected row; a repeated call (another
``attribute`` on the same rows) finds them here instead of reading Lance again. Keys carry the gradients
table's version, so rows appended (or deleted) since make a new key and the old entry is never served; the
least recently used entries are dropped once the byte budget is exceeded. What an entry holds is the caller's
business (:class:`indexers.PreparedRows` for the exact index, a selection's ``(grad_id, example_id)`` table,
its row count).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


def default_budget_bytes() -> int:
    """A quarter of this machine's physical memory, at least 2 GiB (float16 rows and their bf16 copy take
    4 bytes a value: 2 GiB hold 130,000 rows x 4,096 dims)."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        physical = 0
    return max(2 << 30, physical // 4)


class RowCache:
    """Entries ``key -> (value, nbytes)``, least recently used dropped first beyond ``budget_bytes``; safe to use
    from several threads (a row file's writer swaps the rows it wrote in, :mod:`gradstore.core.rowfiles`)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else budget_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.RLock()

    def get(self, key: Hashable) -> Any | None:
        """The value under ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def memo(self, key: Hashable, make: Callable[[], Any], nbytes: int = 0) -> Any:
        """The value under ``key``, made by ``make()`` and kept (when admitted) if there is none."""
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value, nbytes)
        return value

    def admits(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` can be kept at all."""
        return nbytes <= self.budget_bytes

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        """Keep ``value`` (if :meth:`admits` it), dropping entries of other versions of the same rows
        (``key[1:]`` equal) and then the least recently used ones until the budget holds."""
        if not self.admits(nbytes):
            return
        with self._lock:
            for stale in [k for k in self._entries if _same_rows(k, key)]:
                del self._entries[stale]
            self._entries[key] = (value, nbytes)
            while self.nbytes > self.budget_bytes:
                self._entries.popitem(last=False)

    def replace(self, key: Hashable, old: Any, new: Any) -> bool:
        """Put ``new`` in place of ``old`` under ``key`` (same size, same recency) if ``old`` is still there."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not old:
                return False
            self._entries[key] = (new, entry[1])
            return True

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            return sum(size for _, size in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()


def _same_rows(old: Hashable, new: Hashable) -> bool:
    """Keys ``(version, *rest)`` of the same rows at another version."""
    return isinstance(old, tuple) and isinstance(new, tuple) and old[1:] == new[1:] and old[0] != new[0]
