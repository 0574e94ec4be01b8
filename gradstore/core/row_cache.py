"""The row cache: what exact search and the store's small reads have read from Lance, kept for the next call.

One concept in three tiers, each a derived copy, never the truth, keyed so that a copy of other data is never
served:

* **In memory, for this process** (:class:`RowCache`, one per open store, ``store.row_cache``). Exact search over
  a selection of the gradients table reads every selected row; a repeated call (another ``attribute`` on the same
  rows) finds them here instead of reading Lance again. Keys carry the table's version, so rows appended (or
  deleted) since make a new key and the old entry is never served; the least recently used entries are dropped
  once the byte budget is exceeded. What an entry holds is the caller's business (:class:`indexers.PreparedRows`
  for the exact index, a selection's ``(grad_id, example_id)`` table, its row count, a small scan).
* **Row files, on local disk for the next process** (:class:`RowFiles`, ``store.row_files``): the prepared rows
  of a selection, so that a new process's first exact search maps them instead of reading Lance. The first exact
  search of a selection reads its rows from Lance and prepares them for the kernel (the bf16 copy, norms and
  rounding errors of the screen): on a 2-core machine, 50,000 x 4,096 float16 rows take ~0.9 s where searching
  them takes ~0.17 s, most of it Lance's decoding and the page faults of ~800 MB of fresh memory. The memory tier
  spares that to later calls of one process only; a command-line call is a new process every time. Once a search
  has prepared every row, a background thread writes them (``torch.save``, the format of
  :mod:`indexers.saved_rows`) to ``<cache dir>/rows/<name>.rows.pt``; the next process's first search
  memory-maps the file (``torch.load(mmap=True, weights_only=True)``: tensors only, no code runs), maps its pages
  in one call (:mod:`gradstore.core.mapped_pages`) and searches the rows where they lie, in the operating system's
  page cache. Selections smaller than
  :data:`ROW_FILE_MIN_BYTES` are not worth a file; files beyond the budget (the memory tier's: a file is fast only
  while the page cache can hold it) are removed least recently used first.
* **Scan files, on local disk for the next process** (:class:`ScanFiles`, ``store.scan_files``): the small reads
  every new process makes before it can search (the run's ``runs`` row, its checkpoints, the selection's
  ``grad_id`` s and its ``(grad_id, example_id)`` table), as Arrow files. Each is a Lance scan of a few
  milliseconds locally (the scan's set-up, not its bytes: 50,000 ids take 4-6 ms, the same from an Arrow file
  0.3 ms) and a round trip or more on object storage; the memory tier keeps them for later calls of one process,
  scan files for the next process. They live beside the row files (``<row files>/scans``). A file that does not
  load, fails Arrow's full validation or holds other columns than the scan asks for is removed and the scan runs on
  Lance. Scans larger than :data:`SCAN_FILE_MAX_BYTES` are not kept; beyond :data:`SCAN_FILES_BUDGET_BYTES` or
  :data:`SCAN_FILES_BUDGET_FILES` the least recently used files are removed.

What the two kinds of files share (names, atomic writes, eviction): a file's name is ``<hash of what it holds>-<hash
of what that was read from>`` (:func:`cache_file_name`): what the rows are (store, table, selection, kernel; or
the scan's table, columns and filter) and exactly which immutable Lance data and deletion files they were read
from (:func:`dataset_content`), so rows appended, deleted or rewritten give another name, and writing a new file
removes the stale ones of the same thing (:func:`evict`). Files live in a directory of the user's
(``GRADSTORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/gradstore``, else ``~/.cache/gradstore``), never in the store, so
a store from someone else cannot plant one; a file that does not load, or does not hold what its name promises, is
removed (:func:`load_or_remove`) and the data are read from Lance. The store's own side files (fits, indexes,
curvature, bases: :mod:`gradstore.core.sidefiles`) are another thing: they are the truth, kept in the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from gradstore.core.mapped_pages import populate, tensors_in
from indexers import PreparedRows
from indexers.saved_rows import rows_state

log = logging.getLogger(__name__)
_Loaded = TypeVar("_Loaded")


# --------------------------------------------------------------------------------------------- in memory (this process)
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
    from several threads (a row file's writer swaps the rows it wrote in: :meth:`RowFiles.save_later`)."""

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


# ----------------------------------------------------------------------- files on local disk (the next process): shared
STALE_TEMP_SECONDS = 3600  # a temporary file this old was left by a process that died while writing


def cache_file_name(identity: dict[str, Any], content: dict[str, Any]) -> str:
    """``<hash of identity>-<hash of content>`` (each 32 hex digits)."""
    return f"{_digest(identity)}-{_digest(content)}"


