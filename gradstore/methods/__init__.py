"""The method registry: every attribution method, what it computes, which arguments it uses and what its rows need.

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
| ``tracin-steps`` | ``sum_t lr_t s_t / B_t * q . g_t`` over recorded training steps | identity per step     |
| ``source``   | ``sum_l q^T (prod_{l'>l} E_l') (I - E_l) F_l^-1 g_l``, ``E_l = exp(-lr_l K_l F_l)`` | Fisher/segment |
| ``source-ekfac`` | as ``source`` with ``F_l`` the checkpoint's EK-FAC                 | EK-FAC per segment   |
| ``dvemb``    | ``q . e_z``, ``e_z = sum_t lr_t / B_t prod_{s>t} (I - lr_s H_s) g_t``  | batch curvature per step |

``influence`` is an alias of ``fisher``. Damping is relative to the mean eigenvalue (default 0.1).
``kfac``/``ekfac`` use the factors a capture with ``curvature=True`` recorded (:data:`KRONECKER_FACTORS`); rows
captured without it get factors estimated from the rows themselves (:func:`gradstore.methods.fitting.kronecker_source`).
``trackstar`` (TrackStar, Chang et al. 2024) is meant for rows captured with ``normalizer="adam_factored"``
(optimizer-aware: Adam second-moment normalisation): both sides are whitened by the Fisher of the stored rows
and unit-normalised, so the score is a cosine in the whitened space.

The trajectory methods (:mod:`gradstore.methods.trajectory`, :mod:`gradstore.methods.dvemb`) use the store's training
history:
``tracin-steps`` and ``dvemb`` the rows captured *during training* (one checkpoint label, many steps: ``s_t``
optimizer steps stand for each recorded one, ``B_t`` rows per step), ``source`` the checkpoint passes (segments
of ``K_l`` steps at mean learning rate ``lr_l``). Curvature comes from rows of split ``"true-fisher"`` (labels
sampled from the model, :data:`TRUE_FISHER_SPLIT`) where a checkpoint (or step) has them, else from the
training rows (the empirical Fisher); ``fisher``, ``kfac`` and ``ekfac`` fit on true-Fisher rows the same way
(``kfac``/``ekfac``: the Kronecker factors captured on those rows, for the eigenbasis and the eigenvalues alike).

:data:`METHODS` is the one table the API, the CLI's choices and the docs' methods table come from: each
:class:`Method` says which optional arguments it uses (:attr:`Method.uses`), which calls accept it
(:attr:`Method.operations`) and what its rows must have (:attr:`Method.requires`). :func:`check_arguments`
turns an argument the chosen method does not use into an ``InvalidArgumentError`` naming both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from gradstore.errors import InvalidArgumentError
from ingest.curvature import TRUE_FISHER_SPLIT as _TRUE_FISHER_SPLIT

MethodName = Literal[
    "grad-dot",
    "cosine",
    "diagonal",
    "fisher",
    "kfac",
    "ekfac",
    "tracin",
    "trackstar",
    "tracin-steps",
    "source",
    "source-ekfac",
    "dvemb",
    "influence",
]
"""Names :func:`resolve_method` accepts (``influence`` is ``fisher``)."""
BlockStructure = Literal["auto", "layer", "full"]
"""Fisher blocks: one per layer, one full ``dim x dim`` block, or ``auto`` (per layer for runs captured with a
projection spec, full for runs written without layers: :func:`gradstore.methods.fitting.auto_blocks`)."""
Operation = Literal["attribute", "score_matrix", "self_influence", "select", "build_index", "token_scores"]
"""The calls that take a ``method``."""

DEFAULT_DAMPING = 0.1
#: The split of curvature rows: gradients of losses on labels sampled from the model's own predictive
#: distribution (true Fisher / GGN). Never scored or used as training rows; fits use them where present.
TRUE_FISHER_SPLIT = _TRUE_FISHER_SPLIT
#: The method every scoring call uses when given none (the best single-checkpoint answer on the demo's facts).
DEFAULT_METHOD = "fisher"

#: Optional arguments a method may or may not use, with what each is for (the words of the error messages).
OPTIONAL_ARGUMENTS = {
    "damping": "the damping of a curvature-preconditioned method",
    "blocks": "the Fisher block structure",
    "checkpoints": "the checkpoints TracIn sums over (source: the checkpoints ending its segments)",
    "checkpoint": "the one checkpoint whose training rows are scored (tracin-steps, dvemb: the in-loop rows' label)",
    "kind": "the top-k index over one checkpoint's rows",
    "rerank": "the exact second stage of a FAISS index",
    "query_checkpoint": "the checkpoint of stored query rows scored against one checkpoint's training rows",
    "device": "where the exact top-k search runs",
}
#: What ``kfac`` and ``ekfac`` need (their registry rows' "needs"; :func:`gradstore.methods.fitting.kronecker_source`).
KRONECKER_FACTORS = (
    "Kronecker-structured (factorized or exact) rows, captured with curvature=True for the recorded factors; "
    "without them the factors are estimated from the rows (A = E[G^T G], S = E[G G^T] / E[|G|^2])"
)
_ALL_OPERATIONS = frozenset(get_args(Operation))
_ONE_CHECKPOINT = frozenset({"checkpoint", "kind", "rerank", "query_checkpoint", "device"})
#: Optional arguments a call uses whatever its method (``select`` sums over its own ``checkpoints``).
_OWN_ARGUMENTS = {"select": frozenset({"checkpoints"})}


@dataclass(frozen=True)
class Method:
    """One attribution method: how it scores, which arguments it uses, which calls take it, what it needs."""

    name: str
    preconditioner: str
    query_only: bool  # True: score = (P^-1 q) . g ; False: score = (P^-1/2 q) . (P^-1/2 g)
    damped: bool
    summary: str
    eigen_correction: bool = False
    over_checkpoints: bool = False  # a learning-rate weighted sum over checkpoints (TracIn)
    unit_norm: bool = False  # both sides unit-normalised after preconditioning (a cosine in that space)
    requires: str = ""  # what the run's rows must have, in words ("" : nothing beyond gradient rows)
    operations: frozenset[str] = _ALL_OPERATIONS
    trajectory: Literal["", "steps", "segments", "embeddings"] = ""  # what of the training history it uses
    true_fisher: bool = False  # fits its curvature on true-Fisher rows where a checkpoint has them

    @property
    def uses(self) -> frozenset[str]:
        """The optional arguments (:data:`OPTIONAL_ARGUMENTS`) this method uses."""
        used = set()
        if self.damped:
            used.add("damping")
        if self.preconditioner == "fisher" or self.trajectory == "embeddings":
            used.add("blocks")
        if self.trajectory == "steps":
            used |= {"checkpoint", "query_checkpoint"}
        elif self.trajectory == "segments":
            used |= {"checkpoints", "query_checkpoint"}
        else:
            used |= {"checkpoints"} if self.over_checkpoints else _ONE_CHECKPOINT
        return frozenset(used)

    def check_operation(self, operation: str) -> None:
        """``InvalidArgumentError`` unless ``operation`` takes this method."""
        if operation not in self.operations:
            takers = sorted(name for name, m in METHODS.items() if operation in m.operations)
            raise InvalidArgumentError(f"{operation} does not take method={self.name!r}; use one of {takers}")


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "grad-dot",
            "identity",
            True,
            False,
            "q . g: the raw gradient inner product (no curvature)",
        ),
        Method(
            "cosine",
            "cosine",
            False,
            False,
            "q . g / (norm(q) norm(g)): the gradients' cosine",
            operations=frozenset({"attribute", "score_matrix", "build_index"}),
        ),
        Method(
            "diagonal",
            "diagonal",
            True,
            True,
            "q^T (D + damping)^-1 g with D the rows' diagonal second moment",
        ),
        Method(
            "fisher",
            "fisher",
            True,
            True,
            "q^T (F + damping)^-1 g with F the projected Fisher of the rows (per layer or full; true Fisher where "
            "the checkpoint has true-fisher rows)",
            true_fisher=True,
        ),
        Method(
            "kfac",
            "kfac",
            True,
            True,
            "q^T (S (x) A + damping)^-1 g with the Kronecker factors recorded at capture (those of the true-fisher "
            "rows where the checkpoint has them)",
            requires=KRONECKER_FACTORS,
            true_fisher=True,
        ),
        Method(
            "ekfac",
            "kfac",
            True,
            True,
            "kfac with its eigenvalues refitted on the stored rows (eigen-corrected; eigenbasis and eigenvalues both "
            "from the true-fisher rows where the checkpoint has them)",
            eigen_correction=True,
            requires=KRONECKER_FACTORS,
            true_fisher=True,
        ),
        Method(
            "tracin",
            "identity",
            True,
            False,
            "sum over checkpoints of lr_c * q_c . g_c (TracIn-CP)",
            over_checkpoints=True,
            requires="query rows at checkpoints with a recorded learning rate (checkpoint passes)",
            operations=frozenset({"attribute"}),
        ),
        Method(
            "trackstar",
            "fisher",
            False,
            True,
            "cos(F^-1/2 q, F^-1/2 g): a cosine in the Fisher-whitened space (for Adam-normalised rows)",
            unit_norm=True,
            requires="rows captured with normalizer='adam_factored' (and the optimizer) for its intended use",
            operations=frozenset({"attribute", "score_matrix", "build_index", "select"}),
        ),
        Method(
            "tracin-steps",
            "identity",
            True,
            False,
            "sum over recorded training steps of lr_t * s_t / B_t * q_c(t) . g_t (s_t steps per recorded one, "
            "B_t rows per step, q_c(t) the queries of the first checkpoint at or after step t)",
            requires="training rows captured during training (one checkpoint label, many steps, a learning rate)",
            operations=frozenset({"attribute", "score_matrix", "self_influence", "select"}),
            trajectory="steps",
        ),
        Method(
            "source",
            "fisher",
            True,
            False,
            "SOURCE: segments between checkpoint passes, each with its own Fisher F_l: "
            "sum_l q^T (prod_{l'>l} exp(-lr K F)) (I - exp(-lr_l K_l F_l)) F_l^-1 g_l / N_l",
            requires="checkpoint passes: training rows at checkpoints with a recorded step and learning rate",
            operations=frozenset({"attribute", "score_matrix", "self_influence", "select"}),
            trajectory="segments",
            true_fisher=True,
        ),
        Method(
            "source-ekfac",
            "kfac",
            True,
            False,
            "source with each checkpoint's curvature its EK-FAC (Kronecker eigenbasis, eigenvalues refitted on the "
            "rows) instead of the projected Fisher",
            eigen_correction=True,
            requires="checkpoint passes (a step and learning rate each) with Kronecker-structured rows",
            operations=frozenset({"attribute", "score_matrix", "self_influence", "select"}),
            trajectory="segments",
            true_fisher=True,
        ),
        Method(
            "dvemb",
            "identity",
            True,
            False,
            "data value embeddings: q . e_z with e_z = sum_t lr_t / B_t prod_{s>t} (I - lr_s H_s) g_t, "
            "kept as the derived run <run>.dvemb",
            requires="training rows captured during training (one checkpoint label, many steps, a learning rate)",
            operations=frozenset({"attribute", "score_matrix", "self_influence", "select", "build_index"}),
            trajectory="embeddings",
        ),
    )
}
ALIASES = {"influence": "fisher", "graddot": "grad-dot", "grad_dot": "grad-dot", "tracin-cp": "tracin"}


def resolve_method(name: str, operation: str | None = None) -> Method:
    """The :class:`Method` called ``name`` (or an alias); ``InvalidArgumentError`` naming the choices otherwise
    (or when ``operation`` does not take it)."""
    key = ALIASES.get(name, name) if isinstance(name, str) else name
    if key not in METHODS:
        raise InvalidArgumentError(
            f"unknown attribution method {name!r}; choose one of {sorted(METHODS)} (aliases: {sorted(ALIASES)})"
        )
    method = METHODS[key]
    if operation is not None:
        method.check_operation(operation)
    return method


def method_names(operation: str | None = None) -> list[str]:
    """The methods ``operation`` takes (every method: ``None``), in the registry's order."""
    return [name for name, m in METHODS.items() if operation is None or operation in m.operations]


