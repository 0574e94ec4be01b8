"""The HTTP side of ``gradstore serve``: JSON endpoints for the same calls as Flight (OpenAPI schema at
``/openapi.json``, docs at ``/docs``) and the report page, live, for people.

FastAPI on uvicorn: the request bodies are typed models, so the OpenAPI schema, the validation (422 for a body
that does not fit) and the docs page come from one declaration; uvicorn is the ASGI server both ship for.

Authentication: ``Authorization: Bearer <token>``, or for a browser the ``gradstore_token`` cookie set by
``POST /login`` (HttpOnly, SameSite=Strict, Secure over TLS; the token never appears in a URL). The token is checked
by :class:`~gradstore.serve.guard.Guard` before any body is read; the endpoints work in threads (reads side by
side) and a client that goes away interrupts its SQL statement. Every refusal is ``{"error", "message"}`` with a
4xx (503 when the server is busy)."""

from __future__ import annotations

import html
import json
import logging
import math
import threading
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal
from urllib.parse import parse_qs

import anyio
import pyarrow as pa
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from gradstore.answers.report import ReportOptions, gather, render
from gradstore.errors import GradstoreError
from gradstore.methods import DEFAULT_METHOD
from gradstore.serve.auth import AuthError, Tokens
from gradstore.serve.guard import COOKIE, SCOPE_KEY, Guard, bearer
from gradstore.serve.service import RequestTooLargeError, Service, error_body, status

log = logging.getLogger("gradstore.serve")
Ids = list[str] | str | None
DISCONNECT_POLL_S = 0.1  # how often a request's connection is checked while its call runs
REFUSALS = (400, 401, 403, 404, 409, 411, 413, 422, 503)


class _Body(BaseModel):
    # strict: no coercion the local store and Flight refuse (``true`` as damping 1.0 or k 1, ``"3"`` as k 3)
    model_config = ConfigDict(extra="forbid", strict=True)


class AttributeRequest(_Body):
    run: str
    queries: Ids = Field(None, description="query ids, a SQL filter on the stored query rows, or null for all")
    vectors: list[list[float]] | None = Field(None, description="raw query vectors [queries, dim] instead")
    k: int = 10
    method: str = DEFAULT_METHOD
    checkpoint: str | None = None
    query_checkpoint: str | None = None
    checkpoints: list[str] | None = None
    damping: float | None = None
    blocks: str = "auto"
    kind: str = "exact"
    opponents: bool = False
    split: str = "train"
    where: str | None = None
    rerank: int = 0
    write: bool = False


class SelfInfluenceRequest(_Body):
    run: str
    method: str = DEFAULT_METHOD
    checkpoint: str | None = None
    damping: float | None = None
    blocks: str = "auto"
    split: str = "train"
    where: str | None = None
    write: bool = False


class SelectRequest(_Body):
    run: str
    target: Ids = None
    vectors: list[list[float]] | None = None
    budget: float = 0.05
    preconditioner: str = "grad-dot"
    aggregate: Literal["max", "mean"] = "max"
    checkpoints: list[str] | None = None
    damping: float | None = None
    blocks: str = "auto"
    split: str = "train"
    where: str | None = None


class TextRequest(_Body):
    prompt: str = Field(description="the prompt (context) of the text query")
    completion: str = Field("", description="the completion whose loss the query gradient is of")
    run: str
    k: int = 10
    method: str = DEFAULT_METHOD
    checkpoint: str | None = Field(None, description="the training rows' checkpoint (a run with several needs it)")


class SQLRequest(_Body):
    query: str


class Result(BaseModel):
    version: int | None = Field(description="the gradients table version this answer read")
    rows: list[dict[str, Any]]


class ErrorBody(BaseModel):
    error: str
    message: str


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return [_json_value(row) for row in table.to_pylist()]


