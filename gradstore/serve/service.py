"""What a ``gradstore serve`` process does for one request, whatever the wire: the allowed calls of the store's
read API, their arguments checked (types, size limits, no paths, no writes unless allowed), micro-batched
single-query lookups, and the gradients table version each answer read.

Both transports (:mod:`gradstore.serve.flight`, :mod:`gradstore.serve.http`) call :meth:`Service.call`; every
refusal is a :class:`~gradstore.GradstoreError` with an HTTP-like :func:`status` (4xx; 503 when the server is
busy), never anything else. Reads run side by side (no lock around a read: a slow SQL statement on its own DuckDB
cursor never holds up a lookup); on a server started with ``allow_writes`` the calls that may write the store take
turns. Without ``allow_writes`` the store is never written (:mod:`gradstore.serve.readonly`)."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import PurePath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gradstore.core.sql import store_views
from gradstore.errors import (
    GradstoreError,
    InvalidArgumentError,
    MissingIdsError,
    NotAStoreError,
    StorePermissionError,
    UnknownIndexError,
    UnknownRunError,
)
from gradstore.methods import DEFAULT_METHOD
from gradstore.methods.queries import vector_query_ids
from gradstore.serve import readonly
from gradstore.serve.admission import Admission
from gradstore.serve.auth import AuthError
from gradstore.serve.batching import MicroBatcher
from gradstore.serve.errors import (
    NoModelError,
    NotBuiltError,
    QueryCancelledError,
    QueryTimeoutError,
    RequestTooLargeError,
    ServerBusyError,
)
from gradstore.serve.sql import SQLSandbox
from gradstore.store import open_store
from gradstore.store_api import STORE_API, StoreAPI

__all__ = [
    "CALLS",
    "Answer",
    "Limits",
    "NoModelError",
    "NotBuiltError",
    "QueryCancelledError",
    "QueryTimeoutError",
    "RequestTooLargeError",
    "ServerBusyError",
    "Service",
    "error_body",
    "status",
]

#: The keywords of the store API a request cannot give: where the work runs is the server's choice, and the
#: scoring options travel as their own keywords.
SERVER_CHOSEN = frozenset({"engine", "device", "options"})


def _keywords(call: str) -> frozenset[str]:
    """The keywords of :class:`~gradstore.store_api.StoreAPI`'s ``call`` a request may give."""
    parameters = inspect.signature(getattr(StoreAPI, call)).parameters
    return frozenset(parameters) - SERVER_CHOSEN - {"self"}


#: The calls a server answers, each with the keywords a request may give (``queries``/``target`` also as vectors):
#: those of the store API (:data:`~gradstore.store_api.STORE_API`).
CALLS: dict[str, frozenset[str]] = {call: _keywords(call) for call in STORE_API}
WRITING = ("attribute", "self_influence")  # calls that append results when write=True

