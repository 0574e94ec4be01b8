"""Attribution methods: which preconditioner each uses, and on which side it is applied.

| method       | score of training row g for query q              | preconditioner                          |
|--------------|--------------------------------------------------|-----------------------------------------|
| ``grad-dot`` | ``q . g``                                        | identity                                |
| ``cosine``   | ``q . g / (|q| |g|)``                            | cosine (both sides)                     |
| ``diagonal`` | ``q^T (D + damping)^-1 g``                       | diagonal second moment                  |
| ``fisher``   | ``q^T (G^T G / n + damping * mean_eig * I)^-1 g`` | projected empirical Fisher, per layer   |
| ``kfac``     | ``q^T (S (x) A + damping * mean_eig * I)^-1 g``  | Kronecker factors (``curvature=True``)  |
| ``tracin``   | ``sum_c lr_c * q_c . g_c`` over checkpoints      | identity per checkpoint                 |

``influence`` is an alias of ``fisher``. Damping is relative to the mean eigenvalue (default 0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

#: A Fisher block of at most this many dims is kept full; larger vectors get one block per layer.
FULL_FISHER_MAX_DIM = 2048
DEFAULT_DAMPING = 0.1


@dataclass(frozen=True)
class Method:
    """How a method scores: its preconditioner and whether it is applied to the query only."""

    name: str
    preconditioner: str
    query_only: bool  # True: score = (P^-1 q) . g ; False: score = (P^-1/2 q) . (P^-1/2 g)
    damped: bool


METHODS = {
    "grad-dot": Method("grad-dot", "identity", True, False),
    "cosine": Method("cosine", "cosine", False, False),
    "diagonal": Method("diagonal", "diagonal", True, True),
    "fisher": Method("fisher", "fisher", True, True),
    "kfac": Method("kfac", "kfac", True, True),
    "tracin": Method("tracin", "identity", True, False),
}
ALIASES = {"influence": "fisher", "graddot": "grad-dot", "grad_dot": "grad-dot", "tracin-cp": "tracin",
           "ekfac": "kfac"}


def resolve_method(name: str) -> Method:
    """The :class:`Method` called ``name`` (or an alias); ``ValueError`` naming the choices otherwise."""
    key = ALIASES.get(name, name)
    if key not in METHODS:
        raise ValueError(f"unknown attribution method {name!r}; choose one of {sorted(METHODS)} "
                         f"(aliases: {sorted(ALIASES)})")
    return METHODS[key]
