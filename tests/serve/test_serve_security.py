"""gradstore serve on an open network (issue 36), a real server on localhost: the token is checked before any body
byte is read (HTTP and Flight), slow or oversized clients are cut off, SQL is bounded (time, rows, bytes) and
sandboxed (no settings, paths or files), a read-only server never writes the store, client input never gets a 5xx,
and a slow SQL statement does not hold up a lookup. No assertion is about elapsed time: every wait is an event or a
bounded loop whose timeout only guards against a hang."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from served_store import DIM, N_TRAIN, READ, RUN, WRITE, make_store

import gradstore
from gradstore.serve import Limits, Tokens, serve

GUARD_S = 120  # a hang guard, never a speed assert
LONG_SQL = "SELECT sum(a.range * b.range) AS s FROM range(1000000000) a, range(1000000000) b"  # runs for hours
MB = 2**20


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("serve-security") / "store")


@pytest.fixture(scope="module")
def server(local):
    tokens = Tokens.parse(f"{READ}, {WRITE}:write")
    limits = Limits(header_timeout_s=2.0, body_timeout_s=2.0, max_body_bytes=4 * MB, sql_threads=1)
    with serve(local.uri, tokens=tokens, flight_port=0, http_port=0, refresh_s=0.0, limits=limits) as running:
        yield running


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.http_url, headers={"Authorization": f"Bearer {READ}"}, timeout=GUARD_S) as c:
        yield c


# ---------------------------------------------------------------------------------------------- raw HTTP
def _connect(server) -> socket.socket:
    address = urlsplit(server.http_url)
    sock = socket.create_connection((address.hostname, address.port), timeout=GUARD_S)
    return sock


def _head(path: str, length: int, token: str | None = None, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Content-Type: application/json"]
    lines.append(f"Content-Length: {length}")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes the connection (reads until EOF or reset; the socket's timeout guards a hang)."""
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def _rss() -> int:
    return psutil.Process().memory_info().rss


# ---------------------------------------------------------------------------------------------- 1. auth first
def test_an_unauthenticated_huge_body_gets_401_before_the_body_is_sent(server, http):
    rss = _rss()
    for _ in range(5):
        with _connect(server) as sock:
            sock.sendall(_head("/api/attribute", 50 * MB) + b'{"vectors": [[')  # 50 MB announced, 14 bytes sent
            code, headers, body = _response(sock)
            assert code == 401 and json.loads(body)["error"] == "AuthError"
            assert headers["connection"] == "close" and headers["www-authenticate"] == "Bearer"
            try:  # whatever the client goes on sending is never read: the connection is closed
                for _ in range(8):
                    sock.sendall(b"0" * MB)
            except OSError:
                pass
            assert _closed_by_server(sock)
    assert _rss() - rss < 40 * MB  # five 50 MB bodies were never read (reading one costs GBs parsed)
    assert http.get("/api/runs").status_code == 200


def test_a_body_over_the_cap_gets_413_before_it_is_sent(server):
    with _connect(server) as sock:
        sock.sendall(_head("/api/sql", 5 * MB, READ))  # over max_body_bytes (4 MiB): no byte of it sent
        code, headers, body = _response(sock)
        assert code == 413 and json.loads(body)["error"] == "RequestTooLargeError"
        assert _closed_by_server(sock)
    with _connect(server) as sock:  # no Content-Length: refused, not read
        sock.sendall(
            b"POST /api/sql HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            + f"Authorization: Bearer {READ}\r\n\r\n".encode()
        )
        code, _, body = _response(sock)
        assert code == 411 and set(json.loads(body)) == {"error", "message"}


def test_flight_refuses_an_unauthenticated_stream_before_reading_it(server):
    client = flight.FlightClient(server.flight_uri)
    command = json.dumps({"call": "attribute", "args": {"run": RUN, "method": "grad-dot"}}).encode()
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8 * MB, np.float32)), DIM)  # 32 MB
    rss = _rss()
    with pytest.raises(flight.FlightUnauthenticatedError):
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command))
        try:
            writer.begin(pa.schema([("vector", vectors.type)]))
            writer.write_table(pa.table({"vector": vectors}))
            writer.done_writing()
        except flight.FlightError:
            pass
        reader.read_all()
    assert _rss() - rss < 32 * MB
    client.close()


