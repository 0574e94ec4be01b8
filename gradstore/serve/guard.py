"""What stands between the network and the HTTP app: nothing is read, parsed or queued for a client before its
token is accepted, and no client holds the server's memory or connections for long.

- :class:`Guard` (ASGI middleware, outermost but for Starlette's error handler): for every path but the public
  pages (the login form, ``POST /login``, ``/report``'s redirect, the OpenAPI schema and docs), the bearer token
  (``Authorization`` header or the login cookie) is checked from the headers alone; a request without a valid one
  gets its 401 before a byte of its body is read, and the connection is closed (``Connection: close``) so that
  the unread body is never read either. Then the body's declared size: a body needs a ``Content-Length`` (411)
  of at most ``Limits.max_body_bytes`` (413, again before reading it; ``/login`` 8 KiB). Then a request slot
  (:class:`~gradstore.serve.admission.Admission`, ``Limits.max_concurrent``) is awaited before the app reads the
  body: queued requests hold no body in memory. The token's scope travels to the endpoints in
  ``scope["state"]["gradstore_scope"]``.
- :func:`protocol_class` (uvicorn's h11 protocol with read deadlines): a connection must deliver a request's
  headers within ``Limits.header_timeout_s`` (from the connection's start, or from the first byte of a later
  request on it; an idle kept-alive connection is closed by uvicorn after 5 s) and its body within
  ``Limits.body_timeout_s`` after them, else it is closed: slow clients cannot hold connections open. A response
  sent before the request's body was read closes the connection. A client that stops reading its response (the
  unsent bytes do not go down for ``Limits.body_timeout_s``) has its connection aborted: it cannot keep an answer
  of up to ``Limits.max_result_bytes`` in the server's memory for as long as it likes. One client address holds at most
  ``Limits.max_connections_per_client`` open connections: a further one gets a 429 and is closed before anything
  of it is read."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from gradstore.serve.auth import AuthError, Tokens
from gradstore.serve.errors import RequestTooLargeError, ServerBusyError
from gradstore.serve.service import Service, error_body, status

COOKIE = "gradstore_token"
SCOPE_KEY = "gradstore_scope"
#: Paths served without a token (each checks one itself where it shows anything of the store).
PUBLIC = frozenset(
    {
        ("GET", "/"),
        ("POST", "/login"),
        ("GET", "/report"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/docs/oauth2-redirect"),
        ("GET", "/redoc"),
    }
)
LOGIN_BYTES = 8192
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _cookie(scope: dict[str, Any], name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if not raw:
        return None
    for part in raw.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value.strip().strip('"')
    return None


def bearer(scope: dict[str, Any]) -> str | None:
    """The ``Authorization`` header of a request, or its login cookie as one."""
    header = _header(scope, b"authorization")
    if header is None:
        token = _cookie(scope, COOKIE)
        if token:
            header = f"Bearer {token}"
    return header


class Guard:
    """ASGI middleware: auth, body size and a request slot before the app (see the module docstring)."""

    def __init__(self, app: Any, service: Service, tokens: Tokens) -> None:
        self.app = app
        self.service = service
        self.tokens = tokens

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.service.limits
        method, path = scope["method"], scope["path"]
        state = scope.setdefault("state", {})
        try:
            token = self.tokens.check(bearer(scope))
            state[SCOPE_KEY] = token.scope
        except AuthError as error:
            if (method, path) not in PUBLIC and (method != "HEAD" or ("GET", path) not in PUBLIC):
                await _refuse(send, error, {"www-authenticate": "Bearer"})
                return
        length = _header(scope, b"content-length")
        cap = LOGIN_BYTES if path == "/login" else limits.max_body_bytes
        if _header(scope, b"transfer-encoding") is not None or (length is None and method in BODY_METHODS):
            await _refuse(send, None, status_code=411, body={"error": "InvalidArgumentError",
                          "message": "a request body needs a Content-Length (no chunked bodies)"})  # fmt: skip
            return
        if length is not None and (not length.strip().isdigit() or int(length) > cap):
            await _refuse(send, RequestTooLargeError(f"the request body is larger than {cap} bytes"))
            return
        if SCOPE_KEY not in state:  # a public page: no slot needed, nothing heavy behind it
            await self.app(scope, receive, send)
            return
        admission = self.service.admission
        try:
            await admission.acquire_async(limits.queue_timeout_s)
        except ServerBusyError as error:
            await _refuse(send, error, {"retry-after": "1"})
            return
        try:
            await self.app(scope, receive, send)
        finally:
            admission.release()


async def _refuse(
    send: Any,
    error: BaseException | None,
    headers: dict[str, str] | None = None,
    *,
    status_code: int | None = None,
    body: dict[str, Any] | None = None,
) -> None:
    """A JSON refusal that closes the connection (the request's body, if any, is never read)."""
    payload = json.dumps(body if body is not None else error_body(error)).encode()
    code = status_code if status_code is not None else status(error)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(b"connection", b"close")] + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": code, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


