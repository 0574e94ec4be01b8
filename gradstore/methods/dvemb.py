"""Data value embeddings (DVEmb, Wang et al. 2024) from rows captured during training, kept as a derived run.

An example ``z`` whose loss is up-weighted at recorded step ``t`` moves the weights by ``-lr_t s_t / B_t g_{z,t}``
(``B_t`` rows in the step's batch, ``s_t`` optimizer steps the recorded one stands for); every later step ``s``
carries that change through ``I - lr_s H_s`` (``H_s`` the step's batch curvature). So the example's effect on the
final weights is its *embedding*

    ``e_z = sum_t lr_t s_t / B_t * prod_{s > t} (I - lr_s H_s)^{s_s} g_{z,t}``

and the first-order effect on a query's final loss is ``-q . e_z`` with ``q`` the query's final-model gradient:
``dvemb`` scores ``q . e_z``. Exact for a model whose loss is quadratic in the weights, stored rows unprojected and
``H_s`` its exact batch Hessian (true-Fisher rows of the step, below). In the projected space every factor is a
small matrix per layer block.

``H_s = C^T C / n`` over the step's rows of split ``"true-fisher"`` (labels sampled from the model: a GGN) when
it has any, else over its training rows (the batch's empirical Fisher). The recursion runs backwards over the
recorded steps, ``M <- M (I - lr_s H_s)^{s_s}`` per block, reading the rows and the recorded dynamics in chunks
of steps (memory: the embeddings ``[examples, dim]`` and one ``d_b x d_b`` matrix per block, two with momentum:
:class:`~gradstore.methods.dynamics.JointProduct`; never all rows, and nothing that grows with the steps).

The embeddings are stored as the run ``<run>.dvemb`` (same projection spec and dim: its rows are searched like
any run's, by every index kind, the SQL macros and the report), one row per example under checkpoint ``dvemb``.
The state it was built from (rows and largest ``grad_id`` of the source rows, last step, the stability rule
:data:`dynamics.STABILITY` and the steps that rule clipped, warned again on every use) is a side file; rows
appended since are folded in incrementally when all their steps come after the last one
(``e_z <- P e_z + new terms`` with ``P`` the product over the new steps), else (or under another stability rule)
the run is rebuilt.

``where`` selects the in-loop training rows whose terms are summed: ``e_z`` over the selected ``(z, t)`` rows
only, while every recorded step keeps its whole batch curvature ``H_s`` and batch size ``B_t`` (the trajectory
is the one training took, whatever the filter). Any subset of rows is valid: ``where="step >= 8"`` is the effect
on the final weights of up-weighting the examples at steps 8 on only, an example filter leaves the other
examples' embeddings as they are. The filtered embeddings are the derived run's rows under a checkpoint label of
their own (:func:`variant`; the run keeps the last filter's besides the unfiltered ones). ``split`` is refused:
the in-loop rows are split ``"train"`` (a step's ``"true-fisher"`` rows are its curvature, used without asking).
A ``where`` that selects none of the in-loop rows is an ``InvalidArgumentError``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from gradstore.core import StoreCore, gradient_filter, sql_literal
from gradstore.core.engine import Engine
from gradstore.errors import InvalidArgumentError
from gradstore.methods import dynamics
from gradstore.methods.preconditioned import dense_matrix, index_top_k
from gradstore.methods.queries import Queries, QueryInput
from gradstore.methods.registry import ONE_CHECKPOINT, TRUE_FISHER_SPLIT, ScoreOptions, check_blocks
from gradstore.methods.results import ScoreMatrix
from gradstore.methods.rows import check_where, require_rows
from gradstore.methods.summed import history_self_influence
from gradstore.methods.trajectory import (
    History,
    HistorySum,
    RecordedStep,
    final_queries,
    final_training_checkpoint,
    in_loop_checkpoint,
    recorded_steps,
    refuse_split,
    require_in_loop_rows,
)
from gradstore.preconditioning import GRAD_DOT
from gradstore.preconditioning.fitting import FitCache, Selection, auto_blocks
from gradstore.search.building import build_index
from gradstore.search.index import AttributionIndex

log = logging.getLogger(__name__)

LABEL = "dvemb"
"""The checkpoint label of the derived run's rows."""
SIDE_FILES = "derived"
STATE_FILE = "dvemb.json"
#: Rows read per chunk of steps during the recursion (about; a step is never split).
CHUNK_ROWS = 65536  # embeddings written per batch
CHUNK_BYTES = 32 * 2**20  # float32 training and true-Fisher rows read per chunk of steps by the recursion


