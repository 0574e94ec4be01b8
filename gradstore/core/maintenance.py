"""Keeping a store in shape: compaction, a check of every table and side file, a summary (:class:`Maintenance`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from gradstore.core import commits
from gradstore.core import schema as S
from gradstore.core.catalog import RunCatalog
from gradstore.core.coverage import run_coverage
from gradstore.core.tables import Tables, writes
from gradstore.core.verify import VerifyReport, verify_store
from gradstore.errors import InvalidArgumentError


class Maintenance:
    """Compaction, verification and the summary of one store."""

    def __init__(self, tables: Tables, catalog: RunCatalog) -> None:
        self.tables = tables
        self.catalog = catalog

    @writes("compact the tables")
    def compact(self, cleanup_older_than: timedelta | None = None) -> dict[str, int]:
        """Compact every table's fragments; optionally delete versions older than ``cleanup_older_than``.

        Returns the fragment count of each table after compaction.
        """
        if cleanup_older_than is not None and (
            not isinstance(cleanup_older_than, timedelta) or cleanup_older_than < timedelta(0)
        ):
            raise InvalidArgumentError(
                f"cleanup_older_than must be a timedelta >= 0 (versions older than it are deleted), "
                f"got {cleanup_older_than!r}"
            )
        counts = {}
        for name in self.tables.db.list_tables().tables:
            if len(self.tables.table(name).to_lance().get_fragments()) > 1:
                commits.compact(self.tables.table(name), f"compaction of {name!r}")
            if cleanup_older_than is not None:
                self.tables.table(name).to_lance().cleanup_old_versions(older_than=cleanup_older_than)
            counts[name] = len(self.tables.table(name).to_lance().get_fragments())
        return counts

    def verify(self) -> VerifyReport:
        """Read every table and side file and report what is damaged (see :mod:`gradstore.core.verify`)."""
        return verify_store(self.tables, self.catalog)

    def info(self) -> dict[str, Any]:
        """A summary: tables with rows, fragments and versions, runs with their dims, dims, dtype, bytes on disk,
        and each run's capture coverage (:func:`gradstore.core.coverage.run_coverage`).

        ``dim`` is the store's one dim, or ``None`` while it holds none or several (see ``dims``)."""
        tables = {}
        for name in sorted(self.tables.stored_names()):
            dataset = self.tables.table(name).to_lance()
            tables[name] = {
                "rows": dataset.count_rows(),
                "fragments": len(dataset.get_fragments()),
                "version": dataset.version,
            }
        size = self.tables.files.bytes_under_store()
        runs = self.catalog.runs() if self.tables.has_table(S.RUNS) else S.RUNS_SCHEMA.empty_table()
        dims = self.catalog.dims
        return {
            "uri": self.tables.uri,
            "dim": dims[0] if len(dims) == 1 else None,
            "dims": dims,
            "storage_dtype": self.catalog.storage_dtype,
            "runs": runs.column("run_id").to_pylist(),
            "run_dims": dict(zip(runs.column("run_id").to_pylist(), runs.column("dim").to_pylist())),
            "tables": tables,
            "bytes_on_disk": size,
            "coverage": run_coverage(self.tables),
        }
