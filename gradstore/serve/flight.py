"""The Arrow Flight side of ``gradstore serve``: programmatic clients (:func:`gradstore.connect`).

One ``DoExchange`` per call: the descriptor's command is ``{"call": name, "args": {...}}`` (JSON), the client
streams the query vectors (one ``vector`` list column, float32) when it has any, and the server streams the result
table back; its schema metadata ``gradstore.version`` is the gradients table version the answer read, and
``gradstore.value`` a JSON value (``info``). Refusals are ``FlightServerError``s whose ``extra_info`` is
``{"error": type name, "message": ..., "status": 4xx}``; the client raises the named ``GradstoreError``.

The token is checked by a server middleware when a call starts, before its handler runs or reads a byte of its
stream; a call then waits for one of the server's request slots (``Limits.max_concurrent``, shared with HTTP). The
other Flight RPCs (``DoGet``, ``DoPut``, ``GetFlightInfo``, ...) are refused the same typed way, never with a
Python traceback; a bug is answered ``FlightInternalError("internal error: <type>")`` and logged here."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight

from gradstore.errors import GradstoreError, InvalidArgumentError
from gradstore.serve.auth import AuthError, Tokens
from gradstore.serve.service import RequestTooLargeError, Service, error_body, status

log = logging.getLogger("gradstore.serve")


class _Auth(flight.ServerMiddleware):
    def __init__(self, scope: str) -> None:
        self.scope = scope


class _AuthFactory(flight.ServerMiddlewareFactory):
    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def start_call(self, info, headers):
        values = headers.get("authorization") or headers.get("Authorization") or [None]
        try:
            token = self.tokens.check(values[0])
        except AuthError as error:
            raise flight.FlightUnauthenticatedError(str(error)) from None
        if info.method != flight.FlightMethod.DO_EXCHANGE:  # here: pyarrow's GetSchema would add a traceback
            raise _unsupported(str(info.method).rpartition(".")[2])
        return _Auth(token.scope)


def _refusal(error: BaseException) -> flight.FlightServerError:
    body = {**error_body(error), "status": status(error)}
    return flight.FlightServerError(f"{body['error']}: {body['message']}", extra_info=json.dumps(body).encode())


def _unsupported(rpc: str) -> flight.FlightServerError:
    return _refusal(InvalidArgumentError(f"this server answers DoExchange calls only (gradstore.connect), not {rpc}"))


class FlightService(flight.FlightServerBase):
    """``FlightService(service, tokens, location="grpc://127.0.0.1:0")``; ``.port``, ``.serve()``, ``.shutdown()``.
    ``tls_certificates``: ``[(cert_pem, key_pem)]`` for ``grpc+tls://`` locations."""

    def __init__(
        self,
        service: Service,
        tokens: Tokens,
        location: str = "grpc://127.0.0.1:0",
        tls_certificates: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        certificates = [flight.CertKeyPair(cert, key) for cert, key in tls_certificates or []]
        super().__init__(location, middleware={"auth": _AuthFactory(tokens)}, tls_certificates=certificates)
        self.service = service

    def do_exchange(self, context, descriptor, reader, writer):
        limits = self.service.limits
        try:
            with self.service.admission.slot(limits.queue_timeout_s):
                answer = self._answer(context, descriptor, reader)
        except GradstoreError as error:
            raise _refusal(error) from None
        except (pa.ArrowException, ValueError, TypeError, KeyError, RecursionError) as error:  # a malformed request
            message = "nested too deeply" if isinstance(error, RecursionError) else str(error).splitlines()[0]
            raise _refusal(InvalidArgumentError(f"malformed request: {message}")) from None
        except Exception as error:  # a bug: say so without the traceback, keep serving
            log.exception("flight call failed")
            raise flight.FlightInternalError(f"internal error: {type(error).__name__}") from None
        table = answer.table if answer.table is not None else pa.table({})
        metadata = {b"gradstore.version": json.dumps(answer.version).encode()}
        if answer.value is not None:
            metadata[b"gradstore.value"] = json.dumps(answer.value, default=str).encode()
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        writer.begin(table.schema)
        writer.write_table(table)

    def _answer(self, context, descriptor, reader):
        limits = self.service.limits
        if descriptor.descriptor_type != flight.DescriptorType.CMD or len(descriptor.command) > limits.max_text * 4:
            raise RequestTooLargeError("the command must be a JSON object of at most a few kB")
        command: Any = json.loads(descriptor.command)
        if not isinstance(command, dict) or not isinstance(command.get("call"), str):
            raise InvalidArgumentError('the command must be {"call": name, "args": {...}}')
        vectors = _read_vectors(reader, limits.max_request_bytes)
        scope = context.get_middleware("auth").scope
        args = command.get("args")
        return self.service.call(command["call"], {} if args is None else args, vectors, scope, context.is_cancelled)

    # the other RPCs: refused, typed
    def do_get(self, context, ticket):
        raise _unsupported("DoGet")

    def do_put(self, context, descriptor, reader, writer):
        raise _unsupported("DoPut")

    def do_action(self, context, action):
        raise _unsupported("DoAction")

    def list_actions(self, context):
        raise _unsupported("ListActions")

    def list_flights(self, context, criteria):
        raise _unsupported("ListFlights")

    def get_flight_info(self, context, descriptor):
        raise _unsupported("GetFlightInfo")

    def get_schema(self, context, descriptor):
        raise _unsupported("GetSchema")


def _read_vectors(reader, max_bytes: int) -> np.ndarray | None:
    batches, size = [], 0
    try:
        for chunk in reader:
            if chunk.data is None:
                continue
            size += chunk.data.nbytes
            if size > max_bytes:
                raise RequestTooLargeError(f"the request is larger than {max_bytes} bytes")
            batches.append(chunk.data)
    except pa.ArrowInvalid:  # the client sent no stream (a call without vectors)
        return None
    if not batches:
        return None
    table = pa.Table.from_batches(batches)
    if (
        table.num_columns != 1
        or not pa.types.is_list(table.schema.field(0).type)
        and not pa.types.is_fixed_size_list(table.schema.field(0).type)
    ):
        raise InvalidArgumentError("query vectors must be one list column of numbers")
    column = table.column(0).combine_chunks()
    if column.null_count:
        raise InvalidArgumentError("query vectors must not be null")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if len(lengths) == 0 or (lengths != lengths[0]).any():
        raise InvalidArgumentError("query vectors must all have the same length")
    values = column.flatten()
    if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
        raise InvalidArgumentError("query vectors must be numbers")
    return values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(column), int(lengths[0]))
