"""Preconditioners without statistics: identity (grad-dot, TracIn) and cosine (unit-normalized)."""

from __future__ import annotations

import os

import torch

from indexers.blocks import Rows
from indexers.preconditioner import FitStatistics, apply_rows, load_state, save_state

COSINE_EPS = 1e-12


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
        return apply_rows(q, _unit_rows)

    def apply_both(self, x: torch.Tensor) -> torch.Tensor:
        """``x / |x|`` row by row."""
        return apply_rows(x, _unit_rows)


def _unit_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.norm(dim=1, keepdim=True).clamp_min(COSINE_EPS)
