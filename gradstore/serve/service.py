"""What a ``gradstore serve`` process does for one request, whatever the wire: the allowed calls of the store's
read API, their arguments checked (types, size limits, no paths, no writes unless allowed), micro-batched
single-query lookups, and the gradients table version each answer read.

Both transports (:mod:`gradstore.serve.flight`, :mod:`gradstore.serve.http`) call :meth:`Service.call`; every
refusal is a :class:`~gradstore.GradstoreError` with an HTTP-like :func:`status` (4xx), never anything else."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import PurePath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import gradstore
from gradstore.errors import (
    GradstoreError,
    InvalidArgumentError,
    MissingIdsError,
    NotAStoreError,
    StorePermissionError,
    UnknownIndexError,
    UnknownRunError,
)
from gradstore.serve.auth import AuthError
from gradstore.serve.batching import MicroBatcher

#: The calls a server answers, each with the keywords a request may give (``queries``/``target`` also as vectors).
CALLS: dict[str, frozenset[str]] = {
    "attribute": frozenset(
        [
            "queries",
            "run",
            "k",
            "method",
            "checkpoint",
            "query_checkpoint",
            "checkpoints",
            "damping",
            "blocks",
            "kind",
            "opponents",
            "split",
            "where",
            "rerank",
            "write",
        ]
    ),
    "self_influence": frozenset(["run", "method", "checkpoint", "damping", "blocks", "split", "where", "write"]),
    "select": frozenset(
        ["target", "run", "budget", "preconditioner", "aggregate", "checkpoints", "damping", "blocks", "split", "where"]
    ),
    "sql": frozenset({"query"}),
    "runs": frozenset(),
    "info": frozenset(),
}
WRITING = ("attribute", "self_influence")  # calls that append results when write=True


class RequestTooLargeError(InvalidArgumentError):
    """A request or its result over the server's limits (413)."""


class NoModelError(InvalidArgumentError):
    """A text query to a server started without ``--model`` (404)."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_k: int = 1000
    max_vectors: int = 1024  # query vectors per request
    max_ids: int = 10_000  # query ids per request
    max_text: int = 20_000  # characters of a SQL statement or filter
    max_prompt: int = 4_000  # characters of a text query's prompt plus its completion (--model)
    max_result_rows: int = 200_000
    max_request_bytes: int = 64 * 2**20


def status(error: BaseException) -> int:
    """The HTTP status of a refused request."""
    if isinstance(error, AuthError):
        return error.status
    if isinstance(error, RequestTooLargeError):
        return 413
    if isinstance(error, (NoModelError, UnknownRunError, MissingIdsError, UnknownIndexError, NotAStoreError)):
        return 404
    if isinstance(error, StorePermissionError):
        return 403
    return 400


def error_body(error: BaseException) -> dict[str, Any]:
    return {"error": type(error).__name__, "message": str(error).strip().splitlines()[0] if str(error) else ""}


@dataclass
class Answer:
    """One call's result: an Arrow table (``info`` gives its dict as ``value``) and the gradients version read."""

    table: pa.Table | None
    version: int | None
    value: Any = None