def derived_run(run: str) -> str:
    """The name of the run holding ``run``'s data value embeddings."""
    return f"{run}.dvemb"


def variant(where: str | None) -> str:
    """The derived run's checkpoint label holding the embeddings summed over the in-loop rows ``where`` selects
    (:data:`LABEL`: every row; the run keeps one filtered variant besides, the last one built)."""
    return LABEL if where is None else f"{LABEL}-where-{hashlib.sha256(where.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class EmbeddingState:
    """What the derived run was built from: the in-loop rows (label, block structure, their ``(rows, largest
    grad_id)`` with the true-Fisher rows'), the last step folded in, the derived rows it wrote, the stability rule
    it was built under (:data:`dynamics.STABILITY`) and the steps whose curvature that rule clipped (one entry a
    step: warned again whenever the embeddings are used)."""

    label: str
    blocks: str
    source: tuple[int, int, int, int]
    last_step: int
    derived: tuple[int, int]
    where: str | None  # the filter on the in-loop rows whose terms were summed (None: every row)
    stability: str
    clipped: tuple[dynamics.Clipped, ...]


def ensure(store: StoreCore, run: str, options: ScoreOptions) -> Selection:
    """The derived run's rows for ``run`` (``options``: the in-loop ``checkpoint`` label, ``blocks``, ``where``:
    the in-loop training rows whose terms are summed), built or extended first when the in-loop rows or the
    stability rule changed since (past the caller's snapshot: its later reads see the derived rows); an
    :class:`~gradstore.errors.UnstableStepWarning` when steps' curvature was clipped in them, built now or before.
    ``InvalidArgumentError`` for a ``split`` other than ``"train"`` or a ``where`` that matches none of the in-loop
    rows."""
    refuse_split("dvemb", options.split)
    check_where(store, run, options.where)
    with store.past_snapshot():
        return _ensure(store, run, options)


def _ensure(store: StoreCore, run: str, options: ScoreOptions) -> Selection:
    label = in_loop_checkpoint(store, run, options.checkpoint)
    where = options.where
    require_in_loop_rows(store, "dvemb", Selection(run, label, "train", where))
    structure = check_blocks(options.blocks)
    structure = auto_blocks(store, run) if structure == "auto" else structure
    derived = derived_run(run)
    _check_derived(store, run, derived)
    stored = _fresh(store, run, label, structure, where)
    if stored is None:
        store.require_writable(f"dvemb: build the derived run {derived!r} of data value embeddings")
        with store.files.writing(SIDE_FILES, _key(run)):  # one builder at a time; another may have built it meanwhile
            stored = _fresh(store, run, label, structure, where) or _build(store, run, label, structure, where)
    dynamics.warn_clipped(stored.clipped, run)
    return Selection(derived, variant(where), "train")


def _fresh(store: StoreCore, run: str, label: str, structure: str, where: str | None) -> EmbeddingState | None:
    """The stored state when the derived rows of ``where`` are up to date with the in-loop rows and were built under
    the current stability rule, else ``None``."""
    stored = _read_state(store, run, where)
    if stored is None or stored.where != where:
        return None
    built = _built(store, run, where)
    current = (label, structure, _source_state(store, run, label), built, dynamics.stability_rule())
    return stored if (stored.label, stored.blocks, stored.source, stored.derived, stored.stability) == current else None


def _built(store: StoreCore, run: str, where: str | None = None) -> tuple[int, int] | None:
    derived = derived_run(run)
    return Selection(derived, variant(where)).state(store) if store.has_run(derived) else None


