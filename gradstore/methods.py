"""Attribution methods: which preconditioner each uses, and on which side it is applied.

| method       | score of training row g for query q                | preconditioner                          |
|--------------|----------------------------------------------------|-----------------------------------------|
| ``grad-dot`` | ``q . g``                                          | identity                                |
| ``cosine``   | ``q . g / (|q| |g|)``                              | cosine (both sides)                     |
| ``diagonal`` | ``q^T (D + damping)^-1 g``                         | diagonal second moment                  |
| ``fisher``   | ``q^T (G^T G / n + damping * mean_eig * I)^-1 g``  | projected empirical Fisher (blocks)     |
| ``kfac``     | ``q^T (S (x) A + damping * mean_eig * I)^-1 g``    | Kronecker factors (``curvature=True``)  |
| ``ekfac``    | as ``kfac`` with eigenvalues refitted on the rows  | eigen-corrected Kronecker factors       |
| ``tracin``   | ``sum_c lr_c * q_c . g_c`` over checkpoints        | identity per checkpoint                 |
| ``trackstar``| ``cos(F^-1/2 q, F^-1/2 g)``                        | projected empirical Fisher, unit norm   |

``influence`` is an alias of ``fisher``. Damping is relative to the mean eigenvalue (default 0.1).
``trackstar`` (TrackStar, Chang et al. 2024) is meant for rows captured with ``normalizer="adam_factored"``
(optimizer-aware: Adam second-moment normalisation): both sides are whitened by the Fisher of the stored rows
and unit-normalised, so the score is a cosine in the whitened space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from gradstore.errors import InvalidArgumentError

MethodName = Literal["grad-dot", "cosine", "diagonal", "fisher", "kfac", "ekfac", "tracin", "trackstar", "influence"]
"""Names :func:`resolve_method` accepts (``influence`` is ``fisher``)."""
BlockStructure = Literal["auto", "layer", "full"]
"""Fisher blocks: one per layer, one full ``dim x dim`` block, or ``auto`` (full up to
:data:`FULL_FISHER_MAX_DIM` dims, per layer above)."""

#: ``blocks="auto"`` keeps a Fisher block full up to this many dims; larger vectors get one block per layer.
FULL_FISHER_MAX_DIM = 2048
DEFAULT_DAMPING = 0.1


@dataclass(frozen=True)
class Method:
    """How a method scores: its preconditioner and whether it is applied to the query only."""

    name: str
    preconditioner: str
    query_only: bool  # True: score = (P^-1 q) . g ; False: score = (P^-1/2 q) . (P^-1/2 g)
    damped: bool
    eigen_correction: bool = False
    over_checkpoints: bool = False  # a learning-rate weighted sum over checkpoints (TracIn)
    unit_norm: bool = False  # both sides unit-normalised after preconditioning (a cosine in that space)


METHODS = {
    "grad-dot": Method("grad-dot", "identity", True, False),
    "cosine": Method("cosine", "cosine", False, False),
    "diagonal": Method("diagonal", "diagonal", True, True),
    "fisher": Method("fisher", "fisher", True, True),
    "kfac": Method("kfac", "kfac", True, True),
    "ekfac": Method("ekfac", "kfac", True, True, eigen_correction=True),
    "tracin": Method("tracin", "identity", True, False, over_checkpoints=True),
    "trackstar": Method("trackstar", "fisher", False, True, unit_norm=True),
}
ALIASES = {"influence": "fisher", "graddot": "grad-dot", "grad_dot": "grad-dot", "tracin-cp": "tracin"}


def resolve_method(name: str) -> Method:
    """The :class:`Method` called ``name`` (or an alias); ``InvalidArgumentError`` naming the choices otherwise."""
    key = ALIASES.get(name, name)
    if key not in METHODS:
        raise InvalidArgumentError(
            f"unknown attribution method {name!r}; choose one of {sorted(METHODS)} (aliases: {sorted(ALIASES)})"
        )
    return METHODS[key]


def check_blocks(blocks: str) -> str:
    """``blocks`` if it is a :data:`BlockStructure`."""
    if blocks not in get_args(BlockStructure):
        raise InvalidArgumentError(f"blocks must be one of {get_args(BlockStructure)}, got {blocks!r}")
    return blocks


def check_k(k: int) -> int:
    """``k`` if it is a whole number >= 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidArgumentError(f"k must be a whole number >= 1, got {k!r}")
    return k
