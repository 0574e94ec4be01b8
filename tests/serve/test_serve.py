"""gradstore serve over Arrow Flight: every call of the client equals the local store's on the same data, bearer
tokens, typed 4xx refusals (the server keeps serving), limits, micro-batching and freshness."""

from __future__ import annotations

import threading

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from served_store import DIM, READ, RUN, WRITE, make_store, same_table

import gradstore
from gradstore.serve import AuthError, RequestTooLargeError, Tokens, serve


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("serve") / "store")


@pytest.fixture(scope="module")
def server(local):
    tokens = Tokens.parse(f"{READ}, {WRITE}:write")
    with serve(local.uri, tokens=tokens, flight_port=0, http_port=None, refresh_s=0.0, allow_writes=True) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with gradstore.connect(server.flight_uri, token=READ) as remote:
        yield remote


CASES = [
    ("attribute", dict(run=RUN, k=5, method="grad-dot")),
    ("attribute", dict(run=RUN, k=4, method="fisher", damping=0.3, opponents=True)),
    ("attribute", dict(queries=["q-1", "q-3"], run=RUN, k=3, method="diagonal")),
    ("attribute", dict(run=RUN, k=3, method="grad-dot", where="example_id < 't-040'")),
    ("self_influence", dict(run=RUN, method="grad-dot")),
    ("select", dict(run=RUN, budget=0.1)),
    ("select", dict(target=["q-0"], run=RUN, budget=7, preconditioner="fisher")),
]


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_every_call_equals_the_local_store(client, local, name, kwargs):
    extra = {"write": False} if name != "select" else {}
    expected = getattr(local, name)(**kwargs, **extra)
    same_table(getattr(client, name)(**kwargs), expected)
    assert client.last_version == local.core.dataset("gradients").version


def test_raw_vectors_equal_the_local_store(client, local):
    vectors = np.random.default_rng(1).standard_normal((3, DIM), dtype=np.float32)
    for method in ("grad-dot", "fisher"):
        expected = local.attribute(vectors, run=RUN, k=5, method=method, write=False, opponents=True)
        same_table(client.attribute(vectors, run=RUN, k=5, method=method, opponents=True), expected)
    expected = local.select(vectors, run=RUN, budget=5)
    same_table(client.select(vectors, run=RUN, budget=5), expected)


def test_sql_runs_and_info_equal_the_local_store(client, local):
    for query in (
        "SELECT source, count(*) AS n FROM examples GROUP BY source ORDER BY source",
        "SELECT * FROM top_proponents('q-0', 3)",
    ):
        pd.testing.assert_frame_equal(client.sql(query).df(), local.sql(query).df())
    same_table(client.runs(), local.runs())
    info, expected = client.info(), local.info()
    assert info["uri"] == "store"  # the server's path is not told
    assert {key: value for key, value in info.items() if key not in ("uri", "bytes_on_disk")} == {
        key: value for key, value in expected.items() if key not in ("uri", "bytes_on_disk")
    }


def test_requests_without_a_valid_token_are_refused(server, local):
    for token in (None, "wrong-token-0123456789abcdef"):
        with gradstore.connect(server.flight_uri, token=token) as anonymous, pytest.raises(AuthError):
            anonymous.runs()


BAD = [
    (dict(run="nope", k=3, method="grad-dot"), gradstore.UnknownRunError),
    (dict(run=RUN, k=0, method="grad-dot"), gradstore.InvalidArgumentError),
    (dict(run=RUN, k=3, method="no-such-method"), gradstore.InvalidArgumentError),
    (dict(run=RUN, k=3, method="grad-dot", damping=0.1), gradstore.InvalidArgumentError),
    (dict(run=RUN, k=3, method="grad-dot", where="1=1) OR (1=1"), gradstore.InvalidFilterError),
    (dict(queries=["missing"], run=RUN, k=3, method="grad-dot"), gradstore.MissingIdsError),
    (dict(run=RUN, k=10**6, method="grad-dot"), RequestTooLargeError),
    (dict(run=RUN, k=3, kind="../../etc/passwd", method="grad-dot"), gradstore.InvalidArgumentError),
]


