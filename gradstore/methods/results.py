"""What the methods' operations return: :class:`ScoreMatrix` and the ``scores`` tables of top-k searches, over
one checkpoint's rows (:func:`index_table`) or per example, summed over its rows (:func:`example_table`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from gradstore.search import scan_tasks
from gradstore.search.index import AttributionIndex, valid_entries


@dataclass
class ScoreMatrix:
    """Dense scores of every query against every selected training row."""

    scores: np.ndarray  # float32 [queries, rows]
    query_ids: list[str]
    example_ids: list[str]  # one per row (column)
    grad_ids: np.ndarray  # int64, one per row

    def torch(self) -> torch.Tensor:
        """The scores as a torch tensor (zero-copy)."""
        return torch.from_numpy(self.scores)


def index_table(
    index: AttributionIndex,
    query_ids: list[str],
    scores: np.ndarray,
    grad_ids: np.ndarray,
    largest: bool,
    method: str,
    run: str,
) -> pa.Table:
    """One side (``largest``: proponents, ranks 1..k; else opponents, -1..-k) of an index search as a ``scores``
    table of method ``method``."""
    positions, ranks, flat_scores, flat_ids = valid_entries(scores, grad_ids)  # FAISS padding dropped
    n = len(flat_ids)
    return pa.table(
        {
            "query_id": pa.array(np.asarray(query_ids, dtype=object)[positions], pa.string()),
            "example_id": index.example_ids(flat_ids),
            "grad_id": pa.array(flat_ids, pa.int64()),
            "score": pa.array(flat_scores.astype(np.float64)),
            "rank": pa.array(ranks * (1 if largest else -1)),
            "method": pa.array([method] * n, pa.string()),
            "run_id": pa.array([run] * n, pa.string()),
            "checkpoint": pa.array([index.manifest["checkpoint"]] * n, pa.string()),
            "index_name": pa.array([index.name] * n, pa.string()),
        }
    )


def example_table(
    found: scan_tasks.ExampleTopK,
    query_ids: list[str],
    sides: tuple[bool, ...],
    *,
    method: str,
    run: str,
    checkpoint: str,
) -> pa.Table:
    """The per-example top-k (and bottom-k) lists as a ``scores`` table (no ``grad_id``: sums over rows)."""
    columns: dict[str, list] = {name: [] for name in ("query_id", "example_id", "score", "rank")}
    for side in sides:
        scores, example_ids = found[side]
        width = scores.shape[1]
        for row, query_id in enumerate(query_ids):
            columns["query_id"] += [query_id] * width
            columns["example_id"] += example_ids[row].tolist()
            columns["score"] += scores[row].tolist()
            columns["rank"] += [(r + 1) * (1 if side else -1) for r in range(width)]
    n = len(columns["rank"])
    return pa.table(
        {
            "query_id": pa.array(columns["query_id"], pa.string()),
            "example_id": pa.array(columns["example_id"], pa.string()),
            "grad_id": pa.nulls(n, pa.int64()),
            "score": pa.array(columns["score"], pa.float64()),
            "rank": pa.array(columns["rank"], pa.int32()),
            "method": pa.array([method] * n, pa.string()),
            "run_id": pa.array([run] * n, pa.string()),
            "checkpoint": pa.array([checkpoint] * n, pa.string()),
            "index_name": pa.nulls(n, pa.string()),
        }
    )


def self_influence_table(
    example_ids: pa.ChunkedArray | list[str],
    grad_ids: pa.ChunkedArray | pa.Array,
    values: pa.ChunkedArray | list[float],
    *,
    method: str,
    run: str,
    checkpoint: str | None,
) -> pa.Table:
    """A ``self_influence`` table, most self-influential first."""
    n = len(example_ids)
    table = pa.table(
        {
            "example_id": pa.array(example_ids, pa.string()) if isinstance(example_ids, list) else example_ids,
            "grad_id": grad_ids,
            "run_id": pa.array([run] * n, pa.string()),
            "checkpoint": pa.array([checkpoint] * n, pa.string()),
            "method": pa.array([method] * n, pa.string()),
            "self_influence": pa.array(values, pa.float64()) if isinstance(values, list) else values,
        }
    )
    return table.sort_by([("self_influence", "descending")])
