"""Preconditioners without statistics: identity (grad-dot, TracIn) and cosine (unit-normalized)."""

from __future__ import annotations

import math
import os

import torch

from indexers.blocks import Rows
from indexers.preconditioner import FitStatistics, apply_rows, load_state, save_state


class IdentityPreconditioner:
    """``P = I``: scores are raw inner products of gradients (grad-dot, TracIn)."""

    name = "identity"
    passes = 0

    def fit(self, blocks: Rows) -> IdentityPreconditioner:
        """Nothing to fit; the blocks are not read."""
        return self

    def statistics(self, blocks: Rows, stage: int = 0) -> FitStatistics:
        """No statistics (there are no passes)."""
        return FitStatistics()

    def finish(self, statistics: FitStatistics, stage: int = 0) -> IdentityPreconditioner:
        """Nothing to fold in."""
        return self

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` unchanged (in the compute dtype)."""
        return apply_rows(q, lambda rows: rows)

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` unchanged (in the compute dtype)."""
        return apply_rows(x, lambda rows: rows)

    def save(self, path: str | os.PathLike) -> None:
        """Write the (empty) state so that :func:`load_preconditioner` can restore it."""
        save_state(path, {"name": self.name}, {})

    @classmethod
    def load(cls, path: str | os.PathLike) -> IdentityPreconditioner:
        """Read a saved identity preconditioner."""
        load_state(path, cls.name)
        return cls()


class CosinePreconditioner(IdentityPreconditioner):
    """Unit-normalizes every vector, so that inner products on both sides are cosine similarities.

    ``apply_query`` normalizes the query only (ranking by ``q_hat . g``); use ``apply_both`` on queries and
    stored vectors for true cosine. Zero vectors stay zero."""

    name = "cosine"

    def apply_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q / |q|`` row by row."""
        return apply_rows(q, unit_rows)

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``x / |x|`` row by row."""
        return apply_rows(x, unit_rows)


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows / |rows|`` row by row, exact at any norm the dtype holds (zero rows stay zero): each row is divided
    by its largest magnitude first, so its squared norm neither overflows (entries ~1e20 in float32) nor
    underflows (~1e-20), where a plain norm made such rows' cosines 0 or tiny. Outside autograd one tensor the
    size of ``rows`` is allocated (the result), as a plain division would."""
    if rows.shape[1] == 0:
        return rows.clone()
    peak = torch.linalg.vector_norm(rows, ord=math.inf, dim=1, keepdim=True)  # no |rows| temporary
    out = rows / torch.where(peak > 0, peak, torch.ones_like(peak))
    norms = torch.linalg.vector_norm(out, dim=1, keepdim=True)
    norms = torch.where(norms > 0, norms, torch.ones_like(norms))
    return out / norms if out.requires_grad else out.div_(norms)  # in place unless autograd needs ``out``