def check_arguments(operation: str, method: Method, given: Mapping[str, Any]) -> None:
    """Refuse an argument ``method`` does not use: ``given`` maps the optional arguments the caller set (those
    left at their neutral default are not in it) to their values; also checks ``damping`` and ``rerank``."""
    method.check_operation(operation)
    for argument in given:
        if argument not in method.uses and argument not in _OWN_ARGUMENTS.get(operation, ()):
            users = [name for name, m in METHODS.items() if argument in m.uses]
            raise InvalidArgumentError(
                f"{operation}(method={method.name!r}) does not use {argument}= ({OPTIONAL_ARGUMENTS[argument]}): "
                f"remove it, or choose a method that uses it ({', '.join(users)})"
            )
    if "damping" in given:
        check_damping(given["damping"])
    if "rerank" in given:
        check_rerank(given["rerank"], given.get("kind", "exact"))


#: The value of each optional argument that means "not given" (the call's own default).
NOT_GIVEN: dict[str, Any] = {
    "damping": None,
    "blocks": "auto",
    "checkpoint": None,
    "checkpoints": None,
    "kind": "exact",
    "rerank": 0,
    "query_checkpoint": None,
    "device": None,
}


def given_arguments(**arguments: Any) -> dict[str, Any]:
    """The optional arguments among ``arguments`` that differ from :data:`NOT_GIVEN` (what the caller set)."""
    return {name: value for name, value in arguments.items() if not _same(value, NOT_GIVEN[name])}


