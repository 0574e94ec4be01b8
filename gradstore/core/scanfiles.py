"""Small reads of a store's tables kept as Arrow files on local disk between processes.

Every call of a new process (each command-line call is one) first reads a few small things from Lance before it
can search: the run's ``runs`` row, its checkpoints, the selection's ``grad_id``s (how many rows, the largest id)
and, for the results, its ``(grad_id, example_id)`` table. Each is a Lance scan of a few milliseconds locally (the
scan's set-up, not its bytes: 50,000 ids take 4-6 ms, the same from an Arrow file 0.3 ms) and a round trip or
more on object storage. The :class:`~gradstore.core.rowcache.RowCache` spares them to later calls of one process;
scan files spare them to the next process.

A scan file is a derived copy, never the truth, named as a row file is (:func:`~gradstore.core.cachefiles.
cache_file_name`): by what was read (store, table, columns, filter) and exactly what it was read from (the table's
version and its fragments' immutable data and deletion files), so a scan of other data is never served. Files
live beside the row files in the user's cache directory (``<row files>/scans``), never in the store; a file that
does not load, fails Arrow's full validation or holds other columns than the scan asks for is removed and the scan
runs on Lance. Scans larger than :data:`MAX_FILE_BYTES` are not kept; beyond :data:`BUDGET_BYTES` or
:data:`BUDGET_FILES` the least recently used files are removed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from gradstore.core.cachefiles import cache_file_name, dataset_content, evict, load_or_remove, write_into_place

log = logging.getLogger(__name__)

SUFFIX = ".arrow"
SCANS_DIRECTORY = "scans"  # under the row files' directory
MAX_FILE_BYTES = 64 << 20  # a scan this large takes long enough on Lance that its own read dominates
BUDGET_BYTES = 512 << 20
BUDGET_FILES = 2048  # small files of stores long gone would otherwise pile up (and each save lists the directory)


class ScanFiles:
    """The scan files of one directory (``None``: none are kept)."""

    def __init__(
        self,
        directory: str | Path | None,
        budget_bytes: int = BUDGET_BYTES,
        max_file_bytes: int = MAX_FILE_BYTES,
        budget_files: int = BUDGET_FILES,
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
        path = self.directory / f"{cache_file_name(identity, dataset_content(dataset))}{SUFFIX}"
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
        return [path for path in self.directory.iterdir() if path.name.endswith(SUFFIX)]

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
            evict(path, SUFFIX, self.budget_bytes, self.budget_files)
        except (OSError, pa.ArrowException) as error:  # a cache that cannot be written costs only speed
            log.warning("scan file %s not written: %s", path, error)
