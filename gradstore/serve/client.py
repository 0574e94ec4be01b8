"""``gradstore.connect(uri, token=...)``: the read side of the store API over Arrow Flight, with the local store's
signatures and results (``write`` defaults to ``False``: a server is read-only unless started with
``--allow-writes``). ``client.last_version`` is the gradients table version the last answer read."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

import gradstore.errors as errors
from gradstore.errors import GradstoreError, InvalidArgumentError, surface
from gradstore.methods import DEFAULT_METHOD, ScoreOptions
from gradstore.serve.auth import AuthError
from gradstore.serve.errors import (
    NoModelError,
    NotBuiltError,
    QueryCancelledError,
    QueryTimeoutError,
    RequestTooLargeError,
    ServerBusyError,
)
from gradstore.store_api import IndexKind

if TYPE_CHECKING:
    import torch

    from gradstore.answers.selection import Aggregate
    from gradstore.core.engine import Engine, EngineName
    from gradstore.methods import BlockStructure, MethodName
    from gradstore.methods.queries import QueryInput


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
    """A served store (see :func:`connect`): implements :class:`~gradstore.store_api.StoreAPI` with the local
    store's signatures, through the same :func:`~gradstore.errors.surface` (numpy scalars as numbers, flags checked,
    unknown keywords named) before anything is sent."""

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
        """As :meth:`GradStore.attribute`; ``engine``/``device`` are the server's, ``write`` defaults to ``False``."""
        _served_here("attribute", engine)
        keywords = {
            "method": method,
            "checkpoint": checkpoint,
            "query_checkpoint": query_checkpoint,
            "checkpoints": checkpoints,
            "damping": damping,
            "blocks": blocks,
            "kind": kind,
            "rerank": rerank,
            "device": device,
            "split": split,
            "where": where,
        }
        chosen = ScoreOptions.build(options, "attribute", **keywords)
        ids, vectors = self._queries(queries)
        args = {"queries": ids, "run": run, "k": k, "opponents": opponents, "write": bool(write)}
        return self._call("attribute", {**args, **_sent("attribute", chosen, keywords)}, vectors)

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
        """As :meth:`GradStore.self_influence` (``engine`` is the server's, ``write`` defaults to ``False``)."""
        _served_here("self_influence", engine)
        keywords = {
            "method": method,
            "checkpoint": checkpoint,
            "damping": damping,
            "blocks": blocks,
            "split": split,
            "where": where,
        }
        chosen = ScoreOptions.build(options, "self_influence", **keywords)
        args = {"run": run, "write": bool(write), **_sent("self_influence", chosen, keywords)}
        return self._call("self_influence", args)

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
        """As :meth:`GradStore.select` (``engine`` is the server's)."""
        _served_here("select", engine)
        keywords = {
            "method": preconditioner,
            "checkpoints": checkpoints,
            "damping": damping,
            "blocks": blocks,
            "split": split,
            "where": where,
        }
        spelled = {"method": "preconditioner"}
        chosen = ScoreOptions.build(options, "select", defaults={"method": "grad-dot"}, spelled=spelled, **keywords)
        ids, vectors = self._queries(target)
        args = {"target": ids, "run": run, "budget": budget, "aggregate": aggregate}
        return self._call("select", {**args, **_sent("select", chosen, keywords, spelled)}, vectors)

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


def _served_here(call: str, engine: Any) -> None:
    """Refuse an ``engine`` other than the default: a served store's work runs where its server runs it."""
    if engine != "local":
        raise InvalidArgumentError(f"{call}: engine= is the server's choice for a served store; leave it out")


def _sent(call: str, options: ScoreOptions, keywords: dict[str, Any], spelled: dict[str, str] | None = None) -> dict:
    """The options of ``call`` (``keywords``' fields) as request arguments: those left at ``None`` are not sent (the
    server's method registry sees only what the caller gave, as a local call does); ``device`` must be left out
    (where the search runs is the server's choice)."""
    if options.device is not None:
        raise InvalidArgumentError(f"{call}: device= is the server's choice for a served store; leave it out")
    sent = {}
    for name in keywords:
        value = getattr(options, name)
        if value is not None:
            sent[(spelled or {}).get(name, name)] = list(value) if isinstance(value, tuple) else value
    return sent


def connect(uri: str, token: str | None = None, **kwargs: Any) -> RemoteStore:
    """A client of ``gradstore serve`` at ``uri`` (``grpc://host:port``, ``grpc+tls://...``) with bearer ``token``."""
    return RemoteStore(uri, token, **kwargs)
