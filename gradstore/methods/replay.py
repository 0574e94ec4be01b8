"""``replay``: exact metagradients of query losses with respect to every training example's weight, computed by
replaying the recorded run (:mod:`gradstore.answers.replay`, ``store.replay(...)``) and kept in the store.

A replay writes, per run, the matrix ``scores[q, z] = -d L_q(theta_T) / d eps_z`` (``eps_z`` the weight of example
``z``'s loss in every step that drew it, 1 in the recorded run: positive means up-weighting ``z`` lowers the
query's final loss, the sign of every other method) with its query and example ids, as two side files under
``replay/<hash of the run>/``: ``replay.json`` (ids, the in-loop rows it replayed, how) and ``scores.npy`` (float64,
written and read with ``allow_pickle=False``: no code in the store). A later replay of other queries adds its rows
(a query replayed again replaces its row); one over other recorded rows (the run went on) or at another ``weight``
replaces them all.

:class:`Replayed` is the family of ``method="replay"``: ``attribute`` and ``score_matrix`` read the stored matrix
(queries: ``None`` for every replayed query, or a list of their ids); asking for queries no replay computed, or
after the run's in-loop rows changed, is a :class:`~gradstore.errors.MissingReplayError` saying to replay.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from gradstore.core import StoreCore
from gradstore.core.engine import Engine
from gradstore.errors import InvalidArgumentError, MissingReplayError
from gradstore.methods.queries import QueryInput, stored_queries
from gradstore.methods.registry import Method, ScoreOptions
from gradstore.methods.results import ScoreMatrix, example_table
from gradstore.preconditioning.fitting import FitCache, Selection

SIDE_FILES = "replay"
STATE_FILE = "replay.json"
SCORES_FILE = "scores.npy"


@dataclass
class ReplayScores:
    """A run's replayed metagradients: ``scores[q, z] = -d L_q / d eps_z`` (float64 ``[queries, examples]``) and
    what they were computed from (the in-loop ``label`` and its rows' ``(rows, digest of their grad_ids)``, the
    number of steps, the optimizer, the query losses at the end of the replay)."""

    query_ids: list[str]
    example_ids: list[str]
    scores: np.ndarray
    label: str
    source: tuple[int, int]
    steps: int
    optimizer: str
    losses: list[float] = field(default_factory=list)
    weight: float = 1.0  # every example's weight where the derivative was taken (1: the recorded run)

    def rows(self, query_ids: list[str]) -> ReplayScores:
        """The rows of ``query_ids`` (each replayed)."""
        position = {q: i for i, q in enumerate(self.query_ids)}
        order = [position[q] for q in query_ids]
        losses = [self.losses[i] for i in order] if self.losses else []
        return ReplayScores(
            list(query_ids),
            self.example_ids,
            self.scores[order],
            self.label,
            self.source,
            self.steps,
            self.optimizer,
            losses,
            self.weight,
        )


def source_state(store: StoreCore, run: str, label: str) -> tuple[int, int]:
    """``(rows, digest of their grad_ids)`` of the in-loop training rows under ``label``: a replay of other rows
    is stale."""
    return Selection(run, label, "train").state(store)


def save(store: StoreCore, run: str, replayed: ReplayScores) -> ReplayScores:
    """Keep ``replayed`` for ``run``, merged with the stored replay of the same rows (its other queries kept); the
    matrix now stored."""
    store.require_writable("replay: keep the replayed metagradients")
    with store.files.writing(SIDE_FILES, _key(run)):
        stored = _read(store, run)
        if stored is not None and (stored.label, stored.source, stored.example_ids, stored.steps, stored.weight) == (
            replayed.label,
            replayed.source,
            replayed.example_ids,
            replayed.steps,
            replayed.weight,
        ):
            kept = [q for q in stored.query_ids if q not in set(replayed.query_ids)]
            if kept:
                earlier = stored.rows(kept)
                losses = earlier.losses + replayed.losses if earlier.losses and replayed.losses else []
                replayed = ReplayScores(
                    kept + replayed.query_ids,
                    replayed.example_ids,
                    np.concatenate([earlier.scores, replayed.scores]),
                    replayed.label,
                    replayed.source,
                    replayed.steps,
                    replayed.optimizer,
                    losses,
                    replayed.weight,
                )
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(replayed.scores, np.float64), allow_pickle=False)
        state = {
            "query_ids": replayed.query_ids,
            "example_ids": replayed.example_ids,
            "label": replayed.label,
            "source": list(replayed.source),
            "steps": replayed.steps,
            "optimizer": replayed.optimizer,
            "losses": replayed.losses,
            "weight": replayed.weight,
        }
        store.files.write_bytes(buffer.getvalue(), SIDE_FILES, _key(run), SCORES_FILE)
        store.files.write_bytes(json.dumps(state).encode(), SIDE_FILES, _key(run), STATE_FILE)
    return replayed


def load(store: StoreCore, run: str) -> ReplayScores:
    """The stored replay of ``run``, current with its in-loop rows; ``MissingReplayError`` otherwise."""
    store.run(run)
    with store.files.reading(SIDE_FILES, _key(run)):
        stored = _read(store, run)
    if stored is None:
        raise MissingReplayError(
            f"run {run!r} has no replay: compute the exact metagradients first with store.replay(query_ids, "
            f"run={run!r}, model_fn=..., batch_fn=..., loss_fn=..., optimizer=...), then attribute with "
            "method='replay'"
        )
    if source_state(store, run, stored.label) != stored.source:
        raise MissingReplayError(
            f"the replay of run {run!r} was computed over other in-loop rows than {stored.label!r} holds now (rows "
            "were added or deleted since): run store.replay(...) again"
        )
    return stored


def _read(store: StoreCore, run: str) -> ReplayScores | None:
    try:
        state = json.loads(store.files.read_bytes(SIDE_FILES, _key(run), STATE_FILE))
        scores = np.load(io.BytesIO(store.files.read_bytes(SIDE_FILES, _key(run), SCORES_FILE)), allow_pickle=False)
    except FileNotFoundError:
        return None
    return ReplayScores(
        [str(q) for q in state["query_ids"]],
        [str(z) for z in state["example_ids"]],
        np.asarray(scores, np.float64),
        str(state["label"]),
        (int(state["source"][0]), int(state["source"][1])),
        int(state["steps"]),
        str(state["optimizer"]),
        [float(x) for x in state.get("losses", [])],
        float(state.get("weight", 1.0)),
    )


def _key(run: str) -> str:
    return hashlib.sha256(run.encode()).hexdigest()[:32]


def replayed_queries(store: StoreCore, run: str, queries: QueryInput) -> ReplayScores:
    """The stored replay's rows of ``queries`` (``None``: every replayed query; else a list of query ids)."""
    stored = load(store, run)
    if queries is None:
        return stored
    if isinstance(queries, str) or not stored_queries(queries):
        raise InvalidArgumentError(
            "method='replay' reads the replayed queries by id: pass a list of query ids (or None for every one), "
            f"not {type(queries).__name__}"
        )
    wanted = [str(q) for q in queries]
    if not wanted:
        raise InvalidArgumentError("an empty list of query ids selects no queries (pass None for all)")
    missing = [q for q in wanted if q not in set(stored.query_ids)]
    if missing:
        raise MissingReplayError(
            f"queries {missing[:10]} of run {run!r} were not replayed (replayed: {stored.query_ids[:10]}): run "
            f"store.replay({missing[:3]!r}, run={run!r}, ...) for them first"
        )
    return stored.rows(wanted)