def _same(value: Any, default: Any) -> bool:
    return (
        value is default
        if default is None
        else (value is not None and type(value) is type(default) and value == default)
    )


def check_damping(damping: float) -> float:
    """``damping`` if it is a finite number > 0 (relative to the mean eigenvalue)."""
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not math.isfinite(damping) or damping <= 0:
        raise InvalidArgumentError(
            f"damping must be a finite number > 0 (relative to the mean eigenvalue; default {DEFAULT_DAMPING}), "
            f"got {damping!r}"
        )
    return float(damping)


def check_rerank(rerank: int, kind: str) -> int:
    """``rerank`` if it is a whole number >= 1 and ``kind`` is a FAISS index whose candidates it re-scores."""
    if isinstance(rerank, bool) or not isinstance(rerank, int) or rerank < 0:
        raise InvalidArgumentError(f"rerank must be a whole number >= 0 (0: off), got {rerank!r}")
    if rerank and kind == "exact":
        raise InvalidArgumentError(
            "rerank re-scores a FAISS index's candidates exactly; kind='exact' is exact already: "
            "drop rerank, or pass a FAISS kind such as kind='HNSW32,Flat'"
        )
    return rerank


def check_blocks(blocks: str) -> str:
    """``blocks`` if it is a :data:`BlockStructure`."""
    if blocks not in get_args(BlockStructure):
        raise InvalidArgumentError(f"blocks must be one of {get_args(BlockStructure)}, got {blocks!r}")
    return blocks


