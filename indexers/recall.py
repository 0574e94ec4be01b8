"""Recall of approximate search against exact search, and the rule choosing exact vs FAISS ANN.

Rule (:func:`choose_index_kind`): exact search when its estimated latency for a batch of queries,
``2 * n_rows * dim * n_queries / EXACT_FLOPS_PER_S``, fits the time budget (1 s by default); beyond it an
HNSW graph over ``SQfp16`` rows (``HNSW32,SQfp16``) when the rows and the graph fit the memory budget (8 GiB by
default): on real captured gradients the graph holds the inner-product neighbours (recall@10 0.99 at 0.13-0.18
of the exact scan, ``bench/ann_recall.py``) where IVF partitions find about a fifth of them (``docs/scale.md``).
Beyond the memory budget an IVF index with ``PQ`` codes of ``dim / 16`` bytes (``nlist`` = the power of two
nearest ``4 * sqrt(n_rows)``, at most ``n_rows / 39`` so k-means has 39 training points per list): the only
kind that fits, whose measured recall the index build reports.
"""

from __future__ import annotations

import math

import numpy as np

from indexers.blocks import ArrayLike, VectorBlocks
from indexers.exact import ExactIndex
from indexers.faiss_index import FaissIndex

EXACT_FLOPS_PER_S = 1e11
"""Sustained float32 matmul throughput assumed for exact search (measured: 2-core CPU, bench/query.py)."""
MIN_POINTS_PER_LIST = 39
HNSW_LINKS = 32


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    """Mean over queries of ``|approx & exact| / |exact|`` for ``[q, k]`` ids (``-1`` never matches)."""
    approx_ids, exact_ids = np.atleast_2d(approx_ids), np.atleast_2d(exact_ids)
    if len(approx_ids) != len(exact_ids):
        raise ValueError(f"got {len(approx_ids)} approximate and {len(exact_ids)} exact result rows")
    if exact_ids.size == 0:
        return 1.0
    hits = [len(np.intersect1d(a[a >= 0], e)) / len(e) for a, e in zip(approx_ids, exact_ids, strict=True)]
    return float(np.mean(hits))


def measure_recall(
    index: FaissIndex, queries: ArrayLike, source: VectorBlocks, k: int = 10, exact: ExactIndex | None = None
) -> float:
    """recall@k of an inner-product FAISS index against exact search over the same source."""
    if index.metric != "ip":
        raise ValueError("recall is measured against exact inner-product search; the index metric is not 'ip'")
    _, exact_ids = (exact or ExactIndex()).search(queries, source, k)
    _, approx_ids = index.search(queries, k)
    return recall_at_k(approx_ids, exact_ids)


def ivf_nlist(n_rows: int) -> int:
    """The power of two nearest ``4 * sqrt(n_rows)``, lowered until each list has 39 training points."""
    nlist = 2 ** max(0, round(math.log2(max(1.0, 4 * math.sqrt(n_rows)))))
    while nlist > 1 and nlist * MIN_POINTS_PER_LIST > n_rows:
        nlist //= 2
    return nlist


def choose_index_kind(
    n_rows: int,
    dim: int,
    n_queries: int = 64,
    time_budget_s: float = 1.0,
    memory_budget_bytes: int = 8 * 2**30,
    flops_per_s: float = EXACT_FLOPS_PER_S,
) -> str:
    """``"exact"`` or a FAISS factory string for a store of ``n_rows x dim`` vectors (see the module rule)."""
    if 2.0 * n_rows * dim * n_queries / flops_per_s <= time_budget_s:
        return "exact"
    if n_rows * (dim * 2 + HNSW_LINKS * 2 * 4) <= memory_budget_bytes:  # fp16 rows + links of layer 0
        return f"HNSW{HNSW_LINKS},SQfp16"
    code_bytes = max(d for d in range(1, max(1, dim // 16) + 1) if dim % d == 0)
    return f"IVF{ivf_nlist(n_rows)},PQ{code_bytes}"