@pytest.mark.parametrize(("kwargs", "error"), BAD)
def test_bad_requests_are_typed_errors_and_the_server_keeps_serving(client, kwargs, error):
    with pytest.raises(error):
        client.attribute(**kwargs)
    assert client.runs().num_rows == 1


def test_numpy_scalars_are_numbers_and_flags_are_checked_as_the_local_store_does(client, local):
    """``k=np.int64(3)``, ``damping=np.float32(0.3)``, ``budget=np.int64(7)``: the local store takes numpy scalars as
    the numbers they hold, so the client does too (not a ``TypeError`` from JSON); refused values (damping 0, k 0)
    are the server's typed refusals, and a flag that is not a bool is refused as the local store refuses it."""
    expected = local.attribute(run=RUN, k=3, method="fisher", damping=0.3, write=False)
    same_table(client.attribute(run=RUN, k=np.int64(3), method="fisher", damping=np.float32(0.3)), expected)
    same_table(
        client.self_influence(run=RUN, method="fisher", damping=np.float32(0.3)),
        local.self_influence(run=RUN, method="fisher", damping=0.3, write=False),
    )
    same_table(client.select(run=RUN, budget=np.int64(7)), local.select(run=RUN, budget=7))
    for kwargs in (dict(k=np.int64(0)), dict(method="fisher", damping=np.float64(0.0)), dict(opponents="no")):
        with pytest.raises(gradstore.InvalidArgumentError):
            client.attribute(run=RUN, **kwargs)
    assert client.runs().num_rows == 1


def test_bad_vectors_sql_writes_and_unknown_calls_are_refused(server, client):
    with pytest.raises(gradstore.SchemaMismatchError):
        client.attribute(np.ones((1, DIM + 1), np.float32), run=RUN, method="grad-dot")
    with pytest.raises(gradstore.NonFiniteGradientError):
        client.attribute(np.full((1, DIM), np.nan, np.float32), run=RUN, method="grad-dot")
    for statement in ("DROP TABLE scores", "COPY scores TO '/tmp/x.csv'", "SELECT * FROM read_csv('/etc/passwd')"):
        with pytest.raises(gradstore.SQLError):
            client.sql(statement)
    with pytest.raises(AuthError, match="write-scoped"):
        client.attribute(run=RUN, method="grad-dot", write=True)
    with pytest.raises(gradstore.InvalidArgumentError, match="unknown call"):
        client._call("report", {"out": "/tmp/x.html"})
    with pytest.raises(gradstore.InvalidArgumentError, match="takes no argument"):
        client._call("attribute", {"run": RUN, "engine": "ray"})
    with pytest.raises(RequestTooLargeError):
        client.attribute(np.ones((2000, DIM), np.float32), run=RUN, method="grad-dot")
    assert client.runs().num_rows == 1


def test_a_write_scoped_token_writes_when_the_server_allows_it(server, local):
    before = local.core.dataset("scores").count_rows()
    with gradstore.connect(server.flight_uri, token=WRITE) as writer:
        table = writer.attribute(["q-0"], run=RUN, k=2, method="grad-dot", write=True)
    assert local.core.dataset("scores").count_rows() == before + table.num_rows == before + 2


def test_concurrent_single_queries_are_batched_and_equal_lone_calls(server, client, local):
    vectors = np.random.default_rng(2).standard_normal((12, DIM), dtype=np.float32)
    expected = [local.attribute(v[None], run=RUN, k=4, method="fisher", write=False) for v in vectors]
    batcher = server.service.batcher
    server.service.batcher.window_s = 0.5  # a wide window: all twelve arrive within it on a busy machine
    calls_before = batcher.batches
    results: list = [None] * len(vectors)
    errors: list = []

    def ask(i):
        try:
            with gradstore.connect(server.flight_uri, token=READ) as own:
                results[i] = own.attribute(vectors[i][None], run=RUN, k=4, method="fisher")
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(vectors))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    server.service.batcher.window_s = 0.005
    assert not errors
    assert batcher.batches - calls_before < len(vectors)  # some of them shared one scoring call
    for got, want in zip(results, expected):
        _within_batching_tolerance(got, want)


