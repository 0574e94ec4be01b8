"""Building preconditioners by name and loading saved ones (the protocol they share: :mod:`indexers.preconditioner`).

Names: ``identity``, ``cosine``, ``diagonal``, ``fisher``, ``kfac``. For ``diagonal``, ``fisher`` and
``kfac`` the damping is relative: ``damping * mean eigenvalue`` (per block or layer) is added to the
eigenvalues before inverting, so the same default (0.1) suits gradients of any scale.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from indexers.diagonal import DiagonalPreconditioner
from indexers.fisher import FisherPreconditioner
from indexers.identity import CosinePreconditioner, IdentityPreconditioner
from indexers.kfac import KroneckerFactors, KroneckerLayout, KroneckerPreconditioner
from indexers.preconditioner import Preconditioner, read_config

PRECONDITIONERS: dict[str, type] = {
    cls.name: cls
    for cls in (
        IdentityPreconditioner,
        CosinePreconditioner,
        DiagonalPreconditioner,
        FisherPreconditioner,
        KroneckerPreconditioner,
    )
}

#: The preconditioners this package defines (the others in :data:`PRECONDITIONERS` were registered).
BUILT_IN = frozenset(PRECONDITIONERS)

__all__ = [
    "BUILT_IN",
    "PRECONDITIONERS",
    "CosinePreconditioner",
    "DiagonalPreconditioner",
    "FisherPreconditioner",
    "IdentityPreconditioner",
    "KroneckerPreconditioner",
    "Preconditioner",
    "load_preconditioner",
    "make_preconditioner",
    "register_preconditioner",
]

#: What a preconditioner class offers (:class:`~indexers.preconditioner.Preconditioner`, plus ``load``).
REQUIRED_MEMBERS = ("name", "passes", "fit", "statistics", "finish", "apply_query", "apply_both", "save", "load")


def register_preconditioner(cls: type) -> type:
    """Make ``cls`` buildable by :func:`make_preconditioner` and loadable by :func:`load_preconditioner` under
    ``cls.name``. It must offer :data:`REQUIRED_MEMBERS` and take ``damping=`` (a float, relative or absolute as
    it documents). ``ValueError`` when a member is missing or the name is taken by another class."""
    missing = [member for member in REQUIRED_MEMBERS if not hasattr(cls, member)]
    if missing:
        raise ValueError(f"preconditioner class {cls.__name__} lacks {missing} (see indexers.preconditioner)")
    name = cls.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"preconditioner class {cls.__name__} needs a non-empty string name")
    if PRECONDITIONERS.get(name, cls) is not cls:
        raise ValueError(f"a preconditioner named {name!r} exists ({PRECONDITIONERS[name].__name__}): choose another")
    PRECONDITIONERS[name] = cls
    return cls


def make_preconditioner(
    name: str,
    *,
    damping: float = 0.1,
    blocks: Sequence[tuple[int, int]] | None = None,
    kronecker_layout: KroneckerLayout | None = None,
    kronecker_factors: KroneckerFactors | None = None,
    eigen_correction: bool = False,
    kronecker_factor_count: int | None = None,
) -> Preconditioner:
    """An unfitted preconditioner by name (call ``fit`` on gradient blocks before applying it).

    ``blocks`` ((offset, size) per layer block) applies to ``fisher``; ``kronecker_layout``,
    ``kronecker_factors`` (with ``kronecker_factor_count``, what they are means over, recorded in the saved fit)
    and ``eigen_correction`` apply to ``kfac``; ``damping`` to all but
    ``identity``/``cosine``. Arguments that do not apply to ``name`` are refused."""
    if name not in PRECONDITIONERS:
        raise ValueError(f"unknown preconditioner {name!r}; choose one of {sorted(PRECONDITIONERS)}")
    if blocks is not None and name != "fisher":
        raise ValueError(f"blocks apply to the 'fisher' preconditioner, not {name!r}")
    kronecker = (kronecker_layout, kronecker_factors, kronecker_factor_count)
    if (any(value is not None for value in kronecker) or eigen_correction) and name != "kfac":
        raise ValueError(f"kronecker_* and eigen_correction apply to the 'kfac' preconditioner, not {name!r}")
    if name in ("identity", "cosine"):
        return PRECONDITIONERS[name]()
    if name not in BUILT_IN:
        return PRECONDITIONERS[name](damping=damping)  # a registered one (register_preconditioner)
    if name == "diagonal":
        return DiagonalPreconditioner(damping=damping)
    if name == "fisher":
        return FisherPreconditioner(damping=damping, blocks=blocks)
    if kronecker_layout is None:
        raise ValueError("the 'kfac' preconditioner needs kronecker_layout=[(layer_name, offset, k_in, k_out), ...]")
    return KroneckerPreconditioner(
        kronecker_layout,
        kronecker_factors,
        damping=damping,
        eigen_correction=eigen_correction,
        factor_count=kronecker_factor_count,
    )


def load_preconditioner(path: str | os.PathLike) -> Preconditioner:
    """Load a preconditioner saved with ``save``, whichever kind it is."""
    name = read_config(path).get("name")
    if name not in PRECONDITIONERS:
        raise ValueError(f"{path} holds an unknown preconditioner {name!r}")
    return PRECONDITIONERS[name].load(path)
