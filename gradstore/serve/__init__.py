"""``gradstore serve``: one long-running process answering many clients from one warm store.

Arrow Flight for programmatic clients (:func:`gradstore.connect`), HTTP/JSON with an OpenAPI schema and the live
report page for people (:mod:`gradstore.serve.http`). See docs/serve.md."""

from __future__ import annotations

from gradstore.serve.auth import AuthError, Tokens
from gradstore.serve.client import RemoteStore, ServerError, connect
from gradstore.serve.errors import NotBuiltError, QueryTimeoutError, ServerBusyError
from gradstore.serve.server import Server, serve
from gradstore.serve.service import Limits, RequestTooLargeError, Service

__all__ = [
    "AuthError",
    "Limits",
    "NotBuiltError",
    "QueryTimeoutError",
    "RemoteStore",
    "RequestTooLargeError",
    "Server",
    "ServerBusyError",
    "ServerError",
    "Service",
    "Tokens",
    "connect",
    "serve",
]
