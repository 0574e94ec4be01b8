"""The registry's declarations: the :class:`Method` interface every family implements, :data:`METHODS` (filled by
:mod:`gradstore.methods`), name resolution, the optional arguments and their checks, and :class:`ScoreOptions`.

:data:`METHODS` is the one table the API, the CLI's choices and the docs' methods table come from: each
:class:`Method` says which optional arguments it uses (:attr:`Method.uses`), which calls accept it
(:attr:`Method.operations`) and what its rows must have (:attr:`Method.requires`). :func:`check_arguments`
turns an argument the chosen method does not use into an ``InvalidArgumentError`` naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa

from gradstore.core import StoreCore
from gradstore.core.engine import Engine
from gradstore.errors import InvalidArgumentError
from gradstore.methods.queries import QueryInput
from gradstore.methods.results import ScoreMatrix
from gradstore.preconditioning import DEFAULT_DAMPING, BlockStructure
from gradstore.preconditioning import TRUE_FISHER_SPLIT as TRUE_FISHER_SPLIT  # re-exported (declared below search)
from gradstore.preconditioning import check_blocks as check_blocks  # re-exported
from gradstore.preconditioning.fitting import FitCache
from gradstore.search.arguments import check_rerank
from gradstore.search.index import AttributionIndex

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
    "replay",
    "influence",
]
"""Names :func:`resolve_method` accepts (``influence`` is ``fisher``)."""
Operation = Literal["attribute", "score_matrix", "self_influence", "select", "build_index", "token_scores"]
"""The calls that take a ``method``."""

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
#: What ``kfac`` and ``ekfac`` need (their registry rows' "needs";
#: :func:`gradstore.preconditioning.fitting.kronecker_source`).
KRONECKER_FACTORS = (
    "Kronecker-structured (factorized or exact) rows, captured with curvature=True for the recorded factors; "
    "without them the factors are estimated from the rows (A = E[G^T G], S = E[G G^T] / E[|G|^2])"
)
ALL_OPERATIONS = frozenset(get_args(Operation))
ONE_CHECKPOINT = frozenset({"checkpoint", "kind", "rerank", "query_checkpoint", "device"})
#: Optional arguments a call uses whatever its method (``select`` sums over its own ``checkpoints``).
_OWN_ARGUMENTS = {"select": frozenset({"checkpoints"})}


class Method:
    """What every attribution method is: a name, what it scores, which optional arguments it uses (:attr:`uses`),
    which calls take it (:attr:`operations`) and what its rows need (:attr:`requires`), and the operations those
    calls dispatch to. A family of methods (:mod:`gradstore.methods.preconditioned`,
    :mod:`~gradstore.methods.checkpoint_sum`, :mod:`~gradstore.methods.trajectory`, :mod:`~gradstore.methods.dvemb`)
    is a subclass; the registry (:data:`METHODS`) holds its instances. An operation a method's
    :attr:`operations` lacks is refused by :meth:`check_operation` before it runs (the defaults here raise).

    The operations take the store's core and fit cache (:class:`~gradstore.preconditioning.fitting.FitCache`), the
    checked :class:`ScoreOptions` and the run; they compute and return, and write nothing (the caller appends
    results to the store's tables)."""

    name: str
    summary: str
    requires: str  # what the run's rows must have, in words ("" : nothing beyond gradient rows)
    operations: frozenset[str]

    @property
    def uses(self) -> frozenset[str]:
        """The optional arguments (:data:`OPTIONAL_ARGUMENTS`) this method uses."""
        raise NotImplementedError

    @property
    def reads_history(self) -> bool:
        """Whether it scores with the run's training history (rows of many checkpoints or steps, not one
        checkpoint's rows): its results name no single checkpoint and no index serves it."""
        return False

    def check_operation(self, operation: str) -> None:
        """``InvalidArgumentError`` unless ``operation`` takes this method."""
        if operation not in self.operations:
            takers = sorted(name for name, m in METHODS.items() if operation in m.operations)
            raise InvalidArgumentError(
                f"{operation} does not take {method_keyword(operation)}={self.name!r}; use one of {takers}"
            )

    def attribute(
        self,
        store: StoreCore,
        fits: FitCache,
        queries: QueryInput,
        options: ScoreOptions,
        *,
        run: str,
        k: int,
        opponents: bool,
        engine: Engine,
    ) -> pa.Table:
        """The top-k (and bottom-k with ``opponents``) training examples or rows of each query: a ``scores``
        table."""
        raise self._not_taken("attribute")

    def matrix(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
    ) -> ScoreMatrix:
        """The dense queries x training rows (or examples) scores (``score_matrix``)."""
        raise self._not_taken("score_matrix")

    def self_influence(
        self, store: StoreCore, fits: FitCache, options: ScoreOptions, *, run: str, engine: Engine
    ) -> pa.Table:
        """Each training example's (or row's) score against itself: a ``self_influence`` table."""
        raise self._not_taken("self_influence")

    def select(
        self,
        store: StoreCore,
        fits: FitCache,
        target: QueryInput,
        options: ScoreOptions,
        *,
        run: str,
        aggregate: str,
        engine: Engine,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per training example, its score for the ``target`` queries (``max`` or ``mean`` over them): example ids
        and scores, unranked."""
        raise self._not_taken("select")

    def build_index(
        self,
        store: StoreCore,
        fits: FitCache,
        options: ScoreOptions,
        *,
        run: str,
        name: str | None,
        refit: bool,
        engine: Engine,
    ) -> AttributionIndex:
        """The top-k index :meth:`attribute` searches (built, or extended with the rows added since)."""
        raise self._not_taken("build_index")

    def read_only_refusal(self, run: str, error: Exception) -> str | None:
        """What a read-only server answers when a call of this method on ``run`` ran into ``error`` (a refused
        write) building what the method builds on first use: the command that builds it; ``None``: nothing of its
        own (the server's general answer)."""
        return None

    def _not_taken(self, operation: str) -> InvalidArgumentError:
        self.check_operation(operation)
        return InvalidArgumentError(f"{operation} does not take method={self.name!r}")


#: The methods by name, in the order of the docs' table: instances of the families (filled by
#: :mod:`gradstore.methods` with the built-in ones; :func:`gradstore.methods.extension.register_method` adds).
METHODS: dict[str, Method] = {}
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


def method_keyword(operation: str) -> str:
    """The keyword the store API's ``operation`` takes its method by: ``select``'s is ``preconditioner``."""
    return "preconditioner" if operation == "select" else "method"


def check_arguments(operation: str, method: Method, given: Mapping[str, Any]) -> None:
    """Refuse an argument ``method`` does not use: ``given`` maps the optional arguments the caller set (those
    left at their neutral default are not in it) to their values; also checks ``damping`` and ``rerank``."""
    method.check_operation(operation)
    for argument in given:
        if argument not in method.uses and argument not in _OWN_ARGUMENTS.get(operation, ()):
            users = [name for name, m in METHODS.items() if argument in m.uses]
            raise InvalidArgumentError(
                f"{operation}({method_keyword(operation)}={method.name!r}) does not use {argument}= "
                f"({OPTIONAL_ARGUMENTS[argument]}): "
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


#: The relative dampings a fit takes: below, float64 cannot tell the damped eigenvalues from the undamped ones
#: (2^-52 of the largest); above, ``(F + damping)^-1`` is ``1 / damping`` to float64's precision (grad-dot, scaled),
#: and ``damping x mean eigenvalue`` may leave float64's range.
DAMPING_RANGE = (1e-15, 1e15)


def check_damping(damping: float) -> float:
    """``damping`` if it is a number in :data:`DAMPING_RANGE` (relative to the mean eigenvalue)."""
    low, high = DAMPING_RANGE
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not low <= damping <= high:
        raise InvalidArgumentError(
            f"damping must be a number in [{low:g}, {high:g}] (relative to the mean eigenvalue; default "
            f"{DEFAULT_DAMPING}: beyond that range float64 cannot resolve it), got {damping!r}"
        )
    return float(damping)


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
