"""The space a method scores in: a fitted preconditioner applied on the query side or on both sides.

Every score gradstore computes goes through :class:`ScoringSpace`: top-k search (exact or FAISS), dense
score matrices, TracIn sums, self-influence and LESS selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradstore.errors import InvalidArgumentError
from gradstore.preconditioning import Preconditioning
from indexers import Preconditioner
from indexers.identity import unit_rows

SCORE_ROWS = 8192
"""Stored rows :meth:`ScoringSpace.scores` converts to the prepared queries' dtype at a time."""


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

    def queries(self, queries: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Raw query vectors ``[q, dim]`` in the space the stored rows are searched in (``dtype``: float32 for the
        search kernels, float64 for :meth:`scores` exact to float64 rounding)."""
        raw = as_float32(queries).to(dtype)
        prepared = self.preconditioner.apply_query(raw).to(dtype) if self.method.query_only else self._both(raw)
        if dtype == torch.float32:
            self._check_float32(raw, prepared)
        return prepared

    def _check_float32(self, raw: torch.Tensor, prepared: torch.Tensor) -> None:
        """Refuse float32 prepared queries that left float32's range: an overflow, or a nonzero query prepared to
        below float32's smallest normal number where its float64 preparation is not zero (silent zero scores
        otherwise). The error names the cause: the queries' own scale where the same queries scaled to a largest
        entry of 1 prepare within range (every method's ranking is unchanged by scaling a query), else the stored
        rows' norms (and the damping), which make ``P^-1 q`` so."""
        tiny, huge = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
        vanished = (prepared.abs().amax(dim=1) < tiny) & (raw.abs().amax(dim=1) > 0)
        if vanished.any():
            exact = self.queries(raw[vanished].to(torch.float64), torch.float64)
            vanished[vanished.clone()] = exact.abs().amax(dim=1) > 0
        bad = vanished | ~torch.isfinite(prepared).all(dim=1)
        if not bad.any():
            return
        queries = raw[bad].to(torch.float64)
        largest = queries.abs().amax(dim=1, keepdim=True)
        unit = self.queries(queries / largest, torch.float64).abs().amax(dim=1)
        if bool(((unit >= tiny) & (unit <= huge)).all()):
            positions = torch.nonzero(bad).flatten().tolist()
            shown = ", ".join(f"{value:.3g}" for value in largest.flatten().tolist()[:5])
            raise InvalidArgumentError(
                f"method {self.method.name!r}: query vector(s) {positions[:10]} are too "
                f"{'small' if bool(vanished.any()) else 'large'} for float32 (largest entries {shown}): prepared, "
                "they leave float32's range, so a float32 search would rank on zeros or infinities. Rescale these "
                "queries (e.g. divide each by its largest entry: the ranking is the same, the scores scale by it), "
                "or use score_matrix (float64)"
            )
        damping = getattr(self.preconditioner, "damping", None)
        cause = "the stored rows' norms" + ("" if damping is None else f" or the damping ({damping:g})")
        raise InvalidArgumentError(
            f"method {self.method.name!r}: preconditioned queries leave float32's range ({cause} are extreme), "
            "so a float32 search would rank on infinities or zeros; use score_matrix (float64), "
            + ("" if damping is None else "a damping nearer 1 (relative to the mean eigenvalue), ")
            + "or store the rows rescaled to norms nearer 1"
        )

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows in the searched space (unchanged for query-side preconditioning; float64 stays float64)."""
        return rows if self.method.query_only else self._both(rows)

    def balanced(self, vectors: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Queries and rows alike in one space whose inner product is the score: ``P^-1/2 v`` (unit-normalised
        for ``unit_norm`` methods), float32, so ``score(q, g) = balanced(q) . balanced(g)`` for every method.

        Approximate first stages search here: for query-side methods the rows as stored are anisotropic while
        ``P^-1 q`` weights their low-variance directions most, so graphs, partitions and quantizers built over
        the stored rows spend their resolution where the score does not look (``docs/scale.md``)."""
        return self._both(as_float32(vectors))

    def _both(self, vectors: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 v``, unit-normalised for ``unit_norm`` methods (zero vectors stay zero), float64 for float64
        ``vectors``, else float32."""
        dtype = torch.float64 if vectors.dtype == torch.float64 else torch.float32
        whitened = self.preconditioner.apply_both(vectors).to(dtype)
        if not self.method.unit_norm:
            return whitened
        return unit_rows(whitened)

    def whitened(self, rows: torch.Tensor) -> torch.Tensor:
        """``P^-1/2 rows`` in float64 (self-influence is its squared norm; LESS takes cosines of it)."""
        return self.preconditioner.apply_both(rows.to(torch.float64))

    def self_influence(self, rows: torch.Tensor) -> torch.Tensor:
        """``g^T P^-1 g`` per row, float64."""
        whitened = self.whitened(rows)
        return (whitened * whitened).sum(dim=1)

    def scores(self, prepared_queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Dense ``[q, rows]`` scores of prepared queries against raw stored rows, float32 from float64 prepared
        queries (:meth:`queries` with ``torch.float64``), computed in float64 :data:`SCORE_ROWS` rows at a time.

        Float64 is what makes them exact: a low-rank Fisher's ``P^-1 q`` is ``(1/lambda)`` times the part of ``q``
        outside the fitted rows' span plus a part inside it that is smaller by about the relative damping, and only
        the latter reaches rows in the span; rounding ``P^-1 q`` to float32 errs by ``2^-24 / damping`` of the score
        (0.2 at damping ``1e-6``)."""
        dtype = prepared_queries.dtype
        parts = [prepared_queries @ self.rows(chunk.to(dtype)).T for chunk in rows.split(SCORE_ROWS)]
        return torch.cat(parts, dim=1).to(torch.float32)
