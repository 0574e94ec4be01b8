"""The refusals particular to a server (each a :class:`~gradstore.GradstoreError` with an HTTP status, see
:func:`gradstore.serve.service.status`)."""

from __future__ import annotations

from gradstore.errors import GradstoreError, InvalidArgumentError


class RequestTooLargeError(InvalidArgumentError):
    """A request or its result over the server's limits (413)."""


class NoModelError(InvalidArgumentError):
    """A text query to a server started without ``--model`` (404)."""


class NotBuiltError(InvalidArgumentError):
    """The call needs something a read-only server does not build (a derived run, a FAISS index): the message says
    how the operator builds it (409)."""


class QueryTimeoutError(InvalidArgumentError):
    """A SQL statement ran past the server's ``sql_timeout_s`` and was interrupted (400: narrow it)."""


class QueryCancelledError(InvalidArgumentError):
    """A SQL statement whose client went away, interrupted (nobody reads the answer)."""


class ServerBusyError(GradstoreError):
    """The server runs and queues as many requests as its limits allow (503: retry later)."""
