"""gradstore serve over HTTP (uvicorn on localhost): the JSON endpoints equal the local store, bearer tokens and
the login cookie, typed 4xx for bad requests (a hypothesis fuzz over every endpoint: never a 5xx), the OpenAPI
schema, and the live report page in Debian Chromium."""

from __future__ import annotations

import dataclasses
import json

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from served_store import DIM, READ, RUN, WRITE, make_store

from gradstore.serve import Tokens, serve


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("serve-http") / "store")


@pytest.fixture(scope="module")
def server(local):
    tokens = Tokens.parse(f"{READ}, {WRITE}:write")
    with serve(local.uri, tokens=tokens, flight_port=None, http_port=0, refresh_s=0.0) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, headers={"Authorization": f"Bearer {READ}"}, timeout=120) as client:
        yield client


def _rows(table) -> list[dict]:
    return [
        {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in r.items()}
        for r in table.to_pylist()
    ]


def test_endpoints_equal_the_local_store(http, local):
    answer = http.post("/api/attribute", json={"run": RUN, "k": 4, "method": "fisher", "opponents": True}).json()
    assert answer["rows"] == _rows(local.attribute(run=RUN, k=4, method="fisher", opponents=True, write=False))
    assert answer["version"] == local.core.dataset("gradients").version
    vectors = np.random.default_rng(3).standard_normal((2, DIM), dtype=np.float32)
    answer = http.post(
        "/api/attribute", json={"run": RUN, "vectors": vectors.tolist(), "k": 3, "method": "grad-dot"}
    ).json()
    assert answer["rows"] == _rows(local.attribute(vectors, run=RUN, k=3, method="grad-dot", write=False))
    answer = http.post("/api/self_influence", json={"run": RUN, "method": "grad-dot"}).json()
    assert answer["rows"] == _rows(local.self_influence(run=RUN, method="grad-dot", write=False))
    answer = http.post("/api/select", json={"run": RUN, "target": ["q-0", "q-1"], "budget": 5}).json()
    assert answer["rows"] == _rows(local.select(["q-0", "q-1"], run=RUN, budget=5))
    query = "SELECT source, count(*) AS n FROM examples GROUP BY source ORDER BY source"
    assert http.post("/api/sql", json={"query": query}).json()["rows"] == _rows(local.sql(query).arrow().read_all())
    assert http.get("/api/runs").json()["rows"][0]["run_id"] == RUN
    assert http.get("/api/info").json()["value"]["runs"] == [RUN]


