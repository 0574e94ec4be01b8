"""The ``GradStore`` facade: the store's API, composed over its core.

:class:`~gradstore.core.StoreCore` holds the data (tables, runs, checkpoints, gradients, examples, side
files, SQL); a ``GradStore`` *holds* one (``store.core``, for power users and tests) and exposes the calls a
user means (:data:`API`): capture, indexes, attribution, selection, reports, and the few data calls of the
core that belong to the API. It owns the store's :class:`~gradstore.preconditioning.fitting.FitCache`, so every call
shares one fit per rows and method. Every name of the API goes through :func:`gradstore.errors.surface`: nothing but a
``GradstoreError`` comes out of it for what a user gives it. The core's other names still answer on the facade
for one release, with a ``DeprecationWarning`` naming ``store.core``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import torch
from torch import nn

from gradstore.answers.attribution import ScoreMatrix, attribute, score_matrix, self_influence
from gradstore.answers.replay import Reduction, Replay, replay
from gradstore.answers.report import ReportOptions, write_report
from gradstore.answers.selection import Aggregate, select
from gradstore.answers.token_scores import ExampleBatches, TokenText, token_scores
from gradstore.capture.session import RUN_DEFAULT, StoreCapture, capture_config, explicit_options
from gradstore.core import StoreCore, WriterConfig, connect
from gradstore.core.catalog import RunCatalog
from gradstore.core.engine import Engine, EngineName, resolve_engine
from gradstore.core.maintenance import Maintenance
from gradstore.core.results import Results
from gradstore.core.row_cache import RowFiles
from gradstore.core.tables import Tables
from gradstore.errors import InvalidArgumentError, surface
from gradstore.methods import DEFAULT_METHOD, BlockStructure, MethodName, ScoreOptions
from gradstore.methods.preconditioned import indexed
from gradstore.methods.queries import QueryBatch, QueryInput, check_queries
from gradstore.preconditioning.fitting import FitCache
from gradstore.search.arguments import check_count
from gradstore.search.index import AttributionIndex
from gradstore.search.loading import load_index
from gradstore.store_api import IndexKind
from ingest import CaptureConfig
from ingest.projection import LayerSizes, ProjectionBasis

Projection = Literal["factorized", "dense"] | None
LossReduction = Literal["mean", "sum", "token_mean"]


class _FromCore:
    """A name of the API answered by the store's core (or by its part ``part``, a class of ``gradstore.core``): the
    answering method's own signature and docstring, through the error surface (wrapped once per store)."""

    def __init__(self, part: type | None = None) -> None:
        self.name = ""
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, store: GradStore | None, owner: type) -> Any:
        if store is None:
            return getattr(self.part or StoreCore, self.name)
        bound = surface(getattr(_answering(store.core, self.part), self.name))
        store.__dict__[self.name] = bound  # later lookups find it on the instance
        return bound


def _answering(core: StoreCore, part: type | None) -> Any:
    """The core, or its part of class ``part``."""
    return (
        core if part is None else next(getattr(core, name) for name in core.PARTS if type(getattr(core, name)) is part)
    )


def _core_property(name: str, doc: str | None = None, part: type | None = None) -> property:
    """A read-only property of the API answered by the store's core (or its part of class ``part``)."""
    return property(
        lambda store: getattr(_answering(store.core, part), name), doc=doc or getattr(part or StoreCore, name).__doc__
    )


