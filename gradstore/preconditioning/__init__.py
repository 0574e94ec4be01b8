"""Preconditioning: how a method over one checkpoint's rows scores, below search and the methods.

:class:`Preconditioning` says which preconditioner a method fits over the stored rows and on which sides it
applies it; :mod:`gradstore.preconditioning.fitting` fits and caches the preconditioners (:class:`FitCache`) and
:mod:`gradstore.preconditioning.scoring` scores in the space one defines (:class:`ScoringSpace`). Search
(:mod:`gradstore.search`) takes a :class:`Preconditioning`; the methods (:mod:`gradstore.methods`, above search)
are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from gradstore.errors import InvalidArgumentError
from ingest.curvature import TRUE_FISHER_SPLIT as _TRUE_FISHER_SPLIT

BlockStructure = Literal["auto", "layer", "full"]
"""Fisher blocks: one per layer, one full ``dim x dim`` block, or ``auto`` (per layer for runs captured with a
projection spec, full for runs written without layers: :func:`gradstore.preconditioning.fitting.auto_blocks`)."""

DEFAULT_DAMPING = 0.1
#: The preconditioner whose fit has blocks (:attr:`Preconditioning.blocked`) and the one over Kronecker factors.
BLOCKED_PRECONDITIONER = "fisher"
KRONECKER_PRECONDITIONER = "kfac"
#: The split of curvature rows: gradients of losses on labels sampled from the model's own predictive
#: distribution (true Fisher / GGN). Never scored or used as training rows; fits use them where present.
TRUE_FISHER_SPLIT = _TRUE_FISHER_SPLIT


@dataclass(frozen=True)
class Preconditioning:
    """How a method scores one checkpoint's rows: ``preconditioner`` (a name of :data:`indexers.PRECONDITIONERS`)
    fitted over them, applied on the query side (``query_only``: ``(P^-1 q) . g``) or on both sides
    (``(P^-1/2 q) . (P^-1/2 g)``, unit-normalised after for ``unit_norm``: a cosine in that space)."""

    name: str
    preconditioner: str
    query_only: bool
    damped: bool  # takes damping= (relative to the mean eigenvalue)
    unit_norm: bool = False
    eigen_correction: bool = False  # kfac: eigenvalues refitted on the rows (EK-FAC)
    true_fisher: bool = False  # fitted on true-Fisher rows where a checkpoint has them

    @property
    def blocked(self) -> bool:
        """Whether its fit has a block structure (``blocks=``: the projected Fisher, per layer or full)."""
        return self.preconditioner == BLOCKED_PRECONDITIONER

    @property
    def kronecker(self) -> bool:
        """Whether its fit takes the run's Kronecker factors (K-FAC, EK-FAC)."""
        return self.preconditioner == KRONECKER_PRECONDITIONER


#: The raw gradient inner product ``q . g``: what sums over checkpoints, steps and embeddings score with.
GRAD_DOT = Preconditioning("grad-dot", "identity", query_only=True, damped=False)


def check_blocks(blocks: str) -> str:
    """``blocks`` if it is a :data:`BlockStructure`."""
    if blocks not in get_args(BlockStructure):
        raise InvalidArgumentError(f"blocks must be one of {get_args(BlockStructure)}, got {blocks!r}")
    return blocks