async def _in_thread(
    request: Request, work: Callable[[Callable[[], bool]], Any], limiter: anyio.CapacityLimiter | None = None
) -> Any:
    """``work(gone)`` in a worker thread (reads run side by side; ``limiter``: how many threads), ``gone()``
    turning true once the client has disconnected (a running SQL statement is then interrupted)."""
    gone = threading.Event()

    async def watch() -> None:
        while not await request.is_disconnected():
            await anyio.sleep(DISCONNECT_POLL_S)
        gone.set()

    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        try:
            outcome["value"] = await anyio.to_thread.run_sync(work, gone.is_set, limiter=limiter)
        except Exception as error:  # raised below, outside the task group (not as an exception group)
            outcome["error"] = error
        group.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def create_app(service: Service, tokens: Tokens) -> FastAPI:
    """The ASGI app serving ``service`` to holders of ``tokens``."""
    app = FastAPI(
        title="gradstore",
        summary="Training data attribution lookups over one gradient store.",
        version="1",
        responses={code: {"model": ErrorBody} for code in REFUSALS},
    )
    app.add_middleware(Guard, service=service, tokens=tokens)
    threads: list[anyio.CapacityLimiter] = []  # made in the event loop: a thread for every request slot

    def limiter() -> anyio.CapacityLimiter:
        if not threads:
            threads.append(anyio.CapacityLimiter(max(40, service.limits.max_concurrent)))
        return threads[0]

    def scope_of(request: Request) -> str:
        checked = request.scope.get("state", {}).get(SCOPE_KEY)
        if checked is not None:
            return checked
        return tokens.check(bearer(request.scope)).scope

    @app.exception_handler(GradstoreError)
    async def refused(request: Request, error: GradstoreError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status(error) == 401 else None
        return JSONResponse(error_body(error), status_code=status(error), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()))
        return JSONResponse(
            {"error": "InvalidArgumentError", "message": f"{where}: {first.get('msg', 'invalid request')}"},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        name = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(error.status_code, "InvalidArgumentError")
        try:
            phrase = HTTPStatus(error.status_code).phrase
        except ValueError:
            phrase = "refused"
        message = error.detail if isinstance(error.detail, str) else phrase
        if message == "There was an error parsing the body":
            message = "the body is not JSON this server reads (malformed, or nested too deeply)"
        return JSONResponse(
            {"error": name, "message": message}, status_code=error.status_code, headers=getattr(error, "headers", None)
        )

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:  # a bug: said without details
        log.exception("http call failed")
        return JSONResponse({"error": "InternalError", "message": f"internal error: {type(error).__name__}"}, 500)

    async def answer(request: Request, name: str, body: BaseModel | None, scope: str) -> dict[str, Any]:
        args = body.model_dump(exclude_unset=True) if body is not None else {}
        vectors = args.pop("vectors", None)

        def work(gone: Callable[[], bool]) -> dict[str, Any]:
            result = service.call(name, args, vectors, scope, gone)
            if result.value is not None:
                return {"version": result.version, "value": _json_value(result.value)}
            return {"version": result.version, "rows": _rows(result.table)}

        return await _in_thread(request, work, limiter())

    @app.post("/api/attribute", response_model=Result)
    async def attribute(request: Request, body: AttributeRequest, scope: str = Depends(scope_of)) -> dict[str, Any]:
        """Top-k proponents (and opponents) of stored queries or raw vectors, as ``store.attribute``."""
        return await answer(request, "attribute", body, scope)

    @app.post("/api/self_influence", response_model=Result)
    async def self_influence(
        request: Request, body: SelfInfluenceRequest, scope: str = Depends(scope_of)
    ) -> dict[str, Any]:
        """``g^T P^-1 g`` of the training rows, as ``store.self_influence``."""
        return await answer(request, "self_influence", body, scope)

    @app.post("/api/select", response_model=Result)
    async def select(request: Request, body: SelectRequest, scope: str = Depends(scope_of)) -> dict[str, Any]:
        """LESS-style selection, as ``store.select``."""
        return await answer(request, "select", body, scope)

    @app.post("/api/attribute_text", response_model=Result)
    async def attribute_text(request: Request, body: TextRequest, scope: str = Depends(scope_of)) -> dict[str, Any]:
        """Proponents of a typed prompt and completion: the query gradient is computed on the server's
        ``--model`` with the run's projection (404 when the server was started without ``--model``)."""

        def work(gone: Callable[[], bool]) -> dict[str, Any]:
            result = service.attribute_text(
                body.prompt, body.completion, run=body.run, k=body.k, method=body.method, checkpoint=body.checkpoint
            )
            return {"version": result.version, "rows": _rows(result.table)}

        return await _in_thread(request, work, limiter())

    @app.post("/api/sql", response_model=Result)
    async def sql(request: Request, body: SQLRequest, scope: str = Depends(scope_of)) -> dict[str, Any]:
        """One read-only DuckDB statement (a ``SELECT`` over the store's tables and macros), as ``store.sql``;
        interrupted past the server's time limit or when the client goes away."""
        return await answer(request, "sql", body, scope)

    @app.get("/api/runs", response_model=Result)
    async def runs(request: Request, scope: str = Depends(scope_of)) -> dict[str, Any]:
        """The store's runs."""
        return await answer(request, "runs", None, scope)

    @app.get("/api/info")
    async def info(request: Request, scope: str = Depends(scope_of)) -> dict[str, Any]:
        """Tables, runs, dims and versions, as ``store.info``."""
        return await answer(request, "info", None, scope)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def home(request: Request) -> Response:
        try:
            scope_of(request)
        except AuthError:
            return HTMLResponse(LOGIN_PAGE)
        return RedirectResponse("/report", status_code=303)

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        body = await request.body()  # a urlencoded form of one field (no multipart parser needed); <= 8 KiB
        if len(body) > 8192:
            raise RequestTooLargeError("the login form is too large")
        token = (parse_qs(body.decode("utf-8", "replace")).get("token") or [""])[0]
        tokens.check(f"Bearer {token}")
        response = RedirectResponse("/report", status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https")
        return response

    @app.get("/report", response_class=HTMLResponse, include_in_schema=False)
    def report(request: Request, run: str | None = None, top: int = 10) -> Response:
        """The report page of the store as it is now (rendered per request from the current tables)."""
        try:
            scope_of(request)
        except AuthError:
            return RedirectResponse("/", status_code=303)
        if not 1 <= top <= service.limits.max_k:
            raise RequestTooLargeError(f"top must be in 1..{service.limits.max_k}")
        with service.report_lock, service.store.core.snapshot():
            page = render(gather(service.store.core, ReportOptions(run=run, top=top)))
        if service.model is not None:
            runs = service.store.info()["runs"]
            page = _with_text_box(page, run if run in runs else (runs[0] if runs else ""))
        return HTMLResponse(page)

    return app


def _with_text_box(page: str, run: str) -> str:
    """The report page with the text-query box (servers started with ``--model``) before its body ends."""
    box = TEXT_BOX.replace("__RUN__", html.escape(json.dumps(run), quote=True))
    # the report's policy lets the page reach nothing; the box may call this server's own API, nothing else
    page = page.replace("default-src 'none';", "default-src 'none'; connect-src 'self';", 1)
    at = page.rfind("</body>")
    return page[:at] + box + page[at:] if at >= 0 else page + box


TEXT_BOX = """
<section id="text-query" data-run="__RUN__"
 style="position:fixed;right:1em;bottom:1em;width:26em;background:#fff;border:1px solid #ccc;padding:.6em;
 font-family:sans-serif;font-size:13px;z-index:1000;max-height:60vh;overflow:auto">
<b>Ask the model's training data</b>
<form id="text-form">
<textarea id="text-prompt" rows="3" style="width:100%" placeholder="prompt"></textarea>
<input id="text-completion" style="width:100%" placeholder="completion">
<label>checkpoint <input id="text-checkpoint" style="width:8em" placeholder="(the run's)"></label>
<label>method <select id="text-method"><option>fisher</option><option>grad-dot</option><option>ekfac</option>
</select></label> <label>k <input id="text-k" type="number" value="10" min="1" max="100" style="width:4em"></label>
<button id="text-submit" type="submit">Find proponents</button>
</form>
<div id="text-status"></div><ol id="text-proponents"></ol>
</section>
<script>
(function () {
  var box = document.getElementById("text-query");
  var run = JSON.parse(box.dataset.run);
  document.getElementById("text-form").addEventListener("submit", function (event) {
    event.preventDefault();
    var status = document.getElementById("text-status");
    var list = document.getElementById("text-proponents");
    list.textContent = "";
    status.textContent = "computing the query gradient...";
    fetch("/api/attribute_text", {
      method: "POST", credentials: "same-origin", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({prompt: document.getElementById("text-prompt").value,
        completion: document.getElementById("text-completion").value, run: run,
        checkpoint: document.getElementById("text-checkpoint").value || null,
        method: document.getElementById("text-method").value,
        k: parseInt(document.getElementById("text-k").value, 10) || 10})
    }).then(function (response) {
      return response.json().then(function (body) { return {ok: response.ok, body: body}; });
    }).then(function (answer) {
      if (!answer.ok) { status.textContent = answer.body.error + ": " + answer.body.message; return; }
      status.textContent = "run " + run + ", gradients version " + answer.body.version;
      answer.body.rows.forEach(function (row) {
        var item = document.createElement("li");
        item.className = "text-proponent";
        item.textContent = row.example_id + "  " + Number(row.score).toPrecision(4);
        list.appendChild(item);
      });
    }).catch(function (error) { status.textContent = String(error); });
  });
})();
</script>
"""


LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gradstore</title></head>
<body style="font-family: sans-serif; max-width: 30em; margin: 4em auto">
<h1>gradstore</h1>
<form method="post" action="/login">
<label>Access token <input id="token" name="token" type="password" autocomplete="off" required></label>
<button id="sign-in" type="submit">Open the report</button>
</form></body></html>
"""
