"""``gradstore verify``: read everything a store holds and report what is damaged.

Every table is opened and scanned in full (each column of each row is decoded, so a missing or
unreadable data file shows), its row count compared with the count its manifest reports; the
gradient tables' (one per dim) vectors and norms must be finite, their ``grad_id``s unique and their runs
known and of the table's dim; every side file must match the checksum written beside it. A table whose
creation never committed (what a kill while creating it leaves) is absent for the store, not damaged: the
next open or run creation completes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from gradstore.core import schema as S
from gradstore.core.catalog import RunCatalog
from gradstore.core.gradient_tables import is_gradient_table, table_dim
from gradstore.core.tables import Tables
from gradstore.core.vectors import decode, storage_dtype_of


@dataclass
class VerifyReport:
    """What :func:`verify_store` found: per-table rows read, side files checked, and the problems."""

    tables: dict[str, int] = field(default_factory=dict)
    side_files_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether nothing is damaged."""
        return not self.problems


def verify_store(tables: Tables, catalog: RunCatalog, block_rows: int = 65536) -> VerifyReport:
    """Check every table and side file of a store (its :class:`~gradstore.core.tables.Tables` and runs)."""
    report = VerifyReport()
    for name in sorted(tables.db.list_tables().tables):
        if not tables.committed(name):  # a kill during its creation: absent for the store, completed on use
            continue
        try:
            expected = tables.table(name).count_rows()
            dataset = tables.table(name).to_lance()
            rows = _scan(name, dataset, block_rows, catalog, report)
        except Exception as error:  # any failure to read is damage; the message names the file
            report.problems.append(f"table {name}: cannot be read: {error}")
            continue
        report.tables[name] = rows
        if rows != expected:
            report.problems.append(f"table {name}: {rows} rows readable but its manifest counts {expected}")
    problems, report.side_files_checked = tables.files.damaged()
    report.problems.extend(problems)
    return report


def _scan(name: str, dataset: Any, block_rows: int, catalog: RunCatalog, report: VerifyReport) -> int:
    rows = 0
    grad_ids: list[np.ndarray] = []
    runs: set[str] = set()
    dtype = storage_dtype_of(dataset.schema.field(S.VECTOR_COLUMN)) if is_gradient_table(name) else None
    for batch in dataset.to_batches(batch_size=block_rows):
        rows += batch.num_rows
        if not is_gradient_table(name):
            continue
        grad_ids.append(batch.column("grad_id").to_numpy())
        runs.update(batch.column("run_id").unique().to_pylist())
        vectors = decode(batch, dtype)
        bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
        if len(bad):
            ids = batch.column("example_id").take(pa.array(bad[:5])).to_pylist()
            report.problems.append(f"table {name}: {len(bad)} row(s) hold non-finite vectors (example ids {ids})")
    if grad_ids:
        ids = np.concatenate(grad_ids)
        duplicated = len(ids) - len(np.unique(ids))
        if duplicated:
            report.problems.append(f"table {name}: {duplicated} duplicated grad_id(s)")
        known = catalog.runs()
        dims = dict(zip(known.column("run_id").to_pylist(), known.column("dim").to_pylist()))
        if runs - set(dims):
            report.problems.append(f"table {name}: rows of unknown run(s) {sorted(runs - set(dims))}")
        dim = table_dim(dataset.schema)
        elsewhere = sorted(run for run in runs if run in dims and dims[run] != dim)
        if elsewhere:
            report.problems.append(f"table {name}: rows of run(s) {elsewhere} whose dim is not this table's {dim}")
    return rows