def _within_batching_tolerance(batched: pa.Table, lone: pa.Table) -> None:
    """docs/serve.md's promise: a batched answer's scores are the lone call's within float32 rounding (1e-4 of the
    query's largest |score|), the same rows in the same order except where two scores are that close."""
    left, right = batched.to_pandas(), lone.to_pandas()
    assert left.drop(columns=["score", "example_id", "grad_id"]).equals(
        right.drop(columns=["score", "example_id", "grad_id"])
    )
    tolerance = 1e-4 * np.abs(right["score"]).max()
    np.testing.assert_allclose(left["score"], right["score"], rtol=0, atol=tolerance)
    merged = left.merge(right, on="example_id", how="outer", suffixes=("_batched", "_lone"))
    both = merged.dropna(subset=["score_batched", "score_lone"])
    np.testing.assert_allclose(both["score_batched"], both["score_lone"], rtol=0, atol=tolerance)  # a row's own score
    boundary = right["score"].iloc[-1]  # a row in one answer only: a near tie at the k-th score
    assert (np.abs(merged.drop(both.index)[["score_batched", "score_lone"]].max(axis=1) - boundary) <= tolerance).all()


def test_batched_scores_differ_from_lone_ones_only_by_float32_rounding(tmp_path):
    """Larger rows than the server's store and a preconditioned method: the tolerance docs/serve.md states holds."""
    rng = np.random.default_rng(5)
    store = gradstore.open(tmp_path / "wide")
    store.create_run(RUN, dim=1024)
    store.record_checkpoint(RUN, "final", step=1, learning_rate=0.1)
    with store.writer(RUN) as writer:
        ids = [f"t-{i:04d}" for i in range(1500)]
        writer.append(rng.standard_normal((1500, 1024), dtype=np.float32), ids, checkpoint="final", split="train")
    vectors = rng.standard_normal((12, 1024), dtype=np.float32)
    for method in ("grad-dot", "fisher"):
        together = store.attribute(vectors, run=RUN, k=10, method=method, write=False)
        for i, vector in enumerate(vectors):
            lone = store.attribute(vector[None], run=RUN, k=10, method=method, write=False)
            mine = together.filter(pa.compute.equal(together["query_id"], f"vector:{i}"))
            mine = mine.set_column(0, "query_id", lone["query_id"])
            _within_batching_tolerance(mine, lone)


def test_rows_appended_by_another_writer_are_seen_with_their_version(server, client):
    """Runs last in this module: it appends to the shared store."""
    writer_store = gradstore.open(server.service.store.uri)
    client.attribute(["q-0"], run=RUN, k=1, method="grad-dot")
    version = client.last_version
    client.sql("SELECT 1 AS one")
    assert client.last_version == version  # nothing appended: every answer names the same version
    count = "SELECT count(*) AS n FROM gradients WHERE split = 'train'"
    rows = writer_store.sql(count).df()["n"][0]
    with writer_store.writer(RUN) as writer:
        writer.append(np.full((1, DIM), 100.0, np.float32), ["t-new"], checkpoint="final", split="train")
    after = client.attribute(np.ones((1, DIM), np.float32), run=RUN, k=1, method="grad-dot")
    assert client.last_version > version
    assert after.column("example_id").to_pylist() == ["t-new"]
    assert client.sql(count).df()["n"][0] == rows + 1
    assert client.last_version == writer_store.core.dataset("gradients").version


def test_a_malformed_vector_stream_is_a_typed_error(server, client):
    import json

    import pyarrow.flight as flight

    raw = flight.FlightClient(server.flight_uri)
    options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {READ}".encode())])
    for table in (pa.table({"vector": [["a", "b"]]}), pa.table({"vector": [[1.0], [1.0, 2.0]]}), pa.table({"x": [1]})):
        command = json.dumps({"call": "attribute", "args": {"run": RUN, "method": "grad-dot"}}).encode()
        writer, reader = raw.do_exchange(flight.FlightDescriptor.for_command(command), options)
        with pytest.raises(flight.FlightServerError) as refused:
            writer.begin(table.schema)
            writer.write_table(table)
            writer.done_writing()
            reader.read_all()
        assert json.loads(refused.value.extra_info)["error"] == "InvalidArgumentError"
        assert json.loads(refused.value.extra_info)["status"] == 400
    raw.close()
    assert client.runs().num_rows == 1