#: The JSON type each keyword takes: ``str``, ``str?`` (or null), ``ids`` (a string, a list of strings or null),
#: ``strs?`` (a list of strings or null), ``int``, ``num``, ``num?``, ``bool``.
ARGUMENT_TYPES: dict[str, str] = {
    "queries": "ids",
    "target": "ids",
    "run": "str",
    "k": "int",
    "method": "str",
    "checkpoint": "str?",
    "query_checkpoint": "str?",
    "checkpoints": "strs?",
    "damping": "num?",
    "blocks": "str",
    "kind": "str",
    "opponents": "bool",
    "split": "str",
    "where": "str?",
    "rerank": "int",
    "write": "bool",
    "budget": "num",
    "preconditioner": "str",
    "aggregate": "str",
    "query": "str",
}
_TYPE_WORDS = {
    "str": "a string",
    "str?": "a string or null",
    "ids": "a string, a list of strings or null",
    "strs?": "a list of strings or null",
    "int": "an integer",
    "num": "a number",
    "num?": "a number or null",
    "bool": "a boolean",
}
#: A URI with a scheme (``s3://bucket/store``), or an absolute path of two or more parts (``/a/b``,
#: ``C:\\a\\b``) with an optional ``:line:column``; a relative path (``../x``) or a ratio (``NaN/Inf``) is neither.
_PATH = re.compile(
    r"\b[A-Za-z][\w+.-]*://[^\s'\"`,;()]+|(?<![\w.~/\\])(?:[A-Za-z]:)?[/\\](?:[\w.~+-]+[/\\])+[\w.~+-]+(?::\d+)*"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for and what the server spends on it; every field is a ``--limit name=value`` of
    ``gradstore serve`` (sizes also as ``16MiB``/``1GB``). docs/serve.md "Security model" lists them."""

    # one request
    max_k: int = 1000
    max_vectors: int = 1024  # query vectors per request
    max_ids: int = 10_000  # query ids per request
    max_text: int = 20_000  # characters of a SQL statement or filter
    max_prompt: int = 4_000  # characters of a text query's prompt plus its completion (--model)
    max_rerank: int = 100  # rerank=m re-scores m*k candidates
    max_result_rows: int = 200_000
    max_result_bytes: int = 64 * 2**20  # an answer's Arrow bytes (SQL stops reading there)
    max_request_bytes: int = 64 * 2**20  # Flight: the query vectors streamed with one call
    max_body_bytes: int = 16 * 2**20  # HTTP: one request body (JSON), refused before it is read
    # time
    header_timeout_s: float = 10.0  # HTTP: a request's headers must arrive within this (else the connection closes)
    body_timeout_s: float = 30.0  # HTTP: and its body within this after them
    sql_timeout_s: float = 30.0  # a SQL statement is interrupted after this (also when its client goes away)
    queue_timeout_s: float = 30.0  # a request waits at most this for a slot, then 503
    # concurrency
    max_concurrent: int = 32  # requests worked on at once (both transports together)
    max_waiting: int = 512  # requests waiting for a slot; more are refused at once (503)
    max_connections: int = 4096  # open HTTP connections; past it uvicorn answers 503
    max_connections_per_client: int = 256  # open HTTP connections from one address; past it 429 and closed
    # memory and disk
    sql_memory_bytes: int = 2**30  # DuckDB memory_limit (every statement together)
    sql_temp_bytes: int = 4 * 2**30  # DuckDB max_temp_directory_size (its private temp directory)
    sql_threads: int = 2  # DuckDB threads
    fit_cache_bytes: int = 2 * 2**30  # fits kept in memory (least recently used dropped)

    @classmethod
    def parse(cls, items: list[str] | None, base: Limits | None = None) -> Limits:
        """``base`` (default the defaults) with ``["name=value", ...]`` applied (``--limit``)."""
        types = {field.name: field.type for field in fields(cls)}
        changes: dict[str, Any] = {}
        for item in items or []:
            name, sep, text = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in types:
                raise InvalidArgumentError(f"--limit takes name=value with a name of {sorted(types)}, got {item!r}")
            changes[name] = _limit_value(name, types[name], text.strip())
        limits = base or cls()
        return cls(**{**limits.__dict__, **changes})


def _limit_value(name: str, kind: Any, text: str) -> Any:
    if "float" in str(kind):
        try:
            value = float(text)
        except ValueError:
            raise InvalidArgumentError(f"--limit {name}: a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise InvalidArgumentError(f"--limit {name}: a positive number, got {text!r}")
        return value
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgumentError(f"--limit {name}: an integer (sizes also as 16MiB, 1GB), got {text!r}")
    number, prefix, binary = match.groups()
    scale = (1024 if binary else 1000) ** "_kmgt".index(prefix.lower() or "_")
    value = int(float(number) * scale)
    if value < 1:
        raise InvalidArgumentError(f"--limit {name}: at least 1, got {text!r}")
    return value


def status(error: BaseException) -> int:
    """The HTTP status of a refused request."""
    if isinstance(error, AuthError):
        return error.status
    if isinstance(error, RequestTooLargeError):
        return 413
    if isinstance(error, ServerBusyError):
        return 503
    if isinstance(error, NotBuiltError):
        return 409
    if isinstance(error, (NoModelError, UnknownRunError, MissingIdsError, UnknownIndexError, NotAStoreError)):
        return 404
    if isinstance(error, StorePermissionError):
        return 403
    return 400


def error_body(error: BaseException) -> dict[str, Any]:
    """The JSON of a refusal: the error's type and the first line of its message, file paths left out."""
    text = str(error).strip()
    return {"error": type(error).__name__, "message": hide_paths(text.splitlines()[0]) if text else ""}


def hide_paths(message: str) -> str:
    """``message`` with absolute file paths (a library's source file named in its error, the server's directories)
    replaced by ``<path>``: where the server or its libraries keep files is not the client's business."""
    return _PATH.sub("<path>", message)


@dataclass
class Answer:
    """One call's result: an Arrow table (``info`` gives its dict as ``value``) and the gradients version read."""

    table: pa.Table | None
    version: int | None
    value: Any = None


class Service:
    """One store opened for this server, kept warm between requests: fits, indexes and prepared rows stay in the
    store's caches. Without ``allow_writes`` nothing is written to the store (fits stay in a bounded memory cache,
    derived runs and FAISS indexes it lacks are refused with how to build them); with it, write-scoped tokens may
    ask ``write=True`` and fits, indexes and derived runs are saved. Other processes' appends are seen within
    ``refresh_s`` seconds (the store's read consistency)."""

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
        consistency = timedelta(seconds=refresh_s)
        if allow_writes:
            self.store = open_store(uri, create=False, read_consistency=consistency)
        else:
            self.store = readonly.open_read_only(uri, consistency)
        self.allow_writes = allow_writes
        self.limits = limits or Limits()
        self.fits = readonly.bound_fits(self.store, self.limits.fit_cache_bytes)
        self.name = PurePath(str(uri)).name or str(uri)
        # calls that may write the store take turns (a writable server only); reads never wait for one another
        self._writes: Any = threading.RLock() if allow_writes else contextlib.nullcontext()
        self.report_lock = threading.Lock()  # the report page renders one at a time (its SQL shares a connection)
        self.admission = Admission(self.limits.max_concurrent, self.limits.max_waiting)
        self.sql = SQLSandbox(
            memory_bytes=self.limits.sql_memory_bytes,
            temp_bytes=self.limits.sql_temp_bytes,
            threads=self.limits.sql_threads,
            timeout_s=self.limits.sql_timeout_s,
            max_rows=self.limits.max_result_rows,
            max_bytes=self.limits.max_result_bytes,
        )
        self.batcher = MicroBatcher(self._attribute_batch, batch_window_s, max_batch)
        self.model = model  # a gradstore.serve.model.TextModel from --model, or None: text queries refused

    def close(self) -> None:
        self.sql.close()

    def attribute_text(
        self,
        prompt: Any,
        completion: Any,
        *,
        run: Any,
        k: Any = 10,
        method: Any = DEFAULT_METHOD,
        checkpoint: Any = None,
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
        _check_text("prompt", prompt)
        _check_text("completion", completion)
        if not prompt and not completion:
            raise InvalidArgumentError("give a prompt or a completion")
        given = {"run": run, "k": k, "method": method}
        if checkpoint is not None:
            given["checkpoint"] = checkpoint
        args = self._arguments("attribute", given)
        from gradstore.methods.queries import QueryBatch

        batch = self.model.batch(prompt, completion)
        query = QueryBatch(self.model.model, batch, ids=["text"], loss_fn=self.model.loss_fn)
        with self.model.lock, self._writes, self.store.core.snapshot():
            version = self._version(args["run"])
            table = self._store_call("attribute", args, lambda: self.store.attribute(query, **args, write=False))
        return Answer(self._capped(table), version)

    def warm(self, methods: list[str], kinds: tuple[str, ...] = ("exact",)) -> list[str]:
        """Before serving: one lookup per run, method and index kind, so that fits, indexes and prepared rows (read
        from the row files when present) are in memory before the first request. Returns what could not be warmed
        (a method the run cannot use, an index a read-only server does not build), each as
        ``"run/method/kind: error"``."""
        skipped = []
        with self._writes:
            for run, dim in self.store.info()["run_dims"].items():
                for method in methods:
                    for kind in kinds:
                        try:
                            if not self.allow_writes:
                                readonly.check_index_built(self.store, {"run": run, "method": method, "kind": kind})
                            self.store.attribute(
                                np.ones((1, dim), np.float32), run=run, k=1, method=method, kind=kind, write=False
                            )
                        except GradstoreError as error:
                            skipped.append(f"{run}/{method}/{kind}: {error}")
        return skipped

    # ------------------------------------------------------------------ the one entry point
    def call(
        self,
        name: str,
        args: dict[str, Any],
        vectors: Any = None,
        scope: str = "read",
        cancelled: Callable[[], bool] | None = None,
    ) -> Answer:
        """Answer call ``name`` with keyword ``args`` (JSON values) and optional query ``vectors`` ``[q, dim]``
        (an array or nested lists of numbers). ``cancelled()`` turning true (the client went away) interrupts a
        SQL statement."""
        if not isinstance(name, str) or name not in CALLS:
            raise InvalidArgumentError(f"unknown call {name!r}: one of {sorted(CALLS)}")
        args = self._arguments(name, args)
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
        if name == "attribute":
            self._check_answer_rows(args)
        if name == "attribute" and not self.allow_writes:
            readonly.check_index_built(self.store, args)
        if name == "attribute" and vectors is not None and len(vectors) == 1 and not args.get("write"):
            return self._batched(args)
        if name in ("info", "runs", "sql"):  # reads only: never behind a writing call
            with self.store.core.snapshot():
                version = self._version(None)
                if name == "info":
                    info = self.store.info()
                    info["uri"] = self.name  # the server's filesystem path is not the client's business
                    return Answer(None, version, info)
                if name == "runs":
                    return Answer(self.store.runs(), version)
                return Answer(self._sql(args.get("query"), cancelled), version)
        with self._writes, self.store.core.snapshot():
            version = self._version(args.get("run"))
            method = getattr(self.store, name)
            return Answer(self._capped(self._store_call(name, args, lambda: method(**args))), version)

    def _store_call(self, name: str, args: dict[str, Any], run: Callable[[], Any]) -> Any:
        try:
            return run()
        except StorePermissionError as error:
            if self.allow_writes:
                raise
            raise readonly.refusal(error, name, args) from None

    # ------------------------------------------------------------------ checks
    def _arguments(self, name: str, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict):
            raise InvalidArgumentError("the arguments must be an object of keyword -> value")
        unknown = sorted(str(key) for key in set(args) - CALLS[name])
        if unknown:
            raise InvalidArgumentError(f"{name} takes no argument {unknown[0]!r}: it takes {sorted(CALLS[name])}")
        checked = {key: self._value(key, value) for key, value in args.items()}
        if "k" in checked and checked["k"] > self.limits.max_k:
            raise RequestTooLargeError(f"k={checked['k']} is over this server's limit of {self.limits.max_k}")
        if "rerank" in checked and checked["rerank"] > self.limits.max_rerank:
            limit = self.limits.max_rerank
            raise RequestTooLargeError(f"rerank={checked['rerank']} is over this server's limit of {limit}")
        return checked

    def _value(self, key: str, value: Any) -> Any:
        kind = ARGUMENT_TYPES[key]
        if value is None and (kind.endswith("?") or kind == "ids"):
            return None
        if kind in ("str", "str?") or (kind == "ids" and isinstance(value, str)):
            if isinstance(value, str):
                if len(value) > self.limits.max_text:
                    raise RequestTooLargeError(f"{key} is longer than {self.limits.max_text} characters")
                _check_text(key, value)
                return value
        elif kind in ("ids", "strs?"):
            if isinstance(value, list) and all(isinstance(item, str) for item in value):
                if len(value) > self.limits.max_ids:
                    raise RequestTooLargeError(f"{key} lists more than {self.limits.max_ids} items")
                if sum(len(item) for item in value) > self.limits.max_text * 10:
                    raise RequestTooLargeError(f"{key} holds more than {self.limits.max_text * 10} characters")
                for item in value:
                    _check_text(key, item)
                return value
        elif kind == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif kind in ("num", "num?"):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not math.isfinite(value):
                    raise InvalidArgumentError(f"{key} must be a finite number")
                return value
        elif kind == "bool" and isinstance(value, bool):
            return value
        raise InvalidArgumentError(f"{key} must be {_TYPE_WORDS[kind]}")

    def _vectors(self, vectors: Any) -> np.ndarray:
        if isinstance(vectors, list) and len(vectors) > self.limits.max_vectors:
            raise RequestTooLargeError(f"more than {self.limits.max_vectors} query vectors in one request")
        try:
            with np.errstate(over="ignore"):  # beyond float32: infinite, refused by the store as non-finite
                array = np.asarray(vectors, dtype=np.float32)
        except (TypeError, ValueError, OverflowError) as error:
            raise InvalidArgumentError("query vectors must be numbers [queries, dim], rows of one length") from error
        if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
            raise InvalidArgumentError(f"query vectors must be [queries, dim], got shape {tuple(array.shape)}")
        if len(array) > self.limits.max_vectors:
            raise RequestTooLargeError(f"more than {self.limits.max_vectors} query vectors in one request")
        return array

    def _check_answer_rows(self, args: dict[str, Any]) -> None:
        """Refuse (413) an ``attribute`` whose answer is known to exceed ``Limits.max_result_rows`` before it is
        computed: ``queries`` given as ids or vectors times ``k`` (at most the run's stored rows) times two with
        ``opponents``. Without this, 10,000 ids at ``k=1000`` built a 20M-row table (GBs, many seconds) only to
        refuse it afterwards."""
        queries = args.get("queries")
        if queries is None or isinstance(queries, str):  # all stored queries, or a filter: counted by the store
            return
        candidates = args.get("k", 10)
        with contextlib.suppress(GradstoreError, KeyError, TypeError, ValueError, OSError, RuntimeError):
            core = self.store.core
            candidates = min(candidates, core.dataset(core.gradient_table_name(args["run"])).count_rows())
        rows = len(queries) * candidates * (2 if args.get("opponents") else 1)
        if rows > self.limits.max_result_rows:
            raise RequestTooLargeError(
                f"the answer would have up to {rows} rows, more than this server's limit of "
                f"{self.limits.max_result_rows}: send fewer queries per request or a smaller k"
            )

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

    def _sql(self, query: Any, cancelled: Callable[[], bool] | None = None) -> pa.Table:
        tables, unions, macros = store_views(self.store.core.tables)
        return self.sql.run(query, tables, unions, macros, self.store.core.storage_options, cancelled)

    def _capped(self, table: Any) -> pa.Table:
        if isinstance(table, pa.RecordBatchReader):
            table = table.read_all()
        if table.num_rows > self.limits.max_result_rows:
            raise RequestTooLargeError(
                f"the result has more than {self.limits.max_result_rows} rows: narrow it (LIMIT, k, where)"
            )
        if table.get_total_buffer_size() > self.limits.max_result_bytes:
            raise RequestTooLargeError(
                f"the result is larger than {self.limits.max_result_bytes} bytes: narrow it (LIMIT, k, where)"
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
        with self._writes, self.store.core.snapshot():
            version = self._version(args.get("run"))
            table = self._store_call("attribute", args, lambda: self.store.attribute(vectors, **args))
        query_ids = table.column("query_id")
        ids = vector_query_ids(len(vectors))
        alone = pa.array(ids[:1] * table.num_rows, pa.string()).cast(table.schema.field("query_id").type)
        table = table.set_column(table.schema.get_field_index("query_id"), "query_id", alone)
        return [(table.filter(pc.equal(query_ids, ids[i])), version) for i in range(len(vectors))]


def _check_text(key: str, value: str) -> None:
    """Refuse text that is not valid Unicode for the store's layers (a lone surrogate, a NUL)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{key} must be valid Unicode text (no lone surrogates)") from None
    if "\x00" in value:
        raise InvalidArgumentError(f"{key} must not hold NUL characters")