# ---------------------------------------------------------------------------------------------- read deadlines
class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines (subclassed per server by :func:`protocol_class`)."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    per_client = 256
    open_by_client: Counter[str]  # this server's open connections by client address (one event loop: no lock)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._seen_cycle: Any = None
        peer = transport.get_extra_info("peername")
        self._client: str | None = str(peer[0]) if peer else ""
        if self.open_by_client[self._client] >= self.per_client:
            self._client = None
            transport.write(_TOO_MANY)
            transport.close()
            return
        self.open_by_client[self._client] += 1
        self._arm(self.header_timeout_s)

    def _arm(self, seconds: float | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, self._expired)

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()  # the app (if running) sees http.disconnect

    def data_received(self, data: bytes) -> None:
        between = self.cycle is None or self.cycle.response_complete  # waiting for a request's headers
        before = self._seen_cycle
        super().data_received(data)
        started = self._seen_cycle is not before
        if between and not started and self._deadline is None and not self.transport.is_closing():
            self._arm(self.header_timeout_s)  # a request's first bytes: the rest of its headers have a deadline

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._seen_cycle:  # a request's headers arrived
            self._seen_cycle = self.cycle
            self._arm(self.body_timeout_s if self.cycle.more_body else None)
        elif (
            self.cycle is not None
            and not self.cycle.more_body
            and self._deadline is not None
            and not self.cycle.response_complete
        ):
            self._arm(None)  # the body is in: the app works without a client deadline

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:  # answered before the body was read: do not read it now
            self.transport.close()
            return
        if self.cycle is self._seen_cycle:  # idle now: uvicorn's keep-alive timeout closes it if nothing comes
            self._arm(None)

    def pause_writing(self) -> None:
        """The client reads the response slower than it is written: from now on it must take some of the unsent
        bytes every ``body_timeout_s``, else the connection is aborted and its unsent response dropped (closing
        would wait for a client that never reads, holding the response in memory)."""
        super().pause_writing()
        self._watch_stall(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unwatch_stall()

    def _watch_stall(self, unsent: int) -> None:
        self._unwatch_stall()
        self._stall = self.loop.call_later(self.body_timeout_s, self._stalled, unsent)

    def _unwatch_stall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self, before: int) -> None:
        self._stall = None
        if not self.flow.write_paused:
            return
        unsent = self.transport.get_write_buffer_size()
        if unsent >= before:  # nothing taken for body_timeout_s
            self.transport.abort()
            return
        self._watch_stall(unsent)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        self._unwatch_stall()
        if self._client is not None:
            self.open_by_client[self._client] -= 1
            if not self.open_by_client[self._client]:
                del self.open_by_client[self._client]
        super().connection_lost(exc)


def _too_many() -> bytes:
    body = json.dumps(
        {
            "error": "ServerBusyError",
            "message": "too many open connections from this address: close idle ones (or reuse one connection)",
        }
    ).encode()
    head = f"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return (head + "connection: close\r\nretry-after: 1\r\n\r\n").encode() + body


_TOO_MANY = _too_many()


def protocol_class(header_timeout_s: float, body_timeout_s: float, per_client: int) -> type[DeadlineH11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with these deadlines and this many connections per
    client address (counted per class: one class per server)."""
    return type(
        "GradstoreH11Protocol",
        (DeadlineH11Protocol,),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "per_client": per_client,
            "open_by_client": Counter(),
        },
    )