# ---------------------------------------------------------------------------------------------- 3. slow clients
def test_slow_clients_are_dropped_and_others_are_served(server, http):
    slow = []
    for _ in range(20):  # headers that never end, and a body that never comes (with and without a token)
        sock = _connect(server)
        sock.sendall(b"POST /api/sql HTTP/1.1\r\nHost: x\r\nContent-")
        slow.append(sock)
    for token in (READ, None):
        sock = _connect(server)
        sock.sendall(_head("/api/sql", 100, token) + b"{")  # Content-Length: 100 and one byte
        slow.append(sock)
    assert http.get("/api/runs").status_code == 200  # served meanwhile
    for sock in slow:
        assert _closed_by_server(sock)  # closed by the server's header/body deadline, not by the guard
        sock.close()
    assert http.get("/api/runs").status_code == 200


def test_one_client_address_holds_a_bounded_number_of_connections(local):
    limits = Limits(max_connections_per_client=4, header_timeout_s=120.0, sql_threads=1)
    with serve(local.uri, tokens=Tokens.parse(READ), flight_port=None, http_port=0, limits=limits) as running:
        held = [_connect(running) for _ in range(4)]  # idle connections: within the limit, kept open
        extra = _connect(running)
        code, headers, body = _response(extra)  # refused at once, before it sends a byte
        assert (code, json.loads(body)["error"], headers["connection"]) == (429, "ServerBusyError", "close")
        assert "too many open connections" in json.loads(body)["message"] and _closed_by_server(extra)
        held[0].sendall(_head("/api/runs", 0, READ, method="GET"))
        assert _response(held[0])[0] == 200  # the held ones are served
        for sock in held:
            sock.close()
        for _ in range(200):  # the server counts a connection out when it sees it close (no fixed wait)
            with httpx.Client(base_url=running.http_url, headers={"Authorization": f"Bearer {READ}"}) as fresh:
                if fresh.get("/api/runs").status_code == 200:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("closed connections were never counted out")


def test_a_client_that_stops_reading_its_answer_is_cut_off(local):
    """A 40 MB answer its client never reads: without a deadline the connection (and the answer, in the server's
    memory) stayed for as long as the client liked, past every timeout, 256 of them per client address."""
    limits = Limits(body_timeout_s=1.0, sql_threads=1)
    with serve(local.uri, tokens=Tokens.parse(READ), flight_port=None, http_port=0, limits=limits) as running:
        open_by_client = running.http.config.http.open_by_client
        address = urlsplit(running.http_url)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the answer waits in the server's buffer
        sock.settimeout(GUARD_S)
        sock.connect((address.hostname, address.port))
        body = json.dumps({"query": "SELECT repeat('x', 1000000) AS x FROM range(40)"}).encode()
        sock.sendall(_head("/api/sql", len(body), READ) + body)
        _wait_for(lambda: open_by_client, "the connection is counted")
        _wait_for(lambda: not open_by_client, "the server drops the connection of a client that does not read")
        received = 0
        try:
            while chunk := sock.recv(MB):
                received += len(chunk)
        except ConnectionResetError:
            pass
        sock.close()
        assert received < 40 * MB  # aborted: the rest of the answer was dropped, not sent
        with httpx.Client(base_url=running.http_url, headers={"Authorization": f"Bearer {READ}"}) as http:
            assert http.post("/api/sql", json={"query": "SELECT 1 AS one"}).json()["rows"] == [{"one": 1}]


