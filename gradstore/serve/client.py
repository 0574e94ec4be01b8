"""``gradstore.connect(uri, token=...)``: the read side of the store API over Arrow Flight, with the local store's
signatures and results (``write`` defaults to ``False``: a server is read-only unless started with
``--allow-writes``). ``client.last_version`` is the gradients table version the last answer read."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from gradstore import errors
from gradstore.errors import GradstoreError, InvalidArgumentError
from gradstore.serve.auth import AuthError
from gradstore.serve.errors import (
    NoModelError,
    NotBuiltError,
    QueryCancelledError,
    QueryTimeoutError,
    RequestTooLargeError,
    ServerBusyError,
)


class ServerError(GradstoreError):
    """The server failed (a bug or an unreachable server), not the request."""


_KNOWN = {
    error.__name__: error
    for error in (
        AuthError,
        RequestTooLargeError,
        NoModelError,
        NotBuiltError,
        QueryTimeoutError,
        QueryCancelledError,
        ServerBusyError,
    )
}


def _raise(error: flight.FlightError) -> None:
    if isinstance(error, flight.FlightUnauthenticatedError):
        raise AuthError(str(error).split(". Detail")[0]) from None
    info = getattr(error, "extra_info", None)
    if info:
        try:
            body = json.loads(info)
        except ValueError:
            body = None
        if isinstance(body, dict):
            kind = _KNOWN.get(body.get("error")) or getattr(errors, str(body.get("error")), None)
            if not (isinstance(kind, type) and issubclass(kind, GradstoreError)):
                kind = InvalidArgumentError
            if kind is AuthError:
                raise AuthError(body.get("message", ""), status=body.get("status", 401)) from None
            raise kind(body.get("message", "")) from None
    raise ServerError(str(error).split(". Detail")[0]) from error


class RemoteStore:
    """A served store (see :func:`connect`)."""

    def __init__(
        self,
        uri: str,
        token: str | None = None,
        *,
        timeout_s: float = 300.0,
        tls_root_certs=None,
        reconnect_delays_s: Sequence[float] = (0.2, 0.5, 1, 2, 4, 8),
    ) -> None:
        self._client_kwargs = {"tls_root_certs": tls_root_certs} if tls_root_certs is not None else {}
        self.uri = uri
        self._client = flight.FlightClient(uri, **self._client_kwargs)
        self.reconnect_delays_s = tuple(reconnect_delays_s)
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._options = flight.FlightCallOptions(headers=headers, timeout=timeout_s)
        self.last_version: int | None = None

    def __repr__(self) -> str:
        return f"RemoteStore({self.uri!r})"

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, args: dict[str, Any], vectors: Any = None) -> pa.Table:
        """One exchange; a read retried on a fresh connection while the server is unreachable (restarting)."""
        delays = [] if args.get("write") else list(self.reconnect_delays_s)
        while True:
            try:
                result = self._exchange(name, args, vectors)
                break
            except flight.FlightUnavailableError as error:
                if not delays:
                    _raise(error)
                time.sleep(delays.pop(0))
                self._client.close()
                self._client = flight.FlightClient(self.uri, **self._client_kwargs)
            except flight.FlightError as error:
                _raise(error)
        metadata = dict(result.schema.metadata or {})
        self.last_version = json.loads(metadata.pop(b"gradstore.version", b"null"))
        self._last_value = json.loads(metadata.pop(b"gradstore.value", b"null"))
        return result.replace_schema_metadata(metadata or None)

    def _exchange(self, name: str, args: dict[str, Any], vectors: Any) -> pa.Table:
        command = json.dumps({"call": name, "args": args}).encode()
        writer, reader = self._client.do_exchange(flight.FlightDescriptor.for_command(command), self._options)
        with writer:
            if vectors is not None:
                array = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
                if array.ndim != 2:
                    raise InvalidArgumentError(f"query vectors must be [queries, dim], got {array.shape}")
                column = pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1)), array.shape[1])
                table = pa.table({"vector": column})
                writer.begin(table.schema)
                writer.write_table(table)
            writer.done_writing()
            return reader.read_all()

    @staticmethod
    def _queries(queries: Any) -> tuple[Any, Any]:
        """``(ids or filter or None, vectors or None)`` of a local store's ``queries`` argument."""
        if queries is None or isinstance(queries, str):
            return queries, None
        if isinstance(queries, (list, tuple)) and all(isinstance(q, str) for q in queries):
            return list(queries), None
        if hasattr(queries, "vectors"):  # a QueryBatch
            queries = queries.vectors
        if hasattr(queries, "detach"):  # a torch tensor
            queries = queries.detach().float().cpu().numpy()
        return None, queries

    def attribute(
        self,
        queries=None,
        *,
        run: str,
        k: int = 10,
        method: str = "fisher",
        checkpoint=None,
        query_checkpoint=None,
        checkpoints: Sequence[str] | None = None,
        damping=None,
        blocks="auto",
        kind="exact",
        opponents=False,
        split="train",
        where=None,
        write=False,
        rerank=0,
    ) -> pa.Table:
        """As :meth:`GradStore.attribute` (``engine``/``device`` are the server's)."""
        ids, vectors = self._queries(queries)
        args = {
            "queries": ids,
            "run": run,
            "k": k,
            "method": method,
            "checkpoint": checkpoint,
            "query_checkpoint": query_checkpoint,
            "checkpoints": _list(checkpoints),
            "damping": damping,
            "blocks": blocks,
            "kind": kind,
            "opponents": opponents,
            "split": split,
            "where": where,
            "write": write,
            "rerank": rerank,
        }
        return self._call(
            "attribute", _given(args, {"checkpoints", "damping", "query_checkpoint", "checkpoint"}), vectors
        )

    def self_influence(
        self,
        *,
        run: str,
        method: str = "fisher",
        checkpoint=None,
        damping=None,
        blocks="auto",
        split="train",
        where=None,
        write=False,
    ) -> pa.Table:
        """As :meth:`GradStore.self_influence`."""
        args = {
            "run": run,
            "method": method,
            "checkpoint": checkpoint,
            "damping": damping,
            "blocks": blocks,
            "split": split,
            "where": where,
            "write": write,
        }
        return self._call("self_influence", _given(args, {"damping", "checkpoint"}))

    def select(
        self,
        target=None,
        *,
        run: str,
        budget: float = 0.05,
        preconditioner: str = "grad-dot",
        aggregate: str = "max",
        checkpoints: Sequence[str] | None = None,
        damping=None,
        blocks="auto",
        split="train",
        where=None,
    ) -> pa.Table:
        """As :meth:`GradStore.select`."""
        ids, vectors = self._queries(target)
        args = {
            "target": ids,
            "run": run,
            "budget": budget,
            "preconditioner": preconditioner,
            "aggregate": aggregate,
            "checkpoints": _list(checkpoints),
            "damping": damping,
            "blocks": blocks,
            "split": split,
            "where": where,
        }
        return self._call("select", _given(args, {"checkpoints", "damping"}), vectors)

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """As :meth:`GradStore.sql`: a DuckDB relation (over the server's result, already computed)."""
        table = self._call("sql", {"query": query})
        return duckdb.connect().from_arrow(table)  # its own connection: threads may each hold a result

    def runs(self) -> pa.Table:
        return self._call("runs", {})

    def info(self) -> dict:
        """As :meth:`GradStore.info` (``uri`` is the store's name, not the server's path)."""
        self._call("info", {})
        return self._last_value


def _list(value: Sequence[str] | None) -> list[str] | None:
    return None if value is None else list(value)


def _given(args: dict[str, Any], optional: set[str]) -> dict[str, Any]:
    """``args`` without the optional ones left at ``None`` (so the server's method registry sees only what the
    caller gave, as a local call does)."""
    return {key: value for key, value in args.items() if not (key in optional and value is None)}


def connect(uri: str, token: str | None = None, **kwargs: Any) -> RemoteStore:
    """A client of ``gradstore serve`` at ``uri`` (``grpc://host:port``, ``grpc+tls://...``) with bearer ``token``."""
    return RemoteStore(uri, token, **kwargs)
