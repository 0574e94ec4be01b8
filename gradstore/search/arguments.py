"""Checks of the arguments a search takes, shared by :meth:`~gradstore.search.index.AttributionIndex.search` and the
scoring calls above it (``attribute`` and the others re-export them through :mod:`gradstore.methods`): every
refusal an :class:`~gradstore.errors.InvalidArgumentError` (or the error of the data it names) saying what to pass.
"""

from __future__ import annotations

import numpy as np
import torch

from gradstore.errors import InvalidArgumentError, NonFiniteGradientError, SchemaMismatchError


def _whole(value: object) -> bool:
    """A whole number: a Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_count(name: str, value: int) -> int:
    """``value`` of argument ``name`` if it is a whole number >= 1."""
    if not _whole(value) or value < 1:
        raise InvalidArgumentError(f"{name} must be a whole number >= 1, got {value!r}")
    return int(value)


def check_k(k: int) -> int:
    """``k`` if it is a whole number >= 1."""
    return check_count("k", k)


def check_rerank(rerank: int, kind: str) -> int:
    """``rerank`` if it is a whole number >= 0 (0: off), and 0 unless ``kind`` is a FAISS index whose candidates
    it re-scores."""
    if not _whole(rerank) or rerank < 0:
        raise InvalidArgumentError(f"rerank must be a whole number >= 0 (0: off), got {rerank!r}")
    if rerank and kind == "exact":
        raise InvalidArgumentError(
            "rerank re-scores a FAISS index's candidates exactly; kind='exact' is exact already: "
            "drop rerank, or pass a FAISS kind such as kind='HNSW32,Flat'"
        )
    return int(rerank)


def query_array(queries: np.ndarray | torch.Tensor) -> np.ndarray:
    """Query vectors given as a real numeric array or tensor ``[q, dim]`` (one vector ``[dim]``: one query) as
    float32 ``[q, dim]``; anything else (complex values too) is an :class:`~gradstore.errors.InvalidArgumentError`
    saying what to pass."""
    if isinstance(queries, torch.Tensor):
        queries = queries.detach().cpu().numpy()
    if not isinstance(queries, np.ndarray) or not np.issubdtype(queries.dtype, np.number):
        shown = f"an array of {queries.dtype}" if isinstance(queries, np.ndarray) else type(queries).__name__
        raise InvalidArgumentError(
            f"query vectors must be a numeric numpy array or torch tensor [queries, dim], got {shown}: "
            "pass np.asarray(vectors, np.float32)"
        )
    if np.issubdtype(queries.dtype, np.complexfloating):
        raise InvalidArgumentError(
            f"query vectors must be real, got an array of {queries.dtype} (gradients are real; the imaginary part "
            "would be dropped): pass the real vectors, e.g. vectors.real"
        )
    vectors = np.asarray(queries, np.float32)
    vectors = vectors[None] if vectors.ndim == 1 else vectors
    if vectors.ndim != 2:
        raise InvalidArgumentError(f"query vectors must be [queries, dim], got shape {tuple(queries.shape)}")
    return vectors


def check_query_vectors(vectors: np.ndarray, dim: int, rows: str) -> np.ndarray:
    """``vectors [q, dim]`` if they have the ``dim`` of the training rows they are scored against (``rows``: those
    rows in words, e.g. ``"run 'r'"``) and are finite."""
    if vectors.shape[1] != dim:
        raise SchemaMismatchError(
            f"query vectors have {vectors.shape[1]} dims; {rows} has {dim}: pass queries of the same projection"
        )
    if not np.isfinite(vectors).all():
        raise NonFiniteGradientError("query vectors contain NaN/Inf: score finite queries only")
    return vectors