# ---------------------------------------------------------------------------------------------- 3. SQL bounds
def test_sql_results_are_capped_while_streaming(server, http):
    rss = _rss()
    response = http.post("/api/sql", json={"query": "SELECT * FROM range(100000000)"})
    assert response.status_code == 413 and response.json()["error"] == "RequestTooLargeError"
    assert "200000 rows" in response.json()["message"]
    assert _rss() - rss < 400 * MB  # stopped at the cap, not after 10^8 rows (+750 MB built whole)
    response = http.post("/api/sql", json={"query": "SELECT repeat('x', 100000000) AS x"})
    assert response.status_code == 413 and "bytes" in response.json()["message"]


def test_a_sql_statement_past_the_time_limit_is_interrupted(server, http):
    sandbox = server.service.sql
    timeout, sandbox.timeout_s = sandbox.timeout_s, 0.3
    try:
        response = http.post("/api/sql", json={"query": LONG_SQL})
        assert (response.status_code, response.json()["error"]) == (400, "QueryTimeoutError")
        with gradstore.connect(server.flight_uri, token=READ) as client, pytest.raises(gradstore.InvalidArgumentError):
            client.sql(LONG_SQL)
    finally:
        sandbox.timeout_s = timeout
    assert not sandbox.watchdog._watched


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


@pytest.fixture
def no_sql_timeout(server):
    """The statements of a test run until their client goes away (not interrupted by the time limit)."""
    sandbox = server.service.sql
    timeout, sandbox.timeout_s = sandbox.timeout_s, 3600.0
    yield
    sandbox.timeout_s = timeout


def test_a_client_that_goes_away_interrupts_its_statement(server, no_sql_timeout):
    watchdog = server.service.sql.watchdog
    sock = _connect(server)
    body = json.dumps({"query": LONG_SQL}).encode()
    sock.sendall(_head("/api/sql", len(body), READ) + body)
    _wait_for(lambda: len(watchdog._watched) == 1, "the statement runs")
    sock.close()  # the client goes away: the watchdog interrupts the statement
    _wait_for(lambda: not watchdog._watched, "the statement is interrupted")
    client = flight.FlightClient(server.flight_uri)  # over Flight: the call's deadline passes, the client cancels
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ}".encode())], timeout=0.5)
    command = json.dumps({"call": "sql", "args": {"query": LONG_SQL}}).encode()
    with pytest.raises(flight.FlightError):
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command), options)
        writer.done_writing()
        reader.read_all()
    _wait_for(lambda: not watchdog._watched, "the Flight statement is interrupted")
    client.close()


def test_sql_memory_and_spill_are_bounded(tmp_path, local):
    limits = Limits(sql_memory_bytes=64 * MB, sql_temp_bytes=16 * MB, sql_threads=1)
    auth = {"Authorization": f"Bearer {READ}"}
    with (
        serve(local.uri, tokens=Tokens.parse(READ), flight_port=None, http_port=0, limits=limits) as small,
        httpx.Client(base_url=small.http_url, headers=auth, timeout=GUARD_S) as c,
    ):
        response = c.post(
            "/api/sql", json={"query": "SELECT count(*) FROM (SELECT * FROM range(50000000) ORDER BY random())"}
        )
        assert (response.status_code, response.json()["error"]) == (400, "SQLError"), response.text
        assert "memory" in response.json()["message"].lower() or "temp" in response.json()["message"].lower()
        assert c.post("/api/sql", json={"query": "SELECT 1 AS one"}).json()["rows"] == [{"one": 1}]


SANDBOX = [
    "SELECT * FROM duckdb_settings()",
    "SELECT name, value FROM duckdb_settings() WHERE value LIKE '%/%'",
    "SELECT current_setting('temp_directory') AS t",
    "SELECT * FROM read_text('{temp}/x')",
    "SELECT * FROM glob('{temp}/*')",
    "SELECT * FROM glob('.tmp/*')",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM '/etc/passwd'",
    "SELECT * FROM pg_catalog.pg_settings",
    "SELECT * FROM pg_settings",
    "SELECT * FROM duckdb_temporary_files()",
    "SELECT * FROM query('SELECT * FROM duckdb_settings()')",
    "WITH pg_settings AS (SELECT 1) SELECT * FROM pg_settings",
    "SELECT * FROM (SELECT * FROM read_blob('{temp}/x'))",
    "SELECT 1 WHERE 1 IN (SELECT 1 FROM glob('/*'))",
    "SET memory_limit = '100GB'",
    "PRAGMA database_list",
    "ATTACH '/tmp/x.db'",
    "EXPLAIN SELECT 1",
    "SELECT 1; SELECT 2",
]


