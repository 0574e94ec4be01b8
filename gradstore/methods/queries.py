"""Resolving what the user calls "queries" into query ids and vectors.

Accepted forms:
- ``None``: every ``split = 'query'`` row of the run at the query checkpoint (below);
- a ``str``: a SQL filter on the gradients table (e.g. ``"split = 'query' AND example_id LIKE 'q1%'"``);
- a list of example ids: the run's query rows with those ids (``KeyError`` naming any missing id);
- a :class:`QueryBatch` (a model and a batch): captured on the fly with the run's projection, not stored;
- an array ``[q, dim]``: raw query vectors (ids ``"vector:0"``, ``"vector:1"``, ...: :func:`vector_query_ids`).

Stored queries (the first three forms) are read at the *query checkpoint*: ``query_checkpoint=`` when given;
else the checkpoint of the training rows when the run has query rows there; else the one checkpoint the run's
query rows were captured at (queries captured on the final model, attributed against rows captured during
training). Query rows at several other checkpoints and none at the training rows' one: pass
``query_checkpoint=``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from gradstore.capture.session import config_for_run
from gradstore.core import StoreCore, sql_in
from gradstore.core.catalog import check_spec
from gradstore.core.filters import check_filter
from gradstore.core.writer import VECTOR_QUERY_PREFIX
from gradstore.errors import InvalidArgumentError, MissingIdsError
from gradstore.methods.rows import row_checkpoints
from gradstore.search.arguments import check_query_vectors, query_array
from ingest import GradientCapture


@dataclass
class QueryBatch:
    """Queries given as a model and a batch: their gradients are captured with the run's projection.

    ``batch`` is passed to ``loss_fn(model, batch)`` (default: ``model(**batch).loss``) and backpropagated
    with the model's gradients left untouched afterwards. ``ids`` name the queries (else an ``example_id``
    entry of the batch, else content hashes). ``options`` override capture options such as ``loss_reduction``.
    """

    model: torch.nn.Module
    batch: Any
    ids: Sequence[str] | None = None
    loss_fn: Any = None
    options: dict[str, Any] = field(default_factory=dict)


QueryInput = Union[None, str, Sequence[str], QueryBatch, np.ndarray, torch.Tensor]
"""Every form :func:`resolve_queries` accepts (see the module docstring)."""


@dataclass
class Queries:
    """Resolved queries: one id and one raw vector per query."""

    ids: list[str]
    vectors: np.ndarray  # float32 [q, dim]


def vector_query_ids(n: int) -> list[str]:
    """The ids of ``n`` queries given as raw vectors: ``"vector:0"``, ``"vector:1"``, ... The prefix
    (:data:`~gradstore.core.writer.VECTOR_QUERY_PREFIX`) is refused as the start of a stored row's example id, so
    these never name a stored query as well."""
    return [f"{VECTOR_QUERY_PREFIX}{i}" for i in range(n)]


def check_queries(queries: QueryInput, name: str = "queries") -> QueryInput:
    """``queries`` (argument ``name`` of a scoring call) if it is one of the accepted forms (the module docstring;
    ids given as any iterable come back as a list, read once): an ``InvalidArgumentError`` listing the forms
    otherwise (a number, bytes, an array of strings, a list of vectors)."""
    if queries is None or isinstance(queries, (str, QueryBatch, torch.Tensor)):
        return queries
    if isinstance(queries, np.ndarray):
        if np.issubdtype(queries.dtype, np.number):
            return queries
        problem = f"an array of {queries.dtype} (query ids go in a list: {name}=array.tolist())"
    elif isinstance(queries, Iterable) and not isinstance(queries, (bytes, bytearray, Mapping)):
        queries = list(queries)
        odd = [q for q in queries if not isinstance(q, str) and isinstance(q, (bool, float, bytes, Iterable))]
        if not odd:
            return queries
        problem = f"a list holding {type(odd[0]).__name__} {odd[0]!r} (vectors go in one array [q, dim])"
    else:
        problem = f"{type(queries).__name__} {queries!r}"
    raise InvalidArgumentError(
        f"{name}= takes None (every stored query row), a SQL filter string, a list of query example ids, a "
        f"QueryBatch or query vectors [q, dim]; got {problem}"
    )


def stored_queries(queries: QueryInput) -> bool:
    """Whether ``queries`` names stored query rows (``None``, a filter or ids) rather than giving vectors."""
    return not isinstance(queries, (QueryBatch, np.ndarray, torch.Tensor))


def query_checkpoint_for(
    store: StoreCore, run: str, checkpoint: str | None, query_checkpoint: str | None
) -> str | None:
    """The checkpoint stored queries of ``run`` are read at when its training rows are at ``checkpoint`` (the
    rule in the module docstring)."""
    if query_checkpoint is not None:
        if not isinstance(query_checkpoint, str) or not query_checkpoint:
            raise InvalidArgumentError(f"query_checkpoint must be a non-empty string, got {query_checkpoint!r}")
        return query_checkpoint
    found = row_checkpoints(store, run, "query")
    if checkpoint in found or not found:
        return checkpoint
    if len(found) == 1:
        return found[0]
    raise InvalidArgumentError(
        f"run {run!r} has query rows at checkpoints {found} and none at the training rows' checkpoint "
        f"{checkpoint!r}: pass query_checkpoint=... (one of {found})"
    )


def resolve_queries(
    store: StoreCore, queries: QueryInput, run: str, checkpoint: str | None, query_checkpoint: str | None = None
) -> Queries:
    """Turn any accepted query form into :class:`Queries` for ``run``'s training rows at ``checkpoint``; stored
    queries are read at :func:`query_checkpoint_for`."""
    dim = store.run(run)["dim"]
    if query_checkpoint is not None and not stored_queries(queries):
        raise InvalidArgumentError(
            "query_checkpoint= picks stored query rows; queries given as vectors or a QueryBatch have none: remove it"
        )
    if stored_queries(queries):
        checkpoint = query_checkpoint_for(store, run, checkpoint, query_checkpoint)
    if isinstance(queries, QueryBatch):
        resolved = capture_queries(store, queries, run, checkpoint)
    elif isinstance(queries, (np.ndarray, torch.Tensor)):
        vectors = query_array(queries)
        resolved = Queries(vector_query_ids(len(vectors)), vectors)
    elif queries is None or isinstance(queries, str):
        where = "split = 'query'" if queries is None else check_filter(queries)
        try:
            block = store.read_gradients(run, checkpoint=checkpoint, where=where)
        except (InvalidArgumentError, ValueError) as error:  # Lance's "Invalid user input": a bad filter
            if queries is None:
                raise
            raise InvalidArgumentError(
                f"the filter {queries!r} did not run ({str(error).split(', /')[0]}); a string of queries is a SQL "
                "filter on the rows (e.g. \"split = 'query' AND example_id = 'q1'\"): to name query example ids "
                f"pass a list, queries=[{queries!r}]"
            ) from error
        resolved = Queries(block.metadata.column("example_id").to_pylist(), block.vectors)
    else:
        wanted = [str(q) for q in queries]
        if not wanted:
            raise InvalidArgumentError("an empty list of query ids selects no queries (pass None for all)")
        block = store.read_gradients(run, checkpoint=checkpoint, split="query", where=sql_in("example_id", wanted))
        found = block.metadata.column("example_id").to_pylist()
        missing = sorted(set(wanted) - set(found))
        if missing:
            held = [c for c in row_checkpoints(store, run, "query") if c != checkpoint]
            elsewhere = f"pass query_checkpoint= (the run holds query rows at {held}) or " if held else ""
            raise MissingIdsError(
                f"no query rows for example ids {missing[:10]} in run {run!r} at checkpoint "
                f"{checkpoint!r}: {elsewhere}capture them with split='query'"
            )
        position = {qid: i for i, qid in enumerate(found)}
        order = [position[q] for q in wanted]
        resolved = Queries(wanted, block.vectors[order])
    if not resolved.ids:
        found = row_checkpoints(store, run, "query")
        hint = (
            f"query rows exist at checkpoints {found}: pass query_checkpoint=..."
            if found
            else "capture query rows with store.capture(model, run=..., split='query'), or pass vectors"
        )
        raise InvalidArgumentError(f"no queries selected in run {run!r} at checkpoint {checkpoint!r}; {hint}")
    check_query_vectors(resolved.vectors, dim, f"run {run!r}")
    return resolved


def capture_queries(store: StoreCore, queries: QueryBatch, run: str, checkpoint: str) -> Queries:
    """Capture the gradients of a :class:`QueryBatch` with the run's projection (nothing is stored)."""
    config = config_for_run(store, run, {"split": "query", "checkpoint": checkpoint, **queries.options})
    collected: list[Any] = []
    model = queries.model
    saved_grads = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    try:
        capture = GradientCapture(model, collected.append, config)
        check_spec(store.run_spec(run), capture.spec)
        with capture:
            if queries.ids is not None:
                capture.set_ids(list(queries.ids))
            loss = queries.loss_fn(model, queries.batch) if queries.loss_fn else model(**queries.batch).loss
            loss.backward()
    finally:
        for name, p in model.named_parameters():  # leave the model's gradients as they were
            p.grad = saved_grads[name]
    ids = [i for batch in collected for i in batch.example_ids]
    vectors = torch.cat([batch.grads for batch in collected]).numpy() if collected else np.empty((0, 0), np.float32)
    return Queries(ids, vectors)