class Service:
    """One store opened read-only for this server (``allow_writes`` lets write-scoped tokens ask ``write=True``),
    kept warm between requests: fits, indexes and prepared rows stay in the store's caches. Other processes'
    appends are seen within ``refresh_s`` seconds (the store's read consistency)."""

    def __init__(
        self,
        uri: str | PurePath,
        *,
        allow_writes: bool = False,
        refresh_s: float = 1.0,
        limits: Limits | None = None,
        batch_window_s: float = 0.0,
        max_batch: int = 64,
        model: Any = None,
    ) -> None:
        self.store = gradstore.open(uri, create=False, read_consistency=timedelta(seconds=refresh_s))
        self.allow_writes = allow_writes
        self.limits = limits or Limits()
        self.name = PurePath(str(uri)).name or str(uri)
        self._lock = threading.RLock()  # one store call at a time; concurrency comes from micro-batching
        self.batcher = MicroBatcher(self._attribute_batch, batch_window_s, max_batch)
        self.model = model  # a gradstore.serve.model.TextModel from --model, or None: text queries refused

    def attribute_text(
        self, prompt: Any, completion: Any, *, run: Any, k: Any = 10, method: Any = "fisher", checkpoint: Any = None
    ) -> Answer:
        """Proponents of a typed ``prompt`` and ``completion``: the query gradient is captured on the server's
        ``--model`` with the run's own projection (``store.attribute(QueryBatch(...))``), never written."""
        if self.model is None:
            raise NoModelError(
                "this server has no model for text queries: start the server with --model module:factory"
            )
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise InvalidArgumentError("prompt and completion must be strings")
        if len(prompt) + len(completion) > self.limits.max_prompt:
            raise RequestTooLargeError(f"prompt and completion are longer than {self.limits.max_prompt} characters")
        if not prompt and not completion:
            raise InvalidArgumentError("give a prompt or a completion")
        args = {key: self._value(key, value) for key, value in {"run": run, "k": k, "method": method}.items()}
        if checkpoint is not None:
            if not isinstance(checkpoint, str):
                raise InvalidArgumentError("checkpoint must be a string")
            args["checkpoint"] = self._value("checkpoint", checkpoint)
        if not isinstance(args["run"], str) or not isinstance(args["method"], str):
            raise InvalidArgumentError("run and method must be strings")
        if not isinstance(args["k"], int) or isinstance(args["k"], bool) or args["k"] < 1:
            raise InvalidArgumentError("k must be a positive integer")
        if args["k"] > self.limits.max_k:
            raise RequestTooLargeError(f"k={args['k']} is over this server's limit of {self.limits.max_k}")
        from gradstore.queries import QueryBatch

        batch = self.model.batch(prompt, completion)
        query = QueryBatch(self.model.model, batch, ids=["text"], loss_fn=self.model.loss_fn)
        with self.model.lock, self._lock, self.store.core.snapshot():
            version = self._version(args["run"])
            table = self.store.attribute(query, **args, write=False)
        return Answer(self._capped(table), version)

    def warm(self, methods: list[str], kinds: tuple[str, ...] = ("exact",)) -> list[str]:
        """Before serving: one lookup per run, method and index kind, so that fits, indexes and prepared rows (read
        from the row files when present) are in memory before the first request. Returns what could not be warmed
        (a method the run cannot use), each as ``"run/method/kind: error"``."""
        skipped = []
        with self._lock:
            for run, dim in self.store.info()["run_dims"].items():
                for method in methods:
                    for kind in kinds:
                        try:
                            self.store.attribute(
                                np.ones((1, dim), np.float32), run=run, k=1, method=method, kind=kind, write=False
                            )
                        except GradstoreError as error:
                            skipped.append(f"{run}/{method}/{kind}: {error}")
        return skipped

    # ------------------------------------------------------------------ the one entry point
    def call(self, name: str, args: dict[str, Any], vectors: np.ndarray | None = None, scope: str = "read") -> Answer:
        """Answer call ``name`` with keyword ``args`` (JSON values) and optional query ``vectors`` ``[q, dim]``."""
        if name not in CALLS:
            raise InvalidArgumentError(f"unknown call {name!r}: one of {sorted(CALLS)}")
        if not isinstance(args, dict):
            raise InvalidArgumentError("the arguments must be an object of keyword -> value")
        unknown = sorted(set(args) - CALLS[name])
        if unknown:
            raise InvalidArgumentError(f"{name} takes no argument {unknown[0]!r}: it takes {sorted(CALLS[name])}")
        args = {key: self._value(key, value) for key, value in args.items()}
        if args.get("write"):
            if name not in WRITING:
                raise InvalidArgumentError(f"{name} takes no write")
            if not self.allow_writes:
                raise AuthError("this server is read-only (start it with --allow-writes)", status=403)
            if scope != "write":
                raise AuthError("write=True needs a write-scoped token", status=403)
        elif name in WRITING:
            args["write"] = False
        if vectors is not None:
            vectors = self._vectors(vectors)
            key = "target" if name == "select" else "queries"
            if key not in CALLS[name]:
                raise InvalidArgumentError(f"{name} takes no query vectors")
            if args.get(key) is not None:
                raise InvalidArgumentError(f"give {key} as ids/a filter or as vectors, not both")
            args[key] = vectors
        if "k" in args and isinstance(args["k"], int) and args["k"] > self.limits.max_k:
            raise RequestTooLargeError(f"k={args['k']} is over this server's limit of {self.limits.max_k}")
        if name == "attribute" and vectors is not None and len(vectors) == 1 and not args.get("write"):
            return self._batched(args)
        with self._lock, self.store.core.snapshot():
            version = self._version(args.get("run"))
            if name == "info":
                info = self.store.info()
                info["uri"] = self.name  # the server's filesystem path is not the client's business
                return Answer(None, version, info)
            if name == "runs":
                return Answer(self.store.runs(), version)
            if name == "sql":
                return Answer(self._sql(args.get("query")), version)
            method = getattr(self.store, name)
            return Answer(self._capped(method(**args)), version)

    # ------------------------------------------------------------------ checks
    def _value(self, key: str, value: Any) -> Any:
        if isinstance(value, (bool, int, float)) or value is None:
            return value
        if isinstance(value, str):
            if len(value) > self.limits.max_text:
                raise RequestTooLargeError(f"{key} is longer than {self.limits.max_text} characters")
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            if len(value) > self.limits.max_ids:
                raise RequestTooLargeError(f"{key} lists more than {self.limits.max_ids} items")
            return value
        raise InvalidArgumentError(f"{key} must be a string, a number, a boolean, null or a list of strings")

    def _vectors(self, vectors: Any) -> np.ndarray:
        try:
            array = np.asarray(vectors, dtype=np.float32)
        except (TypeError, ValueError) as error:
            raise InvalidArgumentError("query vectors must be numbers [queries, dim]") from error
        if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
            raise InvalidArgumentError(f"query vectors must be [queries, dim], got shape {tuple(array.shape)}")
        if len(array) > self.limits.max_vectors:
            raise RequestTooLargeError(f"more than {self.limits.max_vectors} query vectors in one request")
        return array

    def _version(self, run: Any) -> int | None:
        """The version of the gradients table this call reads (pinned by the surrounding snapshot)."""
        core = self.store.core
        try:
            name = core.gradient_table_name(run) if isinstance(run, str) else "gradients"
        except GradstoreError:
            name = "gradients"
        if not core.has_table(name):
            return None
        return core.dataset(name).version

    def _sql(self, query: Any) -> pa.Table:
        if not isinstance(query, str):
            raise InvalidArgumentError("sql needs a query (a string)")
        relation = self.store.sql(query)
        if relation is None:
            return pa.table({})
        try:
            return self._capped(relation.limit(self.limits.max_result_rows + 1).arrow())
        except GradstoreError:
            raise
        except Exception as error:  # DuckDB errors surface when the relation runs
            raise gradstore.SQLError(str(error).strip().splitlines()[0]) from error

    def _capped(self, table: Any) -> pa.Table:
        if isinstance(table, pa.RecordBatchReader):
            table = table.read_all()
        if table.num_rows > self.limits.max_result_rows:
            raise RequestTooLargeError(
                f"the result has more than {self.limits.max_result_rows} rows: narrow it (LIMIT, k, where)"
            )
        return table

    # ------------------------------------------------------------------ micro-batching
    def _batched(self, args: dict[str, Any]) -> Answer:
        vector = args.pop("queries")[0]
        key = json.dumps(args, sort_keys=True)
        table, version = self.batcher.submit(key, vector)
        return Answer(table, version)

    def _attribute_batch(self, key: str, vectors: np.ndarray) -> list[tuple[pa.Table, int | None]]:
        args = json.loads(key)
        with self._lock, self.store.core.snapshot():
            version = self._version(args.get("run"))
            table = self.store.attribute(vectors, **args)
        query_ids = table.column("query_id")
        alone = pa.array(["q0"] * table.num_rows, pa.string()).cast(table.schema.field("query_id").type)
        table = table.set_column(table.schema.get_field_index("query_id"), "query_id", alone)
        return [(table.filter(pc.equal(query_ids, f"q{i}")), version) for i in range(len(vectors))]