@pytest.mark.parametrize("query", SANDBOX)
def test_sql_discloses_no_settings_paths_or_files(server, http, query):
    temp = server.service.sql._temp
    Path(temp, "x").write_text("secret")
    response = http.post("/api/sql", json={"query": query.format(temp=temp)})
    assert (response.status_code, response.json()["error"]) == (400, "SQLError"), response.text
    assert temp not in response.text and "secret" not in response.text


def test_sql_still_reads_the_store_tables_and_macros(http, local):
    for query in (
        "SELECT source, count(*) AS n FROM examples GROUP BY source ORDER BY source",
        "WITH t AS (SELECT * FROM examples) SELECT count(*) AS n FROM t",
        "SELECT * FROM top_proponents('q-0', 3)",
        "SELECT count(*) AS n FROM range(10)",
    ):
        expected = local.sql(query).arrow().read_all().to_pylist()
        assert http.post("/api/sql", json={"query": query}).json()["rows"] == expected, query


def test_sql_says_what_a_macro_whose_table_is_missing_needs(http, local):
    assert not local.core.has_table("token_scores")
    response = http.post("/api/sql", json={"query": "SELECT * FROM top_tokens('q-0', 3)"})
    assert (response.status_code, response.json()["error"]) == (400, "SQLError")
    assert "token_scores" in response.json()["message"], response.text


def test_the_request_slots_queue_then_refuse(server, http):
    admission = server.service.admission
    held = [admission.acquire(GUARD_S) for _ in range(admission.running)]  # every slot taken
    waiting, admission.waiting = admission.waiting, 0
    try:
        busy = http.get("/api/runs")
        assert (busy.status_code, busy.json()["error"]) == (503, "ServerBusyError")
        with gradstore.connect(server.flight_uri, token=READ) as client, pytest.raises(gradstore.serve.ServerBusyError):
            client.runs()
    finally:
        admission.waiting = waiting
        for _ in held:
            admission.release()
    assert http.get("/api/runs").status_code == 200


# ---------------------------------------------------------------------------------------------- 4. no 5xx
def test_client_input_never_gets_a_5xx(server, http):
    cases = [
        ("/api/attribute", json.dumps({"run": RUN, "vectors": [[1, 2], [3]]}), 400),
        ("/api/attribute", '{"run": "\\ud800", "method": "grad-dot"}', 400),
        ("/api/sql", '{"query": "SELECT \'\\udfff\'"}', 400),
        ("/api/attribute", '{"run": "' + "x" * 10 + '", "where": "\\u0000"}', 400),
        ("/api/attribute", "[" * 5000 + "]" * 5000, 400),
        ("/api/attribute", '{"run": ' + "[" * 3000 + "]" * 3000 + "}", 400),
        ("/api/attribute", '{"run": ' + "[" * 30 + "]" * 30 + "}", 422),
        ("/api/attribute", json.dumps({"run": RUN, "vectors": [[1e39] * DIM], "method": "grad-dot"}), 400),
        ("/api/attribute", json.dumps({"run": RUN, "rerank": 10**6, "kind": "IVF1,Flat"}), 413),
    ]
    for path, body, code in cases:
        response = http.post(
            path, content=body.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"}
        )
        assert response.status_code == code, (body[:60], response.text)
        assert set(response.json()) == {"error", "message"}, response.text
    for method, path, code in (("GET", "/nope", 404), ("DELETE", "/api/runs", 405), ("GET", "/api/sql", 405)):
        response = http.request(method, path)
        assert response.status_code == code and set(response.json()) == {"error", "message"}