def _digest(value: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def dataset_content(dataset: Any) -> dict[str, Any]:
    """What a read of the Lance ``dataset`` (one version of a table) reads from: its version and its fragments'
    data and deletion files, which Lance never changes in place (a table made again at the same path and version
    has other files)."""
    return {"version": dataset.version, "fragments": [str(f.metadata) for f in dataset.get_fragments()]}


def load_or_remove(path: Path, load: Callable[[Path], _Loaded], kind: str) -> _Loaded | None:
    """``load(path)``; ``None`` when there is no file at ``path`` or it fails to load or check (then the ``kind``
    file is removed: a damaged cache file only costs a read from the store). A loaded file is marked recently used
    (removed last by :func:`evict`)."""
    if not path.is_file():
        return None
    try:
        loaded = load(path)
    except Exception as error:
        log.warning("%s %s is unusable (%s); removed, read from the store instead", kind, path, error)
        path.unlink(missing_ok=True)
        return None
    with contextlib.suppress(OSError):  # removed by another process meanwhile, or a read-only directory
        os.utime(path)
    return loaded


def write_into_place(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` a temporary file beside ``path``, then rename it to ``path``: readers see a whole file or
    none. The temporary file is removed if anything fails."""
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def evict(kept: Path, suffix: str, budget_bytes: int, budget_files: int | None = None) -> None:
    """In ``kept``'s directory, remove the other files of the same thing as ``kept`` (same first part of the name),
    temporary files of dead writers, and the least recently used ``suffix`` files until the directory holds at most
    ``budget_bytes`` and (when given) ``budget_files`` of them."""
    same = kept.name.split("-")[0]
    now = time.time()
    files = []
    for path in kept.parent.iterdir():
        try:
            stat = path.stat()
            if path.name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_SECONDS:
                path.unlink()
            elif path.name.endswith(suffix) and path.name != kept.name:
                if path.name.split("-")[0] == same:
                    path.unlink()
                else:
                    files.append((stat.st_mtime, stat.st_size, path))
        except FileNotFoundError:  # another process removed it meanwhile
            continue
    total = sum(size for _, size, _ in files) + _size(kept)
    count = len(files) + 1
    for _, size, path in sorted(files, key=lambda entry: entry[0]):
        if total <= budget_bytes and (budget_files is None or count <= budget_files):
            break
        path.unlink(missing_ok=True)
        total -= size
        count -= 1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # removed by another process's eviction meanwhile
        return 0


# ------------------------------------------------------------------------------------------------------------ row files
ROW_FILE_SUFFIX = ".rows.pt"
ROW_FILE_MIN_BYTES = 32 << 20  # smaller selections read from Lance in well under 0.1 s


def default_row_files_directory() -> Path:
    """``$GRADSTORE_CACHE_DIR/rows``, else ``$XDG_CACHE_HOME/gradstore/rows``, else ``~/.cache/gradstore/rows``."""
    base = os.environ.get("GRADSTORE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(xdg) / "gradstore")
    return Path(base) / "rows"


def row_files_directory(row_files: bool | str | Path) -> Path | None:
    """The directory ``gradstore.open(..., row_files=...)`` means: ``True`` the default one, ``False`` none."""
    if row_files is True:
        return default_row_files_directory()
    return None if row_files is False else Path(row_files)


class RowFiles:
    """The row files of one directory (``None``: none are kept).

    ``budget_bytes`` caps the directory (default: the row cache's budget), ``min_bytes`` the smallest
    selection written."""

    def __init__(
        self, directory: str | Path | None, budget_bytes: int | None = None, min_bytes: int = ROW_FILE_MIN_BYTES
    ) -> None:
        self.directory = None if directory is None else Path(directory)
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else budget_bytes
        self.min_bytes = min_bytes
        self._writing: list[threading.Thread] = []
        self._lock = threading.Lock()

    def path(self, name: str) -> Path | None:
        """Where the file ``name`` (a :func:`cache_file_name`) lives, ``None`` without a
        directory."""
        return None if self.directory is None else self.directory / f"{name}{ROW_FILE_SUFFIX}"

    def load(self, name: str, check: Callable[[Any], PreparedRows]) -> PreparedRows | None:
        """The rows in file ``name``, memory-mapped and checked by ``check`` (a loaded state -> rows, raising on
        rows that are not the expected ones); ``None`` when there is no such file or it fails to load or check
        (then it is removed)."""
        path = self.path(name)
        if path is None:
            return None

        def load(path: Path) -> PreparedRows:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            populate(tensors_in(state))  # the search reads every page: mapped in one call, not page faults
            return check(state)

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
            found.append({"name": path.name[: -len(ROW_FILE_SUFFIX)], "bytes": stat.st_size, "last_used": last_used})
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
        return [path for path in self.directory.iterdir() if path.name.endswith(ROW_FILE_SUFFIX)]

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
        path = self.directory / f"{name}{ROW_FILE_SUFFIX}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(self.directory).free < 2 * nbytes:
                log.info("no row file for %s: less than twice its %d bytes free in %s", name, nbytes, self.directory)
                return
            start = time.perf_counter()
            write_into_place(path, lambda temporary: torch.save(rows_state(rows), temporary))
            log.info("row file %s written in %.1f s", name, time.perf_counter() - start)
            evict(path, ROW_FILE_SUFFIX, self.budget_bytes)
            if then is not None:
                then()
        except Exception as error:  # a cache that cannot be written costs only speed
            log.warning("row file %s not written: %s", name, error)


# ----------------------------------------------------------------------------------------------------------- scan files
SCAN_FILE_SUFFIX = ".arrow"
SCANS_DIRECTORY = "scans"  # under the row files' directory
SCAN_FILE_MAX_BYTES = 64 << 20  # a scan this large takes long enough on Lance that its own read dominates
SCAN_FILES_BUDGET_BYTES = 512 << 20
#: Small files of stores long gone would otherwise pile up (and each save lists the directory).
SCAN_FILES_BUDGET_FILES = 2048


class ScanFiles:
    """The scan files of one directory (``None``: none are kept)."""

    def __init__(
        self,
        directory: str | Path | None,
        budget_bytes: int = SCAN_FILES_BUDGET_BYTES,
        max_file_bytes: int = SCAN_FILE_MAX_BYTES,
        budget_files: int = SCAN_FILES_BUDGET_FILES,
    ) -> None:
        self.directory = None if directory is None else Path(directory)
        self.budget_bytes = budget_bytes
        self.max_file_bytes = max_file_bytes
        self.budget_files = budget_files

    def read(self, dataset: Any, identity: dict[str, Any], scan: Callable[[], pa.Table], schema: pa.Schema) -> pa.Table:
        """What ``scan()`` (a read of the Lance ``dataset`` described by ``identity``) returns: from its file when
        one holds it (memory-mapped, validated, with exactly ``schema``'s field names and types), else from
        ``scan()``, then kept in a file for the next process."""
        if self.directory is None:
            return scan()
        path = self.directory / f"{cache_file_name(identity, dataset_content(dataset))}{SCAN_FILE_SUFFIX}"
        found = self._load(path, schema)
        if found is not None:
            return found
        table = scan()
        if table.nbytes <= self.max_file_bytes:
            self._save(path, table)
        return table

    def clear(self) -> int:
        """Remove every scan file; returns how many."""
        removed = 0
        for path in self._files():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        return removed

    def usage(self) -> tuple[int, int]:
        """``(files, bytes)`` of the scan files there are now."""
        sizes = []
        for path in self._files():
            with contextlib.suppress(FileNotFoundError):  # removed by another process meanwhile
                sizes.append(path.stat().st_size)
        return len(sizes), sum(sizes)

    def _files(self) -> list[Path]:
        if self.directory is None or not self.directory.is_dir():
            return []
        return [path for path in self.directory.iterdir() if path.name.endswith(SCAN_FILE_SUFFIX)]

    def _load(self, path: Path, schema: pa.Schema) -> pa.Table | None:
        def load(path: Path) -> pa.Table:
            with pa.memory_map(str(path)) as source:
                table = ipc.open_file(source).read_all()
            table.validate(full=True)
            if [(f.name, f.type) for f in table.schema] != [(f.name, f.type) for f in schema]:
                raise ValueError(f"holds columns {table.schema.names}, the scan reads {schema.names}")
            return table

        return load_or_remove(path, load, "scan file")

    def _save(self, path: Path, table: pa.Table) -> None:
        """Write the file into place (readers see a whole file or none), then keep the directory within budget."""

        def write(temporary: Path) -> None:  # one record batch: a reader maps whole columns, no chunks to join
            with ipc.new_file(str(temporary), table.schema) as writer:
                writer.write_table(table.combine_chunks())

        try:
            write_into_place(path, write)
            evict(path, SCAN_FILE_SUFFIX, self.budget_bytes, self.budget_files)
        except (OSError, pa.ArrowException) as error:  # a cache that cannot be written costs only speed
            log.warning("scan file %s not written: %s", path, error)
