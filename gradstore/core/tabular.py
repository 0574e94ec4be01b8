"""Turning the data people have into Arrow tables (for ``add_examples`` and friends)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gradstore.errors import InvalidArgumentError


def to_arrow_table(data: Any) -> pa.Table:
    """Convert a pyarrow Table/RecordBatch, pandas or polars DataFrame, HF ``datasets.Dataset``,
    parquet path, or list of dicts to a pyarrow Table."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.exists():
            raise InvalidArgumentError(f"no such parquet file or directory: {path}")
        return pq.read_table(path)
    if isinstance(data, list):
        if data and not all(isinstance(row, dict) for row in data):
            raise InvalidArgumentError("a list of examples must hold dicts (one per example)")
        return pa.Table.from_pylist(data)
    module = type(data).__module__.split(".")[0]
    if module == "pandas":
        return pa.Table.from_pandas(data, preserve_index=False)
    if module == "polars":
        return data.to_arrow()
    if module == "datasets" and hasattr(data, "data"):
        return data.data.table if hasattr(data.data, "table") else pa.table(data.to_dict())
    raise InvalidArgumentError(
        f"cannot read examples from {type(data).__name__}: pass a pyarrow Table, pandas/polars "
        "DataFrame, datasets.Dataset, parquet path or list of dicts"
    )