def test_an_answer_over_the_row_limit_is_refused_before_it_is_computed(server, http, monkeypatch):
    """queries x k (x 2 with opponents) over ``max_result_rows``: 413 before any scoring (10,000 ids at k=1000
    built a 20M-row table, GBs and half a minute, only to refuse it afterwards)."""
    scored = []
    attribute = server.service.store.attribute
    monkeypatch.setattr(server.service.store, "attribute", lambda *a, **kw: scored.append(1) or attribute(*a, **kw))
    many = {"run": RUN, "method": "grad-dot", "k": 1000, "opponents": True}
    refused = http.post("/api/attribute", json={**many, "queries": ["q-0"] * 2500})
    assert (refused.status_code, refused.json()["error"]) == (413, "RequestTooLargeError"), refused.text
    assert "fewer queries" in refused.json()["message"]
    with gradstore.connect(server.flight_uri, token=READ) as client:
        with pytest.raises(gradstore.serve.RequestTooLargeError):
            client.attribute(["q-1"] * 1200, run=RUN, k=1000, method="grad-dot", opponents=True)
        assert not scored
        # k above the stored rows counts as the stored rows: 1024 vectors x k=1000 over 86 rows is answered
        found = client.attribute(np.ones((1024, DIM), np.float32), run=RUN, k=1000, method="grad-dot")
    assert found.num_rows == 1024 * N_TRAIN and scored


def test_refusals_name_no_file_paths(http):
    """A filter the store's table library refuses: its message named the library's source files
    (``/home/.../planner.rs:951:22``); a refusal names no path of the server or its libraries."""
    for args in ({"where": "nope = 1"}, {"where": "example_id = 1"}, {"queries": "example_id IN (SELECT 1)"}):
        response = http.post("/api/attribute", json={"run": RUN, "method": "grad-dot", **args})
        assert response.status_code == 400, response.text
        message = response.json()["message"]
        assert not re.search(r"(^|[\s(,'])/\w+/", message) and ".rs:" not in message, message


def test_flight_errors_are_typed_without_tracebacks(server):
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ}".encode())])
    client = flight.FlightClient(server.flight_uri)

    def exchange(command: bytes) -> dict:
        with pytest.raises(flight.FlightServerError) as refused:
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command), options)
            writer.done_writing()
            reader.read_all()
        return json.loads(refused.value.extra_info)

    assert exchange(json.dumps({"call": "attribute", "args": {"run": RUN, "where": []}}).encode())["status"] == 400
    nested = b'{"call": "attribute", "args": {"run": ' + b"[" * 3000 + b"]" * 3000 + b"}}"
    assert exchange(nested)["error"] == "InvalidArgumentError"
    assert exchange(b'{"call": "sql", "args": {"query": "\\ud800"}}')["status"] == 400
    assert exchange(b"\xff\xfe")["status"] == 400
    assert exchange(json.dumps({"call": "attribute", "args": [1]}).encode())["status"] == 400
    for call in (
        lambda: client.do_get(flight.Ticket(b"x"), options).read_all(),
        lambda: list(client.list_flights(options=options)),
        lambda: client.get_flight_info(flight.FlightDescriptor.for_command(b"{}"), options),
        lambda: client.get_schema(flight.FlightDescriptor.for_command(b"{}"), options),
        lambda: list(client.do_action(flight.Action("x", b""), options)),
        lambda: client.list_actions(options),
    ):
        with pytest.raises((flight.FlightError, OSError)) as refused:  # GetSchema: pyarrow's client drops the info
            call()
        assert "Traceback" not in str(refused.value) and "DoExchange calls only" in str(refused.value)
        info = getattr(refused.value, "extra_info", None)
        assert info is None or json.loads(info)["status"] == 400
    client.close()


