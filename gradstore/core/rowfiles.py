"""Prepared rows kept in files on local disk between processes, so that a new process's first exact search maps
them instead of reading Lance.

The first exact search of a selection reads its rows from Lance and prepares them for the kernel (the bf16 copy,
norms and rounding errors of the screen): on a 2-core machine, 50,000 x 4,096 float16 rows take ~0.9 s where
searching them takes ~0.17 s, most of it Lance's decoding and the page faults of ~800 MB of fresh memory. The
:class:`~gradstore.core.rowcache.RowCache` spares that to later calls of one process only; a command-line call
is a new process every time. Once a search has prepared every row, a background thread writes them
(``torch.save``) to ``<cache dir>/rows/<name>.rows.pt``; the next process's first search memory-maps the file
(``torch.load(mmap=True, weights_only=True)``: tensors only, no code runs) and searches the mapped rows where
they lie, in the operating system's page cache.

A row file is a derived copy, never the truth: its name hashes what the rows are (store, table, selection,
kernel) and exactly which immutable Lance data and deletion files they were read from, so rows appended,
deleted or rewritten give another name and a stale file is never served; writing a file removes the other
files of the same rows. Files live in a directory of the user's (``GRADSTORE_CACHE_DIR``, else
``$XDG_CACHE_HOME/gradstore``, else ``~/.cache/gradstore``), never in the store, so a store from someone else
cannot plant one; a file that does not load, or does not hold the rows its name promises (kernel, width, row
count), is removed and the rows are read from Lance. Selections smaller than :data:`MIN_BYTES` are not worth a
file; files beyond the budget (the row cache's: a file is fast only while the page cache can hold it) are
removed least recently used first.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from gradstore.core.cachefiles import evict, load_or_remove, write_into_place
from gradstore.core.rowcache import default_budget_bytes
from indexers import PreparedRows
from indexers.saved_rows import rows_state

log = logging.getLogger(__name__)

SUFFIX = ".rows.pt"
MIN_BYTES = 32 << 20  # smaller selections read from Lance in well under 0.1 s


def default_directory() -> Path:
    """``$GRADSTORE_CACHE_DIR/rows``, else ``$XDG_CACHE_HOME/gradstore/rows``, else ``~/.cache/gradstore/rows``."""
    base = os.environ.get("GRADSTORE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(xdg) / "gradstore")
    return Path(base) / "rows"


def directory_of(row_files: bool | str | Path) -> Path | None:
    """The directory ``gradstore.open(..., row_files=...)`` means: ``True`` the default one, ``False`` none."""
    if row_files is True:
        return default_directory()
    return None if row_files is False else Path(row_files)


class RowFiles:
    """The row files of one directory (``None``: none are kept).

    ``budget_bytes`` caps the directory (default: the row cache's budget), ``min_bytes`` the smallest
    selection written."""

    def __init__(
        self, directory: str | Path | None, budget_bytes: int | None = None, min_bytes: int = MIN_BYTES
    ) -> None:
        self.directory = None if directory is None else Path(directory)
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else budget_bytes
        self.min_bytes = min_bytes
        self._writing: list[threading.Thread] = []
        self._lock = threading.Lock()

    def path(self, name: str) -> Path | None:
        """Where the file ``name`` (a :func:`~gradstore.core.cachefiles.cache_file_name`) lives, ``None`` without a
        directory."""
        return None if self.directory is None else self.directory / f"{name}{SUFFIX}"

    def load(self, name: str, check: Callable[[Any], PreparedRows]) -> PreparedRows | None:
        """The rows in file ``name``, memory-mapped and checked by ``check`` (a loaded state -> rows, raising on
        rows that are not the expected ones); ``None`` when there is no such file or it fails to load or check
        (then it is removed)."""
        path = self.path(name)
        if path is None:
            return None

        def load(path: Path) -> PreparedRows:
            return check(torch.load(path, map_location="cpu", mmap=True, weights_only=True))

        return load_or_remove(path, load, "row file")

    def save_later(self, name: str, rows: PreparedRows, nbytes: int, then: Callable[[], None] | None = None) -> None:
        """Write ``rows`` (complete, ``nbytes`` in memory) to file ``name`` in a background thread, when they are
        large enough to be worth a file and fit the budget, and call ``then()`` in that thread once the file is
        in place. The thread is not a daemon: a process that ends waits for the file (once; afterwards every new
        process maps it)."""
        if self.directory is None or not self.min_bytes <= nbytes <= self.budget_bytes:
            return
        thread = threading.Thread(target=self._save, args=(name, rows, nbytes, then), name="gradstore-row-file")
        with self._lock:
            self._writing = [t for t in self._writing if t.is_alive()] + [thread]
        thread.start()

    def entries(self) -> list[dict[str, Any]]:
        """The row files there are now, most recently used first: ``name``, ``bytes``, ``last_used`` (UTC)."""
        found = []
        for path in self._files():
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            last_used = datetime.fromtimestamp(stat.st_mtime, timezone.utc)
            found.append({"name": path.name[: -len(SUFFIX)], "bytes": stat.st_size, "last_used": last_used})
        return sorted(found, key=lambda entry: entry["last_used"], reverse=True)

    def clear(self) -> int:
        """Remove every row file (searches read their rows from the stores again); returns how many."""
        self.wait()
        removed = 0
        for path in self._files():
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                continue
        return removed

    def _files(self) -> list[Path]:
        if self.directory is None or not self.directory.is_dir():
            return []
        return [path for path in self.directory.iterdir() if path.name.endswith(SUFFIX)]

    def wait(self) -> None:
        """Return once every file being written has been written (or given up)."""
        with self._lock:
            writing = list(self._writing)
        for thread in writing:
            thread.join()

    def _save(self, name: str, rows: PreparedRows, nbytes: int, then: Callable[[], None] | None) -> None:
        """Write the file into place (readers see a whole file or none), then remove the other files of the same
        rows and, least recently used first, files beyond the budget."""
        assert self.directory is not None
        path = self.directory / f"{name}{SUFFIX}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.directory).free < 2 * nbytes:
                log.info("no row file for %s: less than twice its %d bytes free in %s", name, nbytes, self.directory)
                return
            start = time.perf_counter()
            write_into_place(path, lambda temporary: torch.save(rows_state(rows), temporary))
            log.info("row file %s written in %.1f s", name, time.perf_counter() - start)
            evict(path, SUFFIX, self.budget_bytes)
            if then is not None:
                then()
        except Exception as error:  # a cache that cannot be written costs only speed
            log.warning("row file %s not written: %s", name, error)