def check_k(k: int) -> int:
    """``k`` if it is a whole number >= 1."""
    return check_count("k", k)


def check_count(name: str, value: int) -> int:
    """``value`` of argument ``name`` if it is a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def methods_table() -> str:
    """The registry as a Markdown table (the docs' methods table is checked against it)."""
    lines = ["| method | score | uses | takes | needs |", "|---|---|---|---|---|"]
    for m in METHODS.values():
        uses = ", ".join(sorted(m.uses)) or "-"
        takes = ", ".join(op for op in get_args(Operation) if op in m.operations)
        lines.append(f"| `{m.name}` | {m.summary} | {uses} | {takes} | {m.requires or '-'} |")
    return "\n".join(lines)


def _option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ScoreOptions:
    """How a scoring call scores: the one declaration of the options ``attribute``, ``score_matrix``,
    ``self_influence``, ``select``, ``build_index`` and ``token_scores`` share: pass one as ``options=``, or the
    keywords, which build one (:meth:`build`); the CLI's options, :class:`~gradstore.serve.client.RemoteStore`'s
    and the docs' options table come from the fields (:func:`options_table`).
    :meth:`check` refuses an option the chosen method does not use."""

    method: str = _option(DEFAULT_METHOD, "attribution method, one of the registry's (default fisher)")
    checkpoint: str | None = _option(None, "checkpoint of the training rows (default: the run's latest)")
    query_checkpoint: str | None = _option(
        None, "checkpoint of stored query rows (default: the training rows', else the one holding query rows)"
    )
    checkpoints: tuple[str, ...] | None = _option(
        None, "checkpoints summed over (tracin; select: default every one with a learning rate)"
    )
    damping: float | None = _option(None, f"damping relative to the mean eigenvalue (default {DEFAULT_DAMPING})")
    blocks: BlockStructure = _option("auto", "Fisher blocks: layer, full or auto (per layer when the run has layers)")
    kind: str = _option("exact", "index: exact, auto, or a FAISS factory string such as HNSW32,Flat")
    rerank: int = _option(0, "FAISS kinds: re-score rerank x k candidates exactly (0: off)")
    device: str | None = _option(None, "where the search runs: cpu, cuda, cuda:N (default: CUDA when present)")
    split: str = _option("train", "split of the training rows")
    where: str | None = _option(None, "SQL filter on the training rows' metadata")

    def __post_init__(self) -> None:
        if self.checkpoints is not None:  # any sequence of names, kept as a tuple (the options stay hashable)
            if isinstance(self.checkpoints, str):
                raise InvalidArgumentError(
                    f"checkpoints takes a list of checkpoint names, got the string {self.checkpoints!r}"
                )
            object.__setattr__(self, "checkpoints", tuple(self.checkpoints))

    @classmethod
    def build(
        cls,
        options: ScoreOptions | None,
        call: str,
        *,
        defaults: Mapping[str, Any] | None = None,
        spelled: Mapping[str, str] | None = None,
        **keywords: Any,
    ) -> ScoreOptions:
        """The options scoring call ``call`` runs with: its option ``keywords`` (those it takes, by field name), or
        ``options`` when the caller gave one. A keyword set away from its default (the field's, or ``defaults``)
        to another value than ``options`` holds, or an option of ``options`` that ``call`` does not take, is an
        ``InvalidArgumentError`` saying what to do. ``spelled``: a field's keyword name in ``call``
        (``select``'s ``preconditioner`` is ``method``)."""
        given = cls(**keywords)
        if options is None:
            return given
        if not isinstance(options, cls):
            raise InvalidArgumentError(f"{call} takes options=ScoreOptions(...), got {type(options).__name__}")
        neutral = cls()
        for f in fields(cls):
            value, chosen = getattr(given, f.name), getattr(options, f.name)
            if f.name not in keywords:
                if not _same(chosen, getattr(neutral, f.name)):
                    raise InvalidArgumentError(f"{call} does not take {f.name}= (options.{f.name}={chosen!r})")
            elif not _same(value, (defaults or {}).get(f.name, getattr(neutral, f.name))) and value != chosen:
                keyword = (spelled or {}).get(f.name, f.name)
                raise InvalidArgumentError(
                    f"{call} got options= and {keyword}={value!r}, which differs from options.{f.name}={chosen!r}: "
                    f"give it once, on the options (dataclasses.replace(options, {f.name}=...)) or as keywords only"
                )
        return options

    def check(self, operation: str) -> Method:
        """The resolved method, after refusing a method ``operation`` does not take or an option it does not use."""
        method = resolve_method(self.method, operation)
        check_arguments(operation, method, given_arguments(**{name: getattr(self, name) for name in NOT_GIVEN}))
        return method


#: Each option's one-line doc (the CLI's help text).
OPTION_HELP = {f.name: f.metadata["help"] for f in fields(ScoreOptions)}


def options_table() -> str:
    """The options as a Markdown table (the docs' options table is checked against it)."""
    lines = ["| option | default | what |", "|---|---|---|"]
    for f in fields(ScoreOptions):
        lines.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['help']} |")
    return "\n".join(lines)