def _build(store: StoreCore, run: str, label: str, structure: str, where: str | None = None) -> EmbeddingState:
    """Fold the new steps into the stored embeddings when only later steps were appended (under the same stability
    rule), else recompute all; the state written."""
    stored = _read_state(store, run, where)
    stability = dynamics.stability_rule()
    steps = recorded_steps(store, run, label)  # their dynamics are read chunk by chunk, as their rows
    dynamics.warn_unmodelled(store, run, label, "dvemb", [s.step for s in steps])
    kinds = dynamics.summary(store, run, label, steps)  # (every step plain SGD, some step with momentum)
    spans = _spans(store, run, structure)
    source = _source_state(store, run, label)
    incremental = (
        stored is not None
        and (stored.label, stored.blocks, stored.where, stored.stability) == (label, structure, where, stability)
        and stored.derived == _built(store, run, where)
        and _only_after(store, run, label, stored)
        and not kinds[1]  # momentum: the joint state, rebuilt
    )
    if incremental:
        new = [s for s in steps if s.step > stored.last_step]
        ids, embeddings, carried = recursion(store, run, label, new, spans, kinds, where)
        clipped = (*stored.clipped, *dynamics.per_step(carried.clipped))
        old = store.read_gradients(derived_run(run), checkpoint=variant(where), split="train")
        embeddings_by_id = dict(zip(ids, embeddings))
        previous = carried.apply(torch.from_numpy(old.vectors.astype(np.float64))).numpy()
        for example_id, vector in zip(old.metadata.column("example_id").to_pylist(), previous):
            embeddings_by_id[example_id] = embeddings_by_id.get(example_id, 0.0) + vector
        ids = sorted(embeddings_by_id)
        embeddings = np.stack([embeddings_by_id[i] for i in ids]) if ids else np.empty((0, store.run_dim(run)))
        log.info("dvemb: folded %d new step(s) of run %r into %d embeddings", len(new), run, len(ids))
    else:
        ids, embeddings, carried = recursion(store, run, label, steps, spans, kinds, where)
        clipped = tuple(dynamics.per_step(carried.clipped))
    del carried  # the product let go before the write
    written = _write(store, run, ids, embeddings, steps[-1].step, where)
    state = EmbeddingState(label, structure, source, steps[-1].step, written, where, stability, clipped)
    _write_state(store, run, state)
    return state


def _check_derived(store: StoreCore, run: str, derived: str) -> None:
    """``InvalidArgumentError`` when a run named like the derived one exists but was not derived from ``run``."""
    if store.has_run(derived) and store.run_config(derived).get("derived_from") != run:
        raise InvalidArgumentError(
            f"run {derived!r} exists and holds rows not derived from {run!r}: dvemb keeps {run!r}'s embeddings "
            f"under that name; rename or delete that run first"
        )


def history(
    store: StoreCore, queries: QueryInput, options: ScoreOptions, run: str, selection: Selection | None = None
) -> History:
    """``dvemb`` as a per-example sum: final-model queries against the derived run's embeddings (``selection``:
    those rows, else :func:`ensure`'s for ``options``)."""
    resolved = final_queries(store, queries, run, options.query_checkpoint)
    selection = ensure(store, run, options) if selection is None else selection
    vectors = torch.from_numpy(np.asarray(resolved.vectors, np.float64))
    return History(resolved.ids, [(selection.filter, vectors, None)], selection, ("example_id",), [LABEL])


# ---------------------------------------------------------------------------------------------- the recursion
def recursion(
    store: StoreCore,
    run: str,
    label: str,
    steps: Sequence[RecordedStep],
    spans: Sequence[tuple[int, int]],
    kinds: tuple[bool, bool],
    where: str | None = None,
) -> tuple[list[str], np.ndarray, BlockDiagonal | dynamics.JointProduct]:
    """The embeddings of the examples of ``steps`` (ids sorted, float64 ``[n, dim]``) over these steps alone, and
    the per-block products ``prod (I - lr H)^s`` over them (what earlier embeddings are carried through).
    ``kinds``: :func:`dynamics.summary` of the run's recorded steps, which picks the product carried. ``where``:
    only the training rows it selects add their terms; every step's curvature and batch size stay the whole
    step's, so the embeddings are the effect of the selected rows' loss weights through the recorded trajectory.
    The steps whose curvature was clipped are the product's ``clipped`` (the caller keeps and warns them)."""
    carried = carrier(spans, *kinds, run)
    ids = _example_ids(store, run, label, steps, where)
    chosen = None if where is None else Selection(run, label, "train", where).grad_ids(store)
    position = {example_id: i for i, example_id in enumerate(ids)}
    sums = torch.zeros(len(ids), store.run_dim(run), dtype=torch.float64)  # the result, in place: never regrown
    for step, rows, example_ids, grad_ids, curvature in _steps(store, run, label, steps):
        if chosen is not None:  # the curvature rows are the step's own, whatever the filter
            keep = np.isin(grad_ids, chosen)
            rows = rows[torch.from_numpy(keep)]
            example_ids = [example_id for example_id, kept in zip(example_ids, keep) if kept]
        columns = torch.tensor([position[example_id] for example_id in example_ids], dtype=torch.long)
        sums.index_add_(0, columns, carried.absorb(rows, curvature, step))
    embeddings = sums.numpy()
    dynamics.check_embeddings(embeddings, run, carried.first_large)
    return ids, embeddings, carried


