"""Numpy references for exact search (tests/search): full score matrices in float64, and integer data whose float32
sums are exact."""

from __future__ import annotations

import numpy as np


def brute_force(queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int, largest: bool = True):
    """Reference: full score matrix in float64, sorted by (score best first, id ascending)."""
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T
    keys = -scores if largest else scores
    order = np.stack([np.lexsort((ids, row)) for row in keys])[:, :k]
    return np.take_along_axis(scores, order, 1), ids[order]


def integer_data(seed: int, n: int, d: int, q: int):
    """Small integers: float32 sums are exact and ties are frequent, so results must match bit for bit."""
    rng = np.random.default_rng(seed)
    vectors = rng.integers(-2, 3, (n, d)).astype(np.float32)
    queries = rng.integers(-2, 3, (q, d)).astype(np.float32)
    return queries, vectors, rng.permutation(10 * n)[:n].astype(np.int64)