class GradStore:
    """A gradient store. Create or open one with :func:`gradstore.open`; ``store.core`` is the
    :class:`~gradstore.core.StoreCore` it holds (tables, readers, side files: plumbing, not API)."""

    def __init__(self, core: StoreCore) -> None:
        """A facade over ``core`` (made by :func:`open_store`)."""
        self.core = core
        self.fits = FitCache(core)

    def __repr__(self) -> str:
        return f"GradStore({self.core.location!r})"

    def __getattr__(self, name: str) -> Any:
        """The core's other names, for one release, with a ``DeprecationWarning``."""
        if name.startswith("_") or name in ("core", "fits"):
            raise AttributeError(name)
        part = None if hasattr(self.core, name) else self.core.part_of(name)
        path = "core" if part is None else f"core.{part}"
        value = getattr(self.core if part is None else getattr(self.core, part), name)  # AttributeError: nobody has it
        warnings.warn(
            f"store.{name} is the store's plumbing, not its API: use store.{path}.{name} "
            "(it leaves the facade in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return value

    # ------------------------------------------------------------------ data: the core's calls that are API
    uri = _core_property("uri", "The store's location as given to :func:`gradstore.open` (a path or a URI).")
    dim = _core_property("dim", part=RunCatalog)
    dims = _core_property("dims", part=RunCatalog)
    storage_dtype = _core_property("storage_dtype")
    writable = _core_property("writable")
    add_examples = _FromCore(Results)
    sql = _FromCore()
    runs = _FromCore(RunCatalog)
    run = _FromCore()
    checkpoints = _FromCore()
    create_run = _FromCore()
    record_checkpoint = _FromCore()
    writer = _FromCore()
    read_gradients = _FromCore()
    iter_gradients = _FromCore()
    count = _FromCore(Tables)
    compact = _FromCore(Maintenance)
    verify = _FromCore(Maintenance)
    info = _FromCore(Maintenance)

    # ------------------------------------------------------------------ capture
    @surface
    def capture(
        self,
        model: nn.Module,
        run: str,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        split: str = "train",
        checkpoint: str = "train",
        learning_rate: float | None = None,
        curvature: bool = False,
        projection: Projection = RUN_DEFAULT,
        k_in: int = RUN_DEFAULT,
        k_out: int = RUN_DEFAULT,
        seed: int = RUN_DEFAULT,
        layer_types: Sequence[str] = RUN_DEFAULT,
        include: str | None = RUN_DEFAULT,
        exclude: str | None = RUN_DEFAULT,
        include_frozen: bool = RUN_DEFAULT,
        route: Literal["auto", "project", "materialize"] = RUN_DEFAULT,
        layer_sizes: LayerSizes | None = RUN_DEFAULT,
        basis: ProjectionBasis | None = RUN_DEFAULT,
        loss_reduction: LossReduction = RUN_DEFAULT,
        loss_scale: float = RUN_DEFAULT,
        normalizer: Literal["adam_factored", "adam_sqrt"] | None = None,
        fused: bool = False,
        rank: int | None = None,
        per_example_loss: Callable[..., torch.Tensor] | None = None,
        grad_scaler: Any = None,
        on_nonfinite: Literal["skip", "raise"] = "skip",
        coverage: Literal["warn", "strict", "ignore"] = "warn",
        example_dim: int = 0,
        max_pending_batches: int = 4,
        writer: WriterConfig | None = None,
        resume: bool = False,
        config: CaptureConfig | None = None,
    ) -> StoreCapture:
        """Capture per-example gradients of ``model`` into run ``run`` (a context manager).

        Per capture: ``split`` (``"train"``/``"query"``), ``checkpoint``, ``learning_rate`` (overrides the
        optimizer's; for checkpoint passes without one), ``curvature`` (also record Kronecker covariances of the
        training rows and, apart, of the ``"true-fisher"`` rows, for ``kfac``/``ekfac``: each capture adds its sums
        and token counts to the checkpoint's, so captures of parts of a checkpoint's rows save the factors of one
        capture over all of them; a capture that adds rows of a split to a checkpoint with factors of that split
        without ``curvature=True`` leaves them describing only part of its rows: ``StaleCurvatureWarning`` then, and
        whenever ``kfac``/``ekfac`` fit them; with ``resume=True`` the factors count the committed rows a capture
        replays again: they replace the checkpoint's where it replayed all of them, are added where it replayed just
        the rows whose factors a crash lost, else are saved stale with the warning), ``normalizer``, ``fused``
        (project inside the Linear/Conv1D layers' own GEMMs: the same rows, cheaper where batches hold more tokens
        than a layer is wide; :mod:`ingest.fused`), ``rank``.
        Per run: ``projection`` (``"factorized"`` ``k_out x k_in`` per layer, ``"dense"``, or ``None`` for exact
        gradients), ``k_in``/``k_out``, ``seed``, ``layer_types``/``include``/``exclude`` (which layers),
        ``include_frozen`` (also capture layers whose weight is frozen, e.g. a LoRA model's base layers; default:
        trainable layers only), ``route``,
        ``layer_sizes`` (per-layer ``(k_in, k_out)`` by layer-name regex), ``basis`` (fixed projection matrices such
        as the curvature-aware ones of :func:`ingest.basis.estimate_basis`, kept in the store for the run's later
        captures), and ``loss_reduction``/``loss_scale`` (how the loop's loss was formed): a new run takes them as
        given (else the defaults: factorized 16 x 16, mean reduction); later captures of the run reuse the run's own
        unless told otherwise, and one whose projection differs is refused with ``ProjectionMismatchError``.
        ``resume=True`` (a job restarted from a checkpoint): rows of ``(checkpoint, step, split, example_id)``
        already committed to the run are skipped (:mod:`gradstore.capture.resume`).
        ``grad_scaler``: the loop's AMP ``GradScaler`` (its scale is divided out of the rows). ``on_nonfinite``: a
        training batch whose gradients hold NaN/Inf, or whose step the scaler skipped, is not written but listed in
        the ``skipped_steps`` table with a warning (``"skip"``), or ``NonFiniteGradientError`` stops the loop at
        the ``backward()`` that produced it (``"raise"``). ``coverage``: every trainable parameter is captured
        (Linear, Conv1D, Embedding and their subclasses, ConvNd, attention projections, bare parameters; at the
        ops that use it where a module hook cannot see every use) or recorded as not captured with why (norm
        parameters by decision; uses capture cannot split, e.g. packed sequences): ``"warn"``
        once, ``"strict"`` raises ``CaptureUsageError``, ``"ignore"``; each capture's coverage is a row per
        parameter in the ``capture_coverage`` table and in ``store.info()["coverage"]``. ``example_dim``: the dim
        of the model's input that indexes the examples (1 for a sequence-first model fed ``[T, B, ...]``).
        ``config``: an :class:`ingest.CaptureConfig` built whole (projection, labels, how rows are formed) instead of
        the keywords it holds (a keyword that differs from it is an ``InvalidArgumentError``); a run's later
        captures must give the same projection.
        """
        options = {
            "split": split,
            "checkpoint": checkpoint,
            "curvature": curvature,
            "projection": projection,
            "k_in": k_in,
            "k_out": k_out,
            "seed": seed,
            "layer_types": layer_types,
            "include": include,
            "exclude": exclude,
            "include_frozen": include_frozen,
            "route": route,
            "layer_sizes": layer_sizes,
            "basis": basis,
            "loss_reduction": loss_reduction,
            "loss_scale": loss_scale,
            "normalizer": normalizer,
            "fused": fused,
            "max_pending_batches": max_pending_batches,
            "on_nonfinite": on_nonfinite,
            "coverage": coverage,
            "example_dim": example_dim,
        }
        if rank is not None:
            options["rank"] = rank
        if isinstance(layer_types, (list, tuple)):
            options["layer_types"] = tuple(layer_types)
        return StoreCapture(
            self.core,
            model,
            run,
            capture_config(self.core, run, config, options),
            explicit=explicit_options(config, options),
            optimizer=optimizer,
            per_example_loss=per_example_loss,
            grad_scaler=grad_scaler,
            learning_rate=learning_rate,
            writer_config=writer,
            resume=resume,
        )

    # ------------------------------------------------------------------ indexes
    @surface
    def build_index(
        self,
        run: str,
        *,
        checkpoint: str | None = None,
        method: MethodName = DEFAULT_METHOD,
        damping: float | None = None,
        kind: IndexKind = "exact",
        split: str = "train",
        where: str | None = None,
        name: str | None = None,
        blocks: BlockStructure = "auto",
        refit: bool = False,
        engine: EngineName | Engine = "local",
        device: str | torch.device | None = None,
        options: ScoreOptions | None = None,
    ) -> AttributionIndex:
        """Fit ``method``'s preconditioner over the run's rows (or reuse the store's fit) and build/persist an
        index, incrementally when rows were appended since. ``kind``: ``"exact"``, ``"auto"`` or a FAISS
        factory string; ``blocks``: the Fisher block structure (``"layer"``, ``"full"``, ``"auto"``);
        ``engine``: where the fit runs (``"local"``, ``"ray"`` or a :class:`~gradstore.core.engine.RayEngine`);
        ``device``: where the index searches (exact: a torch device, default CUDA when torch sees one, else the
        CPU; FAISS: ``"cuda"`` moves a GPU-capable index to the GPUs). ``options``: a
        :class:`~gradstore.methods.ScoreOptions` instead of its keywords."""
        options = ScoreOptions.build(
            options,
            "build_index",
            method=method,
            checkpoint=checkpoint,
            damping=damping,
            blocks=blocks,
            kind=kind,
            device=device,
            split=split,
            where=where,
        )
        return options.check("build_index").build_index(
            self.core, self.fits, options, run=run, name=name, refit=refit, engine=resolve_engine(engine)
        )

    @surface
    def index(self, name: str, *, device: str | torch.device | None = None) -> AttributionIndex:
        """Load a persisted index by name (``IndexMismatchError`` if it does not match the store); ``device`` as
        for :meth:`build_index`."""
        return load_index(self.core, self.fits, name, indexed, device=device)

    # ------------------------------------------------------------------ attribution and selection
    @surface
    def attribute(
        self,
        queries: QueryInput = None,
        *,
        run: str,
        k: int = 10,
        method: MethodName = DEFAULT_METHOD,
        checkpoint: str | None = None,
        query_checkpoint: str | None = None,
        checkpoints: Sequence[str] | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        kind: IndexKind = "exact",
        opponents: bool = False,
        split: str = "train",
        where: str | None = None,
        write: bool | None = None,
        engine: EngineName | Engine = "local",
        rerank: int = 0,
        device: str | torch.device | None = None,
        options: ScoreOptions | None = None,
    ) -> pa.Table:
        """Top-k proponents (and with ``opponents=True`` the bottom-k opponents) of each query.

        ``queries``: ``None`` (every stored query row of the run), a SQL filter, a list of query example ids, a
        :class:`~gradstore.methods.queries.QueryBatch` or raw vectors ``[q, dim]``. Training rows are those of
        ``checkpoint`` (default: the run's latest); stored queries are read at ``query_checkpoint`` (default: the
        same checkpoint when the run has query rows there, else the one checkpoint its query rows were captured
        at, e.g. ``"final"``). ``method``: one of :data:`gradstore.methods.METHODS` (default ``fisher``;
        ``tracin`` sums over ``checkpoints``, default all recorded with a learning rate); an argument the method
        does not use (``damping`` for grad-dot, ``checkpoints`` for fisher, ...) is an ``InvalidArgumentError``.
        ``where`` filters the training rows. ``engine``: where fitting and the exact scan run, ``"local"`` (this
        process) or ``"ray"`` (or a :class:`~gradstore.core.engine.RayEngine` with an address); both give the same
        results.
        ``rerank=m`` (FAISS kinds): the index's ``m * k`` candidates are re-scored exactly from the stored rows;
        FAISS indexes whose probed lists hold fewer than ``k`` rows return fewer (with a ``FewerResultsWarning``).
        ``device``: where the search runs (as for :meth:`build_index`). ``options``: a
        :class:`~gradstore.methods.ScoreOptions` instead of the keywords it holds (``method`` to ``where``; a
        keyword that differs from it is an ``InvalidArgumentError``).
        Returns ``(query_id, example_id, grad_id, score, rank, method, run_id, checkpoint, index_name)``,
        also appended to ``scores`` unless ``write=False``.
        """
        options = ScoreOptions.build(
            options,
            "attribute",
            method=method,
            checkpoint=checkpoint,
            query_checkpoint=query_checkpoint,
            checkpoints=checkpoints,
            damping=damping,
            blocks=blocks,
            kind=kind,
            rerank=rerank,
            device=device,
            split=split,
            where=where,
        )
        return attribute(
            self.core,
            self.fits,
            check_queries(queries),
            options,
            run=run,
            k=k,
            opponents=opponents,
            write=True if write is None else write,  # None: the store's default (a local store writes)
            engine=engine,
        )

    @surface
    def score_matrix(
        self,
        queries: QueryInput = None,
        *,
        run: str,
        method: MethodName = DEFAULT_METHOD,
        checkpoint: str | None = None,
        checkpoints: Sequence[str] | None = None,
        query_checkpoint: str | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        split: str = "train",
        where: str | None = None,
        options: ScoreOptions | None = None,
    ) -> ScoreMatrix:
        """Dense queries x training rows scores with their ids (``.scores`` numpy, ``.torch()``), for small
        problems; nothing is written to ``scores``. Arguments as for :meth:`attribute`. Methods that sum over an
        example's rows (``tracin-steps``, ``source``) give one column per example (``grad_ids`` -1)."""
        options = ScoreOptions.build(
            options,
            "score_matrix",
            method=method,
            checkpoint=checkpoint,
            checkpoints=checkpoints,
            query_checkpoint=query_checkpoint,
            damping=damping,
            blocks=blocks,
            split=split,
            where=where,
        )
        return score_matrix(self.core, self.fits, check_queries(queries), options, run=run)

    @surface
    def self_influence(
        self,
        *,
        run: str,
        method: MethodName = DEFAULT_METHOD,
        checkpoint: str | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        split: str = "train",
        where: str | None = None,
        write: bool | None = None,
        engine: EngineName | Engine = "local",
        options: ScoreOptions | None = None,
    ) -> pa.Table:
        """``g^T P^-1 g`` of every selected training row (large values: outliers, likely mislabels).

        Returns ``(example_id, grad_id, run_id, checkpoint, method, self_influence)``, largest first, also
        appended to the ``self_influence`` table unless ``write=False``. ``engine`` as for :meth:`attribute`.
        Trajectory methods (``tracin-steps``, ``source``, ``dvemb``): the effect of up-weighting each example on
        its own final loss (its row at the last checkpoint pass scored against its history), one row per example."""
        options = ScoreOptions.build(
            options,
            "self_influence",
            method=method,
            checkpoint=checkpoint,
            damping=damping,
            blocks=blocks,
            split=split,
            where=where,
        )
        write = True if write is None else write  # None: the store's default (a local store writes)
        return self_influence(self.core, self.fits, options, run=run, write=write, engine=engine)

    @surface
    def select(
        self,
        target: QueryInput = None,
        *,
        run: str,
        budget: float = 0.05,
        preconditioner: MethodName = "grad-dot",
        aggregate: Aggregate = "max",
        checkpoints: Sequence[str] | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        split: str = "train",
        where: str | None = None,
        engine: EngineName | Engine = "local",
        options: ScoreOptions | None = None,
    ) -> pa.Table:
        """LESS-style data selection: the training examples whose gradients align best with ``target``.

        ``score(x) = sum_c lr_c * agg_q cos(P_c^-1/2 g_c(x), P_c^-1/2 q_c)`` over the run's checkpoints with
        learning rates (else its latest checkpoint), ``agg`` the ``max`` (LESS) or ``mean`` over the target
        rows, ``P`` the ``preconditioner`` method's fit; a trajectory method (``tracin-steps``, ``source``,
        ``dvemb``) scores each example by the ``agg`` over the target of its influence scores instead.
        ``budget``: a fraction in (0, 1] or a count.
        ``engine`` as for :meth:`attribute`; ``options``: a :class:`~gradstore.methods.ScoreOptions` (its ``method``
        is the preconditioner). Returns ``(example_id, score, rank)``, best first."""
        options = ScoreOptions.build(
            options,
            "select",
            defaults={"method": "grad-dot"},
            spelled={"method": "preconditioner"},
            method=preconditioner,
            checkpoints=checkpoints,
            damping=damping,
            blocks=blocks,
            split=split,
            where=where,
        )
        return select(
            self.core,
            self.fits,
            check_queries(target, "target"),
            options,
            run=run,
            budget=budget,
            aggregate=aggregate,
            engine=engine,
        )

    @surface
    def token_scores(
        self,
        queries: QueryBatch,
        examples: ExampleBatches,
        *,
        run: str,
        k: int = 10,
        method: MethodName = DEFAULT_METHOD,
        checkpoint: str | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        token_text: TokenText | None = None,
        batch_size: int = 8,
        split: str = "train",
        where: str | None = None,
        write: bool = True,
        options: ScoreOptions | None = None,
    ) -> pa.Table:
        """Per-token attribution of each query against its top-k training examples (a re-rank stage).

        The top-k are found in the store as by :meth:`attribute`; then only those examples are run through
        ``queries.model`` again, with the run's projection, to split each (query, example) score into its
        tokens' shares on both sides. ``queries``: a :class:`~gradstore.methods.queries.QueryBatch` (the model, the
        tokenized queries, their loss). ``examples(ids)``: the model's input batch for training examples by id
        (without an ``example_id`` entry), scored with ``loss_fn(model, batch)`` (default ``model(**batch).loss``,
        formed as the run's ``loss_reduction`` says), ``batch_size`` ids at a time. ``token_text(token_id)``: how a
        token is shown (default its id). ``method``: one linear in the training gradient (``grad-dot``,
        ``diagonal``, ``fisher``, ``kfac``, ``ekfac``); the token scores of an example sum to its score.
        Returns ``(query_id, example_id, rank, side, position, token_id, token, score, method, run_id,
        checkpoint, created_at)`` with ``side`` ``"train"`` (the example's tokens) or ``"query"`` (the query's),
        also appended to ``token_scores`` unless ``write=False``."""
        options = ScoreOptions.build(
            options,
            "token_scores",
            method=method,
            checkpoint=checkpoint,
            damping=damping,
            blocks=blocks,
            split=split,
            where=where,
        )
        return token_scores(
            self.core,
            self.fits,
            queries,
            examples,
            options,
            run=run,
            k=k,
            loss_fn=loss_fn,
            token_text=token_text,
            batch_size=batch_size,
            write=write,
        )

    @surface
    def replay(
        self,
        queries: Sequence[str],
        *,
        run: str,
        model_fn: Callable[[], nn.Module],
        batch_fn: Callable[[list[str]], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        optimizer: Any,
        checkpoint: str | None = None,
        segments: int | None = None,
        reduction: Reduction | None = None,
        weight: float = 1.0,
        write: bool | None = None,
    ) -> Replay:
        """Exact metagradients (MAGIC-style) of the final losses of ``queries`` (query example ids) with respect
        to every training example's weight, by replaying ``run``'s recorded training (its order and learning rates,
        from the rows captured during training under ``checkpoint``, default the in-loop label) and
        differentiating through it (:mod:`gradstore.answers.replay`). ``model_fn()``: the model at its initial
        weights; ``batch_fn(ids)``: the batch of those example ids (training and query ids); ``loss_fn(model,
        batch)``: per-example losses ``[B]``, reduced by ``reduction`` (``"mean"``/``"sum"``) as the training loop did
        (default: the ``loss_reduction`` the run's capture was given, else ``"mean"``; one contradicting it is
        refused); ``optimizer``:
        ``"sgd"``/``"adam"``/``"adamw"``, a :class:`~gradstore.answers.replay.Optimizer`, or the torch.optim
        optimizer (class or instance) of the run; ``segments``: checkpoints of the backward pass (default
        ``ceil(sqrt(steps))``: memory about ``2 sqrt(steps)`` states); ``weight``: every example's weight where the
        derivative is taken (1, the recorded run; to predict removing a random share of the data, the share kept,
        e.g. 0.5: exact to second order there). Returns a
        :class:`~gradstore.answers.replay.Replay` (``scores[q, z] = -dL_q/deps_z``), kept in the store for
        ``attribute(method="replay")`` and ``score_matrix(method="replay")`` unless ``write=False``."""
        return replay(
            self.core,
            queries,
            run=run,
            model_fn=model_fn,
            batch_fn=batch_fn,
            loss_fn=loss_fn,
            optimizer=optimizer,
            checkpoint=checkpoint,
            segments=segments,
            reduction=reduction,
            weight=weight,
            write=True if write is None else write,
        )

    # ------------------------------------------------------------------ report
    @surface
    def report(
        self,
        out: str | Path = "report.html",
        *,
        run: str | None = None,
        max_queries: int = 1000,
        top: int = 10,
        selection: pa.Table | None = None,
    ) -> Path:
        """Write a self-contained HTML attribution report (opens offline) to ``out`` (its folder is created);
        see :mod:`gradstore.answers.report`."""
        options = ReportOptions(
            run=run, max_queries=check_count("max_queries", max_queries), top=check_count("top", top)
        )
        out = Path(out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            return write_report(self.core, out, options=options, selection=selection)
        except (IsADirectoryError, NotADirectoryError, FileExistsError, FileNotFoundError) as error:
            raise InvalidArgumentError(
                f"cannot write the report to {str(out)!r}: {error} (give a file path)"
            ) from error


#: The store's API: every public name of :class:`GradStore` (each documented in docs/api.md).
API = tuple(sorted(name for name in vars(GradStore) if not name.startswith("_")))


@surface
def open_store(
    uri: str | Path,
    *,
    create: bool = True,
    storage_dtype: str | None = None,
    read_consistency: timedelta = timedelta(0),
    storage_options: dict[str, str] | None = None,
    row_files: bool | str | Path | RowFiles = True,
) -> GradStore:
    """Create or open the store at ``uri`` (a local directory or an object-store URI such as ``s3://bucket/x``).

    ``storage_dtype`` (``"float16"`` default, ``"bfloat16"``, ``"float32"`` or ``"int8"``; see
    :mod:`gradstore.core.vectors`) is fixed when the store is created (recorded in it before any run exists): a
    later open without it uses the store's, and asking for a different one is a ``SchemaMismatchError`` (a store
    made by an earlier version that has no run yet takes the one asked for, or the default, when its first run is
    created).
    ``read_consistency`` is how stale a read may be (0: always see other writers' latest commits).
    ``storage_options``: endpoint and credentials of
    an object store (Lance's names: ``aws_endpoint``, ``aws_access_key_id``, ``aws_secret_access_key``,
    ``aws_region``, ``allow_http``, ...); when not given for an ``s3://`` store they are read from the
    standard AWS environment variables. Tables and side files use the same options.
    ``row_files``: where exact search keeps the rows it prepared for the next process
    (:mod:`gradstore.core.row_cache`; ``True``: the user's cache directory, a path: there, ``False``: nowhere, or a
    :class:`~gradstore.core.row_cache.RowFiles` with its own budget).
    """
    core = connect(
        uri,
        StoreCore,
        create=create,
        storage_dtype=storage_dtype,
        read_consistency=read_consistency,
        storage_options=storage_options,
        row_files=row_files,
    )

    return GradStore(core)