def _example_ids(
    store: StoreCore, run: str, label: str, steps: Sequence[RecordedStep], where: str | None = None
) -> list[str]:
    """The ids of the examples with training rows in ``steps`` (of those ``where`` selects), sorted: read from the
    metadata alone first, so
    the ``[examples, dim]`` float64 sums are allocated once at their final size and in their final order (growing
    them by doubling, then sorting, held up to 2.5x their size at once)."""
    if not steps:
        return []
    span = (steps[0].step, steps[-1].step)
    table = store.scan(
        store.gradient_table_name(run),
        ["example_id", "step"],
        gradient_filter(run, label, "train", span, where),
        cache=False,
    )
    wanted = np.isin(table.column("step").to_numpy(zero_copy_only=False), [s.step for s in steps])
    return sorted(set(table.column("example_id").filter(pa.array(wanted)).to_pylist()))


def carrier(
    spans: Sequence[tuple[int, int]], plain: bool, momentum: bool, run: str = ""
) -> BlockDiagonal | dynamics.JointProduct:
    """The product the recursion carries: :class:`BlockDiagonal` (``prod (I - lr H)``) when every step is plain
    SGD (or has no recorded optimizer), else the joint parameter/momentum one of :mod:`gradstore.methods.dynamics`
    (``R_n`` only with ``momentum``): :func:`dynamics.summary` of the steps."""
    if plain:
        return BlockDiagonal(spans, run)
    return dynamics.JointProduct(spans, momentum, run)