# ---------------------------------------------------------------------------------------------- the family
@dataclass(frozen=True)
class Replayed(Method):
    """Exact metagradients from a replay of the recorded run (:func:`gradstore.answers.replay.replay`): the
    methods read the stored matrix; they compute nothing."""

    name: str
    summary: str
    requires: str = ""
    operations: frozenset[str] = frozenset({"attribute", "score_matrix"})

    @property
    def uses(self) -> frozenset[str]:
        return frozenset()

    @property
    def reads_history(self) -> bool:
        return True

    def _rows(self, store: StoreCore, queries: QueryInput, options: ScoreOptions, run: str) -> ReplayScores:
        if options.where is not None or options.split != "train":
            raise InvalidArgumentError(
                f"method={self.name!r} scores every example the replayed run trained on: remove where= and split="
            )
        return replayed_queries(store, run, queries)

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
        if engine.name != "local":
            raise InvalidArgumentError(
                f"attribute(method='replay') reads the scores store.replay(...) kept; it runs no search on an "
                f"engine: leave engine= at 'local' (got {engine.name!r})"
            )
        rows = self._rows(store, queries, options, run)
        return top_k_table(rows, k=k, opponents=opponents, method=self.name, run=run)

    def matrix(
        self, store: StoreCore, fits: FitCache, queries: QueryInput, options: ScoreOptions, *, run: str
    ) -> ScoreMatrix:
        rows = self._rows(store, queries, options, run)
        return ScoreMatrix(
            rows.scores.astype(np.float32),
            rows.query_ids,
            rows.example_ids,
            np.full(len(rows.example_ids), -1, np.int64),
        )


def top_k_table(rows: ReplayScores, *, k: int, opponents: bool, method: str, run: str) -> pa.Table:
    """The top-k (ranks 1..k) and with ``opponents`` bottom-k (-1..-k) examples of each query as a ``scores``
    table (ties: the smaller example id first)."""
    ids = np.asarray(rows.example_ids, dtype=object)
    by_id = np.argsort(ids, kind="stable")
    sides = (True, False) if opponents else (True,)
    found = {}
    for side in sides:
        values = rows.scores[:, by_id]
        order = by_id[np.argsort(-values if side else values, axis=1, kind="stable")[:, :k]]
        found[side] = (np.take_along_axis(rows.scores, order, axis=1), ids[order])
    return example_table(found, list(rows.query_ids), sides, method=method, run=run, checkpoint=rows.label)