def test_tokens_are_required(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as anonymous:
        assert anonymous.get("/api/runs").status_code == 401
        wrong = anonymous.get("/api/runs", headers={"Authorization": "Bearer not-the-token-0123456789"})
        assert wrong.status_code == 401 and wrong.json()["error"] == "AuthError"
        assert anonymous.post("/api/sql", json={"query": "SELECT 1"}).status_code == 401
        assert "Access token" in anonymous.get("/").text  # the login form, no data
        assert anonymous.get("/report", follow_redirects=False).status_code == 303
        assert anonymous.post("/login", data={"token": "nope"}).status_code == 401
        cookie = anonymous.post("/login", data={"token": READ}).headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "secure" not in cookie  # plain http


def test_writes_are_refused_on_a_read_only_server(http, server):
    refused = http.post("/api/attribute", json={"run": RUN, "method": "grad-dot", "write": True})
    assert refused.status_code == 403 and "read-only" in refused.json()["message"]
    with httpx.Client(base_url=server.http_url, headers={"Authorization": f"Bearer {WRITE}"}, timeout=60) as writer:
        assert writer.post("/api/attribute", json={"run": RUN, "method": "grad-dot", "write": True}).status_code == 403


@pytest.mark.parametrize(
    ("path", "body", "code", "error"),
    [
        ("/api/attribute", {"run": "nope", "method": "grad-dot"}, 404, "UnknownRunError"),
        ("/api/attribute", {"run": RUN, "k": 0, "method": "grad-dot"}, 400, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "method": "grad-dot", "where": "1=1) OR (1=1"}, 400, "InvalidFilterError"),
        ("/api/attribute", {"run": RUN, "queries": ["nope"], "method": "grad-dot"}, 404, "MissingIdsError"),
        ("/api/attribute", {"run": RUN, "k": 100000}, 413, "RequestTooLargeError"),
        ("/api/attribute", {"run": RUN, "engine": "ray"}, 422, "InvalidArgumentError"),
        (
            "/api/attribute",
            {"run": RUN, "vectors": [[1.0] * (DIM + 1)], "method": "grad-dot"},
            400,
            "SchemaMismatchError",
        ),
        ("/api/sql", {"query": "DROP TABLE scores"}, 400, "SQLError"),
        ("/api/sql", {"query": "SELECT * FROM read_csv('/etc/passwd')"}, 400, "SQLError"),
        ("/api/sql", {"query": 3}, 422, "InvalidArgumentError"),
        ("/api/select", {"run": RUN, "budget": -1}, 400, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "method": "fisher", "damping": 0}, 400, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "method": "fisher", "damping": 1e300}, 400, "InvalidArgumentError"),
        ("/api/self_influence", {"run": RUN, "method": "fisher", "damping": -1}, 400, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "method": "fisher", "damping": "abc"}, 422, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "method": "nope"}, 400, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "k": 2.5}, 422, "InvalidArgumentError"),
        # no coercion the local store and Flight refuse: a bool is not a number, a string not a number nor a bool
        ("/api/attribute", {"run": RUN, "method": "fisher", "damping": True}, 422, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "method": "fisher", "damping": "nan"}, 422, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "k": True}, 422, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "k": "3"}, 422, "InvalidArgumentError"),
        ("/api/attribute", {"run": RUN, "opponents": "yes"}, 422, "InvalidArgumentError"),
        ("/api/self_influence", {"run": RUN, "method": "fisher", "damping": False}, 422, "InvalidArgumentError"),
        ("/api/select", {"run": RUN, "budget": True}, 422, "InvalidArgumentError"),
    ],
)
def test_bad_requests_get_a_typed_4xx(http, path, body, code, error):
    response = http.post(path, json=body)
    assert (response.status_code, response.json()["error"]) == (code, error), response.text
    assert http.get("/api/runs").status_code == 200  # still serving


def test_malformed_and_oversized_bodies(http, server):
    assert http.post("/api/sql", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    limits = server.service.limits
    server.service.limits = dataclasses.replace(limits, max_body_bytes=1000)
    try:
        response = http.post("/api/sql", json={"query": "SELECT 1 -- " + "x" * 2000})
        assert (response.status_code, response.json()["error"]) == (413, "RequestTooLargeError")
        chunked = http.post("/api/sql", content=iter([b'{"query": "SELECT 1"}']))  # no Content-Length
        assert chunked.status_code == 411
    finally:
        server.service.limits = limits


def test_openapi_schema_lists_the_endpoints(http):
    schema = http.get("/openapi.json").json()
    assert {"/api/attribute", "/api/sql", "/api/self_influence", "/api/select", "/api/runs", "/api/info"} <= set(
        schema["paths"]
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "run",
    "queries",
    "vectors",
    "k",
    "method",
    "checkpoint",
    "damping",
    "blocks",
    "kind",
    "opponents",
    "where",
    "target",
    "budget",
    "preconditioner",
    "aggregate",
    "query",
    "split",
    "rerank",
    "write",
]
VALUES = JSON | st.sampled_from([RUN, "grad-dot", "fisher", "q-0", ["q-0"], 3, 0.5, "exact", "layer"])
BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6) | JSON


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/api/attribute", "/api/self_influence", "/api/select", "/api/sql"]), body=BODIES)
def test_fuzzed_bodies_never_get_a_5xx(http, path, body):
    response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code < 500, (path, body, response.text)


# ---------------------------------------------------------------------------------------------- in a browser
def test_the_live_report_in_the_browser(browser, server, local):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.http_url + "/")
    page.fill("#token", READ)
    page.click("#sign-in")
    page.wait_for_selector(".query-item")
    assert page.locator(".query-item").count() == 6
    page.fill("#query-search", "q-3")
    page.locator(".query-item:visible").first.click()
    page.wait_for_selector(".score-bars .bars path")
    assert page.locator(".result").count() == 1  # grad-dot
    local.attribute(["q-3"], run=RUN, k=4, method="fisher", damping=0.2)  # another process writes scores
    page.reload()
    page.fill("#query-search", "q-3")
    page.locator(".query-item:visible").first.click()
    page.wait_for_selector(".score-bars .bars path")
    assert page.locator(".result").count() == 2  # the page is live: fisher's answer is there
    assert errors == []
    page.close()