class BlockDiagonal:
    """One ``d_b x d_b`` float64 matrix per layer block of the projected vector (one batched tensor when the
    blocks are of one size, the usual case: a capture's per-layer sizes)."""

    def __init__(self, spans: Sequence[tuple[int, int]], run: str = "") -> None:
        """The identity (no steps yet)."""
        self.spans = list(spans)
        self.run = run
        self.clipped: list[dynamics.Clipped] = []  # steps whose curvature was clipped to the stable range
        self.first_large: list[int] = []
        sizes = {size for _, size in self.spans}
        contiguous = all(offset == i * self.spans[0][1] for i, (offset, _) in enumerate(self.spans))
        self.batched: torch.Tensor | None = None
        self.matrices: list[torch.Tensor] = []  # not both: a full block is dim^2 float64
        if len(sizes) == 1 and contiguous:
            self.batched = torch.zeros(len(self.spans), self.spans[0][1], self.spans[0][1], dtype=torch.float64)
            self.batched.diagonal(dim1=1, dim2=2).fill_(1.0)
        else:
            self.matrices = [torch.eye(size, dtype=torch.float64) for _, size in self.spans]

    def _split(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [n, dim]`` as ``[blocks, n, size]`` (batched layout only)."""
        return rows.reshape(rows.shape[0], len(self.spans), self.spans[0][1]).transpose(0, 1)

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """``M_b g_b`` for every row ``g`` (float64 ``[n, dim]``)."""
        if self.batched is not None:
            moved = torch.bmm(self._split(rows), self.batched.transpose(1, 2))
            return moved.transpose(0, 1).reshape(rows.shape)
        out = torch.empty_like(rows)
        for matrix, (offset, size) in zip(self.matrices, self.spans):
            out[:, offset : offset + size] = rows[:, offset : offset + size] @ matrix.T
        return out

    def absorb(self, rows: torch.Tensor, curvature_rows: torch.Tensor, step: RecordedStep) -> torch.Tensor:
        """The step's terms ``lr s / B M g`` of its training rows, then ``M`` carried through the step."""
        terms = self.apply(rows) * step.weight
        self.carry(curvature_rows, step)
        return terms

    def carry(self, curvature_rows: torch.Tensor, step: RecordedStep) -> None:
        """``M_b <- M_b (I - lr H_b)^span`` with ``H_b = C_b^T C_b / n`` of the step's curvature rows ``C`` (its
        eigenvalues above ``2 / lr`` clipped there: :func:`dynamics.stable_rows`)."""
        rate = step.learning_rate / max(1, curvature_rows.shape[0])
        plain = dynamics.Coefficients.plain(step.learning_rate)
        if self.batched is not None:
            rows = dynamics.stable_rows(self._split(curvature_rows), plain, None, step.step, self.clipped)
            self.batched = _carried(self.batched, rows, rate, step.span)
            dynamics.check_finite([self.batched], step.step, self.run, self.first_large)
            return
        self.matrices = [
            _carried(
                matrix[None],
                dynamics.stable_rows(
                    curvature_rows[None, :, offset : offset + size], plain, None, step.step, self.clipped
                ),
                rate,
                step.span,
            )[0]
            for matrix, (offset, size) in zip(self.matrices, self.spans)
        ]
        dynamics.check_finite(self.matrices, step.step, self.run, self.first_large)


def _carried(products: torch.Tensor, curvature: torch.Tensor, rate: float, span: int) -> torch.Tensor:
    """``P (I - rate C^T C)^span`` for batched ``P [b, s, s]`` and ``C [b, n, s]``. One step: two products. More:
    through the eigendecomposition of the smaller Gram matrix, ``C C^T = U diag(mu) U^T`` (``n x n``), as
    ``P + (P C^T U) diag(((1 - rate mu)^span - 1) / mu) (U^T C)`` (the factor is the identity off ``C``'s rows),
    or of ``C^T C`` itself when it is the smaller one. ``P`` is updated in place where the result is ``P`` plus a
    low-rank term (no second ``s x s`` matrix per block: at full dimension one is hundreds of MB)."""
    if span == 1:
        return products.baddbmm_(torch.bmm(products, curvature.transpose(1, 2)), curvature, alpha=-rate)
    if curvature.shape[1] < curvature.shape[2]:
        values, vectors = torch.linalg.eigh(torch.bmm(curvature, curvature.transpose(1, 2)))
        safe = torch.where(values > 0, values, torch.ones_like(values))
        weights = torch.where(
            values > 0, ((1 - rate * values) ** span - 1) / safe, -rate * span * torch.ones_like(values)
        )
        rows = torch.bmm(vectors.transpose(1, 2), curvature)  # U^T C: [b, n, s]
        return products.baddbmm_(torch.bmm(products, rows.transpose(1, 2)) * weights[:, None, :], rows)
    values, vectors = torch.linalg.eigh(torch.bmm(curvature.transpose(1, 2), curvature))
    factor = torch.bmm(vectors * ((1 - rate * values) ** span)[:, None, :], vectors.transpose(1, 2))
    return torch.bmm(products, factor)


def _steps(
    store: StoreCore, run: str, label: str, steps: Sequence[RecordedStep]
) -> Iterator[tuple[RecordedStep, torch.Tensor, list[str], np.ndarray, torch.Tensor]]:
    """The rows of ``steps``, last step first: ``(step with its dynamics, training rows float64, their example
    ids, their grad_ids, curvature rows)`` (true-Fisher rows of the step where it has any, else all its training
    rows). They are read in chunks of consecutive
    steps of about ``CHUNK_BYTES`` of float32 rows whatever the dimension (at least one step), with the chunk's
    recorded dynamics, one chunk in memory at a time (each step's rows are taken from it in float64 as the step
    comes, and a chunk is let go before the next is read), so memory does not grow with the number of steps."""
    name = store.gradient_table_name(run)
    span = (steps[0].step, steps[-1].step) if steps else (None, None)
    fisher_rows = store.scan(
        name, ["step"], gradient_filter(run, label, [TRUE_FISHER_SPLIT], span), cache=False
    ).num_rows
    # float32 bytes a training row brings into a chunk: itself and its share of the steps' true-Fisher rows
    row_bytes = 4 * store.run_dim(run) * (1 + fisher_rows / max(1, sum(s.rows for s in steps)))
    budget = max(1, int(CHUNK_BYTES // row_bytes))
    groups: list[list[RecordedStep]] = [[]]
    for step in steps:
        if groups[-1] and sum(s.rows for s in groups[-1]) + step.rows > budget:
            groups.append([])
        groups[-1].append(step)
    for group in reversed([g for g in groups if g]):
        block = store.read_gradients(
            run,
            checkpoint=label,
            split=["train", TRUE_FISHER_SPLIT],
            steps=(group[0].step, group[-1].step),
            columns=("example_id", "step", "split"),
        )
        fisher = pc.equal(block.metadata.column("split"), TRUE_FISHER_SPLIT).to_numpy(zero_copy_only=False)
        order = np.lexsort((fisher, block.metadata.column("step").to_numpy(zero_copy_only=False)))
        step_column = block.metadata.column("step").to_numpy(zero_copy_only=False)[order]
        fisher = fisher[order]
        ids = block.metadata.column("example_id").take(pa.array(order)).to_pylist()
        for record in reversed(dynamics.with_dynamics(store, run, label, group)):
            start, end = np.searchsorted(step_column, [record.step, record.step + 1])
            middle = start + int(np.count_nonzero(~fisher[start:end]))  # training rows first, then true-Fisher rows
            rows = torch.from_numpy(block.vectors[order[start:middle]].astype(np.float64))
            curvature = torch.from_numpy(block.vectors[order[middle:end]].astype(np.float64)) if end > middle else rows
            yield record, rows, ids[start:middle], block.grad_ids[order[start:middle]], curvature
        del block


# ---------------------------------------------------------------------------------------------- storage
def _spans(store: StoreCore, run: str, structure: str) -> list[tuple[int, int]]:
    if structure == "layer":
        return [(s.offset, s.size) for s in store.run_spec(run, "dvemb with blocks='layer'").layers]
    return [(0, store.run_dim(run))]


def _source_state(store: StoreCore, run: str, label: str) -> tuple[int, int, int, int]:
    return (*Selection(run, label).state(store), *Selection(run, label, TRUE_FISHER_SPLIT).state(store))


def _only_after(store: StoreCore, run: str, label: str, stored: EmbeddingState) -> bool:
    """Whether the in-loop rows the stored state covered are unchanged and every other row belongs to a step
    after its last one (rows appended by training that went on)."""
    name = store.gradient_table_name(run)
    splits = ["train", TRUE_FISHER_SPLIT]
    covered = store.scan(name, ["step"], gradient_filter(run, label, splits, (None, stored.last_step))).num_rows
    later = store.scan(name, ["step"], gradient_filter(run, label, splits, (stored.last_step + 1, None))).num_rows
    return covered == stored.source[0] + stored.source[2] and later > 0


def _write(
    store: StoreCore, run: str, ids: list[str], embeddings: np.ndarray, last_step: int, where: str | None = None
) -> tuple[int, int]:
    """Replace the derived run's rows of ``where`` (:func:`variant`) with ``embeddings``: a filtered variant
    replaces the previous one (one is kept besides the unfiltered rows); the variant's new ``(rows, largest
    grad_id)``."""
    derived = derived_run(run)
    label = variant(where)
    source = store.run(run)
    projection = json.loads(source["projection"]) if source["projection"] else None
    store.create_run(
        derived,
        dim=store.run_dim(run),
        projection=projection,
        model_fingerprint=source["model_fingerprint"],
        config={"derived_from": run, "method": "dvemb"},
        exist_ok=True,
    )
    table = store.gradient_table(derived)
    if where is None:
        table.delete(gradient_filter(derived, LABEL))
    else:
        table.delete(f"{gradient_filter(derived)} AND checkpoint <> {sql_literal(LABEL)}")
    with store.writer(derived) as writer:
        for start in range(0, len(ids), CHUNK_ROWS):
            writer.append(
                embeddings[start : start + CHUNK_ROWS].astype(np.float32),
                ids[start : start + CHUNK_ROWS],
                checkpoint=label,
                split="train",
                step=last_step,
            )
    if where is None:  # a filtered variant is no checkpoint of the derived run's own (its latest stays dvemb)
        store.record_checkpoint(derived, LABEL, step=last_step)
    return Selection(derived, label).state(store)


def _key(run: str) -> str:
    return hashlib.sha256(run.encode()).hexdigest()[:32]


def _state_file(where: str | None) -> str:
    return STATE_FILE if where is None else f"{variant(where)}.json"


def _read_state(store: StoreCore, run: str, where: str | None = None) -> EmbeddingState | None:
    try:
        data = json.loads(store.files.read_bytes(SIDE_FILES, _key(run), _state_file(where)))
        return EmbeddingState(
            data["label"],
            data["blocks"],
            tuple(data["source"]),
            int(data["last_step"]),
            tuple(data["derived"]),
            data["where"],
            data["stability"],
            tuple(dynamics.Clipped(**entry) for entry in data["clipped"]),
        )
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):  # also a state written before a field it now has
        log.warning("dvemb state of run %r is damaged or outdated; rebuilding its embeddings", run)
        return None


def _write_state(store: StoreCore, run: str, state: EmbeddingState) -> None:
    """Write the state, in the file of its ``where`` (the caller holds the key's writers' lock)."""
    store.files.write_bytes(json.dumps(asdict(state)).encode(), SIDE_FILES, _key(run), _state_file(state.where))


# ---------------------------------------------------------------------------------------------- the family
@dataclass(frozen=True)
class Embeddings(HistorySum):
    """Data value embeddings: each training example's embedding ``e_z`` is kept as a row of the derived run
    :func:`derived_run` (built, or extended with the steps recorded since, by :func:`ensure`), and a query scores
    ``q . e_z`` with its final-model gradient: a grad-dot search of the derived run."""

    name: str
    summary: str
    requires: str = ""
    operations: frozenset[str] = frozenset({"attribute", "score_matrix", "self_influence", "select", "build_index"})

    @property
    def uses(self) -> frozenset[str]:
        return ONE_CHECKPOINT | {"blocks"}  # a search of one checkpoint's rows (the derived run's), blocks for H_s

    def read_only_refusal(self, run: str, error: Exception) -> str | None:
        if derived_run(run) not in str(error):
            return None
        return (
            f"method={self.name!r} reads the derived run {derived_run(run)}, which is not built (or not up to date) "
            f"and this server is read-only: the operator builds it with `gradstore attribute STORE --run {run} "
            f"--method {self.name} -k 1 --no-write`, with the call's --where if it has one (or serves with "
            "--allow-writes)"
        )

    def check_selection(self, store: StoreCore, options: ScoreOptions, run: str) -> None:
        """Checked where every call reads the embeddings (:func:`ensure`), once."""

    def history(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, run: str
    ) -> History:
        return history(store, queries, options, run)

    def self_influence(
        self, store: StoreCore, fits: FitCache, options: ScoreOptions, *, run: str, engine: Engine
    ) -> pa.Table:
        """Each example's final-model row against its embedding: ``where`` picks the final rows and the in-loop
        rows summed into the embeddings (built once), the chunks of examples only the embeddings' rows."""
        embeddings = ensure(store, run, options)

        def chunk_history(store: StoreCore, queries: QueryInput, narrowed: ScoreOptions, run: str) -> History:
            rows = Selection(embeddings.run, embeddings.checkpoint, "train", narrowed.where)
            return history(store, queries, narrowed, run, rows)

        return history_self_influence(
            store,
            chunk_history,
            options,
            final=final_training_checkpoint(store, run, options.split),
            method=self.name,
            run=run,
            engine=engine,
            chunk_only=True,  # the embeddings hold the example ids only; where was summed into them already
        )

    def _queries_and_rows(
        self, store: StoreCore, queries: QueryInput, options: ScoreOptions, run: str
    ) -> tuple[Queries, Selection]:
        return final_queries(store, queries, run, options.query_checkpoint), ensure(store, run, options)

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
        resolved, selection = self._queries_and_rows(store, queries, options, run)
        return index_top_k(
            store,
            fits,
            resolved,
            selection,
            GRAD_DOT,
            options,
            self.name,
            run=run,
            k=k,
            opponents=opponents,
            engine=engine,
            blocks="auto",
        )

    def matrix(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
    ) -> ScoreMatrix:
        resolved, selection = self._queries_and_rows(store, queries, options, run)
        return dense_matrix(store, fits, resolved, selection, GRAD_DOT, "auto", options.damping)

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
        selection = ensure(store, run, options)
        require_rows(store, selection)
        return build_index(
            store,
            fits,
            selection,
            GRAD_DOT,
            damping=options.damping,
            kind=options.kind,
            name=name,
            blocks="auto",
            refit=refit,
            engine=engine,
            device=options.device,
        )