# ---------------------------------------------------------------------------------------------- 5. concurrency
def test_a_slow_statement_does_not_hold_up_lookups(server, http, local, no_sql_timeout):
    watchdog = server.service.sql.watchdog
    sock = _connect(server)
    body = json.dumps({"query": LONG_SQL}).encode()
    sock.sendall(_head("/api/sql", len(body), READ) + body)
    _wait_for(lambda: len(watchdog._watched) == 1, "the slow statement runs")
    expected = local.attribute(np.ones((1, DIM), np.float32), run=RUN, k=3, method="grad-dot", write=False)
    with gradstore.connect(server.flight_uri, token=READ) as client:
        assert client.attribute(np.ones((1, DIM), np.float32), run=RUN, k=3, method="grad-dot").equals(expected)
        assert client.sql("SELECT 42 AS x").df()["x"][0] == 42
    assert http.get("/api/runs").status_code == 200
    assert http.post("/api/attribute", json={"run": RUN, "k": 2, "method": "grad-dot"}).status_code == 200
    assert len(watchdog._watched) == 1  # every lookup above was answered while the statement still ran
    sock.close()
    _wait_for(lambda: not watchdog._watched, "the slow statement is interrupted")


# ---------------------------------------------------------------------------------------------- 2. read-only
def _hashes(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_a_read_only_server_does_not_add_the_tables_an_older_store_lacks(tmp_path):
    """A store from an earlier version (no self_influence table): opened read-only from the start, nothing created."""
    import shutil

    root = tmp_path / "old"
    make_store(root)
    shutil.rmtree(root / "self_influence.lance")
    before = _hashes(root)
    headers = {"Authorization": f"Bearer {READ}"}
    with (
        serve(root, tokens=Tokens.parse(READ), flight_port=None, http_port=0) as running,
        httpx.Client(base_url=running.http_url, headers=headers) as http,
    ):
        answer = http.post("/api/sql", json={"query": "SELECT count(*) AS n FROM self_influence"})
        assert answer.status_code == 200 and answer.json()["rows"] == [{"n": 0}], answer.text
        assert http.post("/api/attribute", json={"run": RUN, "k": 2, "method": "grad-dot"}).status_code == 200
    assert not (root / "self_influence.lance").exists()
    assert _hashes(root) == before


AT = {"run": "quad", "checkpoint": "train"}  # the trajectory store's training rows are labelled "train"


@pytest.fixture
def trajectory_store(built_store, tmp_path):
    """A copy of tests/methods/test_trajectory.py's trained store (built once per session)."""
    import shutil

    from quadratic import trained_store

    shutil.copytree(built_store("quadratic", trained_store), tmp_path / "store")
    return gradstore.open(tmp_path / "store")


def test_a_read_only_server_never_writes_the_store(trajectory_store):
    root = Path(trajectory_store.uri)
    before = _hashes(root)
    limits = Limits(fit_cache_bytes=1)  # one fit kept at a time: new filters fit again instead of growing
    tokens = Tokens.parse(f"{READ}, {WRITE}:write")
    with serve(root, tokens=tokens, flight_port=0, http_port=0, limits=limits) as server:
        headers = {"Authorization": f"Bearer {WRITE}"}
        with httpx.Client(base_url=server.http_url, headers=headers, timeout=GUARD_S) as http:
            for i in range(6):
                where = f"example_id <> '{i}'"
                ok = http.post("/api/attribute", json={**AT, "k": 2, "method": "fisher", "where": where})
                assert ok.status_code == 200, ok.text
                ok = http.post("/api/self_influence", json={**AT, "method": "fisher", "where": where})
                assert ok.status_code == 200, ok.text
            assert len(server.service.fits) == 1
            for args in (
                {**AT, "method": "grad-dot"},
                {**AT, "method": "fisher"},
                {"run": "quad", "method": "tracin-steps"},
            ):
                ok = http.post("/api/attribute", json={**args, "k": 2})
                assert ok.status_code == 200, (args, ok.text)
            assert (
                http.post(
                    "/api/select", json={"run": "quad", "target": ["qa"], "budget": 3, "checkpoints": ["train"]}
                ).status_code
                == 200
            )
            assert http.post("/api/sql", json={"query": "SELECT count(*) AS n FROM gradients"}).status_code == 200
            refused = http.post("/api/attribute", json={"run": "quad", "k": 2, "method": "dvemb"})
            assert (refused.status_code, refused.json()["error"]) == (409, "NotBuiltError"), refused.text
            assert "gradstore attribute STORE --run quad --method dvemb" in refused.json()["message"]
            assert str(root) not in refused.text
            refused = http.post("/api/attribute", json={**AT, "k": 2, "method": "grad-dot", "kind": "IVF1,Flat"})
            assert (refused.status_code, refused.json()["error"]) == (409, "NotBuiltError")
            assert (
                "gradstore build-index STORE --run quad --method grad-dot --kind 'IVF1,Flat' --checkpoint train"
                in refused.text
            )
            refused = http.post("/api/attribute", json={"run": "quad", "method": "grad-dot", "write": True})
            assert refused.status_code == 403
        with gradstore.connect(server.flight_uri, token=READ) as client:
            vectors = np.ones((2, 4), np.float32)
            assert client.attribute(vectors, **AT, k=2, method="fisher", where="example_id > '3'").num_rows == 4
            with pytest.raises(gradstore.serve.NotBuiltError):
                client.attribute(vectors, run="quad", method="dvemb")
    assert _hashes(root) == before  # not a byte written: no derived run, no fit, no index


def test_a_read_only_reader_takes_the_writers_lock_file(trajectory_store):
    from gradstore.serve.readonly import existing_lock_file, lock_file_path

    files = trajectory_store.core.files
    path = lock_file_path(files, ("fits", "some-key"))
    with files._lock_file(("fits", "some-key")) as made:  # what a writer makes
        assert os.fstat(made.fileno()).st_ino == path.stat().st_ino
    with existing_lock_file(files, ("fits", "some-key")) as found:
        assert os.fstat(found.fileno()).st_ino == path.stat().st_ino
    assert existing_lock_file(files, ("fits", "other-key")) is None
    assert not lock_file_path(files, ("fits", "other-key")).exists()


def test_an_index_built_by_the_operator_is_served_read_only(trajectory_store):
    trajectory_store.build_index("quad", checkpoint="train", method="grad-dot", kind="IVF1,Flat")
    trajectory_store.attribute(run="quad", k=1, method="dvemb", write=False)  # builds the derived run
    root = Path(trajectory_store.uri)
    before = _hashes(root)
    with (
        serve(root, tokens=Tokens.parse(READ), flight_port=0, http_port=None) as server,
        gradstore.connect(server.flight_uri, token=READ) as client,
    ):
        found = client.attribute(**AT, k=2, method="grad-dot", kind="IVF1,Flat")
        assert found.equals(trajectory_store.attribute(**AT, k=2, method="grad-dot", kind="IVF1,Flat", write=False))
        assert client.attribute(run="quad", k=2, method="dvemb").num_rows == 4
    assert _hashes(root) == before


def test_limits_parse_from_the_command_line():
    limits = Limits.parse(["max_body_bytes=1MiB", "sql-timeout-s=2.5", "max_concurrent=4", "sql_memory_bytes=1GB"])
    assert (limits.max_body_bytes, limits.sql_timeout_s, limits.max_concurrent) == (MB, 2.5, 4)
    assert limits.sql_memory_bytes == 10**9
    for bad in ("nope=1", "max_k", "max_k=-1", "sql_timeout_s=inf", "max_k=lots"):
        with pytest.raises(gradstore.InvalidArgumentError):
            Limits.parse([bad])


def test_the_serve_command_takes_limits(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gradstore.cli import app

    monkeypatch.setenv("GRADSTORE_TOKENS", READ)
    make_store(tmp_path / "store")
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "store"), "--limit", "max_body=1"])
    assert result.exit_code == 1 and result.output.startswith("error: --limit takes name=value"), result.output
