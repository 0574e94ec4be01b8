"""A run's capture coverage, read back from the ``capture_coverage`` table (:mod:`ingest.coverage` writes it)."""

from __future__ import annotations

from typing import Any, Protocol

import pyarrow as pa

from gradstore.core import schema as S


class TableReader(Protocol):
    """What reading the coverage needs of a store (:class:`gradstore.core.tables.Tables` is one)."""

    def has_table(self, name: str) -> bool: ...

    def scan(self, name: str) -> pa.Table: ...


def run_coverage(store: TableReader) -> dict[str, dict[str, Any]]:
    """Per run, the coverage of its latest capture: ``fraction`` of the trainable parameter entries captured,
    ``trainable`` entries, ``captured``/``not_captured`` parameter names and ``reasons`` (name -> why not)."""
    if not store.has_table(S.COVERAGE):
        return {}
    rows = store.scan(S.COVERAGE).to_pylist()
    latest: dict[str, Any] = {}
    for row in rows:
        if row["run_id"] not in latest or row["created_at"] > latest[row["run_id"]]:
            latest[row["run_id"]] = row["created_at"]
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        run = row["run_id"]
        if row["created_at"] != latest[run]:
            continue
        entry = out.setdefault(run, {"trainable": 0, "captured_entries": 0, "captured": [], "reasons": {}})
        if row["parameter"] in entry["captured"] or row["parameter"] in entry["reasons"]:
            continue  # another rank's row of the same capture
        entry["trainable"] += row["numel"]
        if row["captured"]:
            entry["captured_entries"] += row["numel"]
            entry["captured"].append(row["parameter"])
        else:
            entry["reasons"][row["parameter"]] = row["reason"]
    for entry in out.values():
        entry["fraction"] = entry.pop("captured_entries") / entry["trainable"] if entry["trainable"] else 1.0
        entry["not_captured"] = list(entry["reasons"])
    return out
