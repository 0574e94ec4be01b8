"""The space a method scores in: a fitted preconditioner applied on the query side or on both sides.

Every score gradstore computes goes through :class:`ScoringSpace`: top-k search (exact or FAISS), dense
score matrices, TracIn sums, self-influence and LESS selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradstore.preconditioning import Preconditioning
from indexers import Preconditioner


def as_float32(vectors: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``vectors`` (a numpy array or a tensor) as a float32 tensor (shared with a float32 array's memory)."""
    if isinstance(vectors, np.ndarray):
        return torch.as_tensor(np.asarray(vectors, dtype=np.float32))
    return vectors.to(torch.float32)


@dataclass
class ScoringSpace:
    """``score(q, g) = queries(q) . rows(g)`` for one method and its fitted preconditioner."""

    method: Preconditioning
    preconditioner: Preconditioner

    def queries(self, queries: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Raw query vectors ``[q, dim]`` in the space the stored rows are searched in (float32)."""
        raw = as_float32(queries)
        if self.method.query_only:
            return self.preconditioner.apply_query(raw).to(torch.float32)
        return self._both(raw)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows in the searched space (unchanged for query-side preconditioning)."""
        return rows if self.method.query_only else self._both(rows)

    def balanced(self, vectors: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Queries and rows alike in one space whose inner product is the score: ``P^-1/2 v`` (unit-normalised
        for ``unit_norm`` methods), float32, so ``score(q, g) = balanced(q) . balanced(g)`` for every method.

        Approximate first stages search here: for query-side methods the rows as stored are anisotropic while
        ``P^-1 q`` weights their low-variance directions most, so graphs, partitions and quantizers built over
        the stored rows spend their resolution where the score does not look (``docs/scale.md``)."""
        return self._both(as_float32(vectors))

    def _both(self, vectors: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 v``, unit-normalised for ``unit_norm`` methods (zero vectors stay zero), float32."""
        whitened = self.preconditioner.apply_both(vectors).to(torch.float32)
        if not self.method.unit_norm:
            return whitened
        return whitened / whitened.norm(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)

    def whitened(self, rows: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 rows`` in float64 (self-influence is its squared norm; LESS takes cosines of it)."""
        return self.preconditioner.apply_both(rows.to(torch.float64))

    def self_influence(self, rows: torch.Tensor) -> torch.Tensor:
        """``g^T P^-1 g`` per row, float64."""
        whitened = self.whitened(rows)
        return (whitened * whitened).sum(dim=1)

    def scores(self, prepared_queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Dense ``[q, rows]`` scores of prepared queries against raw stored rows."""
        return prepared_queries @ self.rows(rows).T
