"""Attribution reports: one self-contained HTML page per store (``gradstore report``, ``store.report``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from gradstore.answers.report.data import ReportData, ReportOptions, gather
from gradstore.answers.report.html import render

if TYPE_CHECKING:
    from gradstore.core import StoreCore


def write_report(
    store: StoreCore,
    out: str | Path = "report.html",
    *,
    options: ReportOptions | None = None,
    selection: pa.Table | None = None,
) -> Path:
    """Write the report of ``store`` to ``out`` (one HTML file that opens offline) and return its path."""
    path = Path(out)
    path.write_text(render(gather(store, options, selection)), encoding="utf-8")
    return path


__all__ = ["ReportData", "ReportOptions", "gather", "render", "write_report"]
