"""The whole path (capture -> store -> index -> attribute) equals numpy on the same gradients."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from tiny_models import tiny_mlp
from torch import nn

import gradstore
from gradstore.methods.queries import QueryBatch
from gradstore.search.index import index_summary
from indexers import IndexMismatchError, gpu_available
from indexers.screening import fast_bfloat16_matmul

N_TRAIN, N_QUERY = 48, 5
LEARNING_RATES = {"c0": 0.3, "c1": 0.1}


def _loss(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Two checkpoint passes over 48 training and 5 query examples, exact gradients, float32 storage."""
    store = gradstore.open(tmp_path_factory.mktemp("attr") / "store", storage_dtype="float32")
    model = tiny_mlp()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(N_TRAIN, 6, generator=generator), torch.randint(0, 3, (N_TRAIN,), generator=generator)
    xq, yq = torch.randn(N_QUERY, 6, generator=generator), torch.randint(0, 3, (N_QUERY,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for checkpoint, lr in LEARNING_RATES.items():
        with store.capture(
            model, "run", checkpoint=checkpoint, learning_rate=lr, projection=None, curvature=True
        ) as cap:
            for start in range(0, N_TRAIN, 16):
                cap.set_ids([f"x{i}" for i in range(start, start + 16)])
                _loss(model, {"x": x[start : start + 16], "y": y[start : start + 16]}).backward()
                model.zero_grad()
            cap.set_split("query")
            cap.set_ids([f"q{i}" for i in range(N_QUERY)])
            _loss(model, {"x": xq, "y": yq}).backward()
            model.zero_grad()
        for _ in range(3):  # move to the next checkpoint
            _loss(model, {"x": x, "y": y}).backward()
            optimizer.step()
            optimizer.zero_grad()
    store.add_examples(
        pd.DataFrame(
            {
                "example_id": [f"x{i}" for i in range(N_TRAIN)],
                "label": y.tolist(),
                "source": [f"s{i % 3}" for i in range(N_TRAIN)],
            }
        )
    )
    return store, model, (xq, yq)


def _rows(store, checkpoint, split):
    block = store.read_gradients("run", checkpoint=checkpoint, split=split)
    ids = block.metadata.column("example_id").to_pylist()
    order = np.argsort([int(i[1:]) for i in ids])
    return [ids[i] for i in order], block.vectors[order].astype(np.float64), block.grad_ids[order]


def _expected_top(scores: np.ndarray, ids: list[str], k: int, largest: bool = True):
    order = np.lexsort((np.arange(len(ids)), -scores if largest else scores))[:k]
    return [ids[i] for i in order], scores[order]


def _fisher_inverse(g: np.ndarray, damping: float) -> np.ndarray:
    fisher = g.T @ g / len(g)
    return np.linalg.inv(fisher + damping * np.linalg.eigvalsh(fisher).mean() * np.eye(len(fisher)))


def _check(table, queries, q_vectors, g_ids, scores_fn, k, largest=True, rtol=1e-4):
    frame = table.to_pandas()
    for qid, q in zip(queries, q_vectors):
        want_ids, want_scores = _expected_top(scores_fn(q), g_ids, k, largest)
        rows = frame[(frame.query_id == qid) & ((frame["rank"] > 0) if largest else (frame["rank"] < 0))]
        rows = rows.sort_values("rank", key=abs)
        assert rows.example_id.tolist() == want_ids
        np.testing.assert_allclose(rows.score.to_numpy(), want_scores, rtol=rtol, atol=rtol * np.abs(want_scores).max())


def test_grad_dot_cosine_and_opponents_equal_numpy(captured):
    store, _, _ = captured
    g_ids, g, _ = _rows(store, "c1", "train")
    q_ids, q, _ = _rows(store, "c1", "query")
    table = store.attribute(run="run", k=7, method="grad-dot", opponents=True, write=False)
    assert set(table.column("checkpoint").to_pylist()) == {"c1"}  # latest checkpoint by default
    _check(table, q_ids, q, g_ids, lambda v: g @ v, 7)
    _check(table, q_ids, q, g_ids, lambda v: g @ v, 7, largest=False)
    cosine = store.attribute(run="run", k=5, method="cosine", checkpoint="c0", write=False)
    g0_ids, g0, _ = _rows(store, "c0", "train")
    q0_ids, q0, _ = _rows(store, "c0", "query")
    unit0 = g0 / np.linalg.norm(g0, axis=1, keepdims=True)
    _check(cosine, q0_ids, q0, g0_ids, lambda v: unit0 @ (v / np.linalg.norm(v)), 5)


@pytest.mark.parametrize("damping", [0.1, 0.01])
def test_fisher_influence_equals_numpy_closed_form(captured, damping):
    store, _, _ = captured
    g_ids, g, _ = _rows(store, "c1", "train")
    q_ids, q, _ = _rows(store, "c1", "query")
    inverse = _fisher_inverse(g, damping)
    table = store.attribute(run="run", k=10, method="influence", damping=damping, blocks="full", write=False)
    _check(table, q_ids, q, g_ids, lambda v: g @ (inverse @ v), 10, rtol=1e-3)


def test_trackstar_is_a_cosine_in_the_fisher_whitened_space(captured):
    store, _, _ = captured
    g_ids, g, _ = _rows(store, "c1", "train")
    q_ids, q, _ = _rows(store, "c1", "query")
    values, vectors = np.linalg.eigh(_fisher_inverse(g, 0.1))
    root = vectors @ np.diag(np.sqrt(values)) @ vectors.T  # F^-1/2 (damped)
    white = g @ root
    white /= np.linalg.norm(white, axis=1, keepdims=True)
    table = store.attribute(run="run", k=8, method="trackstar", blocks="full", opponents=True, write=False)
    for largest in (True, False):
        _check(table, q_ids, q, g_ids, lambda v: white @ (root @ v / np.linalg.norm(root @ v)), 8, largest, rtol=1e-3)
    assert np.abs(table.column("score").to_numpy()).max() <= 1 + 1e-5
    with pytest.raises(gradstore.GradstoreError, match="does not take"):
        store.self_influence(run="run", method="trackstar", write=False)


def test_self_influence_equals_numpy(captured):
    store, _, _ = captured
    g_ids, g, _ = _rows(store, "c1", "train")
    inverse = _fisher_inverse(g, 0.1)
    table = (
        store.self_influence(run="run", method="fisher", blocks="full", write=False).to_pandas().set_index("example_id")
    )
    expected = np.einsum("ij,jk,ik->i", g, inverse, g)
    np.testing.assert_allclose(table.loc[g_ids, "self_influence"].to_numpy(), expected, rtol=1e-3)
    grad_dot = store.self_influence(run="run", method="grad-dot", write=False).to_pandas().set_index("example_id")
    np.testing.assert_allclose(grad_dot.loc[g_ids, "self_influence"].to_numpy(), (g * g).sum(1), rtol=1e-5)


def test_tracin_equals_the_explicit_weighted_sum(captured):
    store, _, _ = captured
    total = 0
    for checkpoint, lr in LEARNING_RATES.items():
        g_ids, g, _ = _rows(store, checkpoint, "train")
        q_ids, q, _ = _rows(store, checkpoint, "query")
        total = total + lr * (q @ g.T)
    table = store.attribute(run="run", k=6, method="tracin", opponents=True, write=False)
    frame = table.to_pandas()
    for row, qid in enumerate(q_ids):
        for largest in (True, False):
            want_ids, want = _expected_top(total[row], g_ids, 6, largest)
            got = frame[(frame.query_id == qid) & ((frame["rank"] > 0) if largest else (frame["rank"] < 0))]
            got = got.sort_values("rank", key=abs)
            assert got.example_id.tolist() == want_ids
            np.testing.assert_allclose(got.score.to_numpy(), want, rtol=1e-6)


def test_selection_equals_numpy_less(captured):
    store, _, _ = captured
    total = 0
    for checkpoint, lr in LEARNING_RATES.items():
        g_ids, g, _ = _rows(store, checkpoint, "train")
        q_ids, q, _ = _rows(store, checkpoint, "query")
        unit_g = g / np.linalg.norm(g, axis=1, keepdims=True)
        unit_q = q / np.linalg.norm(q, axis=1, keepdims=True)
        total = total + lr * (unit_q @ unit_g.T).max(axis=0)
    selected = store.select(run="run", budget=0.25)
    want_ids, want = _expected_top(total, g_ids, 12)
    assert selected.column("example_id").to_pylist() == want_ids
    np.testing.assert_allclose(selected.column("score").to_numpy(), want, rtol=1e-6)
    assert store.select(run="run", budget=3, aggregate="mean").num_rows == 3
    for bad in (0, float("inf"), float("nan"), -3):  # inf was an OverflowError, not a GradstoreError
        with pytest.raises(gradstore.InvalidArgumentError, match="budget"):
            store.select(run="run", budget=bad)


def test_on_the_fly_queries_equal_stored_query_rows(captured, tmp_path):
    store, model, (xq, yq) = captured
    # the stored query rows were taken at c0 and c1; the model has moved on since, so compare against
    # a fresh capture at the current weights into another run of the same store
    with store.capture(model, "run", checkpoint="now", learning_rate=0.1) as cap:
        cap.set_split("query")
        cap.set_ids([f"q{i}" for i in range(N_QUERY)])
        _loss(model, {"x": xq, "y": yq}).backward()
        model.zero_grad()
    stored = store.read_gradients("run", checkpoint="now", split="query").vectors
    before = [p.grad for p in model.parameters()]
    from gradstore.methods.queries import resolve_queries

    live = resolve_queries(
        store.core,
        QueryBatch(model, {"x": xq, "y": yq}, ids=[f"q{i}" for i in range(N_QUERY)], loss_fn=_loss),
        "run",
        "now",
    )
    assert live.ids == [f"q{i}" for i in range(N_QUERY)]
    np.testing.assert_allclose(live.vectors, stored, rtol=1e-5, atol=1e-7)
    assert [p.grad for p in model.parameters()] == before  # model gradients untouched


def test_results_are_written_to_scores_and_macros_match_pandas(captured):
    store, _, _ = captured
    before = store.count("scores")
    table = store.attribute(run="run", k=4, method="grad-dot")
    assert store.count("scores") == before + table.num_rows
    got = store.sql("select * from top_proponents('q1', 4) where method = 'grad-dot'").df()
    examples = store.core.table("examples").to_pandas()
    scores = store.core.table("scores").to_pandas()
    expected = (
        scores[(scores.query_id == "q1") & scores["rank"].between(1, 4) & (scores.method == "grad-dot")]
        .merge(examples, on="example_id")
        .sort_values("rank")
    )
    assert got.example_id.tolist() == expected.example_id.tolist()
    np.testing.assert_allclose(got.score, expected.score)
    by_source = store.sql("select * from influence_by('source')").df().set_index("group")
    positive = scores[scores["rank"] >= 1].merge(examples, on="example_id")
    reference = positive.groupby("source").score.agg(["size", "sum"])
    assert by_source.hits.to_dict() == reference["size"].to_dict()
    np.testing.assert_allclose(by_source.total_score[reference.index], reference["sum"])
    many = store.sql("select * from influential_examples(4, 2)").df()
    top = scores[scores["rank"].between(1, 4)].groupby("example_id").query_id.nunique()
    assert sorted(many.example_id) == sorted(top[top >= 2].index)


def test_vector_queries_are_named_apart_from_stored_queries(tmp_path):
    """Raw query vectors are ``vector:0``, ``vector:1``, ...: attributing one (written) leaves the answers of the
    stored query ``q0`` alone in ``scores`` and ``top_proponents``, and a writer refuses example ids of that prefix.
    They were ``q0``, ``q1``: the vector's answer replaced the stored query's."""
    rng = np.random.default_rng(0)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    store.create_run("r", dim=8)
    rows = rng.standard_normal((40, 8)).astype(np.float32)
    with store.writer("r") as writer:
        writer.append(rows, [f"t{i}" for i in range(40)], split="train")
        writer.append(rng.standard_normal((2, 8)).astype(np.float32), ["q0", "q1"], split="query")
        with pytest.raises(gradstore.InvalidArgumentError, match="'vector:0' begins with 'vector:', the prefix"):
            writer.append(np.ones((2, 8), np.float32), ["t-ok", "vector:0"], split="query")
    stored = store.attribute(["q0"], run="r", k=3, method="grad-dot").column("example_id").to_pylist()
    vectors = -rng.standard_normal((2, 8)).astype(np.float32)
    raw = store.attribute(vectors, run="r", k=3, method="grad-dot")
    assert raw.column("query_id").to_pylist() == ["vector:0"] * 3 + ["vector:1"] * 3
    assert raw.column("example_id").to_pylist()[:3] == [f"t{i}" for i in np.argsort(-(vectors[0] @ rows.T))[:3]]

    def top(query: str) -> list[str]:
        return [r[0] for r in store.sql(f"select example_id from top_proponents('{query}', 3)").fetchall()]

    assert top("q0") == stored and top("vector:0") == raw.column("example_id").to_pylist()[:3]
    assert store.sql("select count(*) from scores where query_id = 'q0'").fetchall() == [(3,)]
    assert store.read_gradients("r", split="query").metadata.column("example_id").to_pylist() == ["q0", "q1"]


def test_faiss_flat_index_equals_exact_and_is_incremental(captured):
    store, _, _ = captured
    exact = store.attribute(run="run", k=5, method="grad-dot", checkpoint="c0", write=False)
    flat = store.attribute(run="run", k=5, method="grad-dot", checkpoint="c0", kind="Flat", write=False)
    assert exact.column("example_id").to_pylist() == flat.column("example_id").to_pylist()
    np.testing.assert_allclose(exact.column("score").to_numpy(), flat.column("score").to_numpy(), rtol=1e-5)
    index = store.build_index("run", checkpoint="c0", kind="Flat", method="grad-dot")
    assert index.manifest["recall_at_10"] == 1.0 and index.faiss_index.ntotal == N_TRAIN
    try:
        with store.writer("run") as writer:
            writer.append(np.ones((2, store.dim)), ["extra0", "extra1"], checkpoint="c0", split="train")
        grown = store.build_index("run", checkpoint="c0", kind="Flat", method="grad-dot")
        assert grown.faiss_index.ntotal == N_TRAIN + 2 and grown.manifest["rows"] == N_TRAIN + 2
        reloaded = store.index(grown.name)
        assert reloaded.faiss_index.ntotal == N_TRAIN + 2
    finally:  # the module's other tests share this store
        store.core.table("gradients").delete("example_id LIKE 'extra%'")


def test_an_index_says_where_and_how_it_searches(captured, monkeypatch):
    """``search_path`` names the kernel this machine runs (bf16 screen only with native bf16 matmul) and the
    device; ``gradstore build-index`` prints it."""
    store, _, _ = captured
    device = "cuda" if torch.cuda.is_available() else "cpu"
    expected = "bfloat16" if device == "cpu" and fast_bfloat16_matmul() else "float32"
    exact = store.build_index("run", checkpoint="c0", method="grad-dot")
    assert exact.search_path == f"exact, {expected} kernel on {device}"
    monkeypatch.setattr("indexers.screening.fast_bfloat16_matmul", lambda: False)
    assert exact.search_path == f"exact, float32 kernel on {device}"
    flat = store.build_index("run", checkpoint="c0", kind="Flat", method="grad-dot")
    assert flat.search_path == f"faiss Flat on {'gpu' if gpu_available() else 'cpu'}"
    assert index_summary(flat)["search"] == flat.search_path


def test_index_from_another_projection_is_refused(captured):
    store, _, _ = captured
    index = store.build_index("run", checkpoint="c0", method="grad-dot")
    key = ("indexes", index.name, "manifest.json")
    text = store.core.files.read_bytes(*key).decode()
    try:  # written through the side-file API, so with a matching checksum: a well-formed foreign manifest
        store.core.files.write_bytes(text.replace(index.manifest["projection_fingerprint"], "0" * 32).encode(), *key)
        with pytest.raises(IndexMismatchError, match="projection_fingerprint"):
            store.index(index.name)
        store.core.files.write_bytes(b"{not json", *key)
        with pytest.raises(IndexMismatchError):
            store.index(index.name)
    finally:
        store.core.files.write_bytes(text.encode(), *key)
    with pytest.raises(FileNotFoundError):
        store.index("no-such-index")


def test_bad_attribution_requests(captured):
    store, _, _ = captured
    with pytest.raises(ValueError, match="unknown attribution method"):
        store.attribute(run="run", method="magic")
    with pytest.raises(KeyError, match="nope"):
        store.attribute(["nope"], run="run", method="grad-dot")
    with pytest.raises(gradstore.SchemaMismatchError, match="dims"):
        store.attribute(np.ones((2, 3)), run="run", method="grad-dot")
    with pytest.raises(gradstore.UnknownRunError):
        store.attribute(run="missing", method="grad-dot")
    with pytest.raises(ValueError, match="k must be"):
        store.attribute(run="run", k=0, method="grad-dot")


def test_new_damping_reuses_the_fit_and_equals_a_refit(captured, monkeypatch):
    store, _, _ = captured
    store.build_index("run", checkpoint="c1", method="fisher", damping=0.5)
    from indexers import FisherPreconditioner

    calls = []  # one statistics pass per shard of the local engine (one shard): one per fit
    original = FisherPreconditioner.statistics
    monkeypatch.setattr(
        FisherPreconditioner,
        "statistics",
        lambda self, blocks, stage=0: calls.append(1) or original(self, blocks, stage),
    )
    redamped = store.build_index("run", checkpoint="c1", method="fisher", damping=0.05)
    assert calls == []  # no pass over the data
    refit = store.build_index("run", checkpoint="c1", method="fisher", damping=0.05, refit=True)
    assert calls == [1]
    queries = torch.randn(3, store.dim)
    torch.testing.assert_close(redamped.prepare_queries(queries), refit.prepare_queries(queries), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("storage_dtype", ["int8", "float16", "float32"])
def test_cosine_is_exact_for_rows_of_extreme_norms(tmp_path, storage_dtype):
    """A row of norm ~1e31 (its squared norm overflows float32) and one of ~1e-29 (squares underflow, and below
    the old 1e-12 clamp) have cosine 1 with a query along them: found first by the exact search, 1 in the score
    matrix, like any other row (they scored 0 and ~6e-18)."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((64, 50)).astype(np.float32)
    rows[6] *= 1e30
    rows[7] *= 1e-30
    rows[5] = 0.0
    queries = np.stack([rows[6] / 1e30, rows[7] * 1e30, rng.standard_normal(50)]).astype(np.float32)
    store = gradstore.open(tmp_path / "store", storage_dtype=storage_dtype)
    store.create_run("r", dim=50)
    with store.writer("r") as writer:
        writer.append(rows, [f"t{i}" for i in range(64)], split="train")
        writer.append(queries, ["q0", "q1", "q2"], split="query")
    top = store.attribute(["q0", "q1"], run="r", k=1, method="cosine", write=False)
    assert top.column("example_id").to_pylist() == ["t6", "t7"]
    np.testing.assert_allclose(top.column("score").to_numpy(), 1.0, rtol=1e-6)
    matrix = store.score_matrix(run="r", method="cosine")
    column = {e: i for i, e in enumerate(matrix.example_ids)}
    np.testing.assert_allclose(matrix.scores[[0, 1], [column["t6"], column["t7"]]], 1.0, rtol=1e-6)
    assert (matrix.scores[:, column["t5"]] == 0).all()  # a zero row stays zero
    stored = store.read_gradients("r", split="train").vectors.astype(np.float64)
    unit = stored / np.maximum(np.linalg.norm(stored, axis=1, keepdims=True), 1e-300)
    q = store.read_gradients("r", split="query").vectors.astype(np.float64)
    reference = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ unit.T
    order = [int(e[1:]) for e in matrix.example_ids]
    np.testing.assert_allclose(matrix.scores, reference[:, order], atol=1e-6)


class ClsTokenHead(nn.Module):
    """A bare ``cls`` parameter concatenated to the batch (its rows are formed whole per example: no Kronecker
    factors) and a Linear head (factors recorded by the capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1).mean(1))


def test_kfac_with_factors_for_some_layers_estimates_them_all_from_the_rows(tmp_path) -> None:
    """Captured factors that leave a layer out (it failed with a KeyError): warned, and the fit is the one the rows
    give (the same scores as a run captured without curvature)."""
    torch.manual_seed(0)
    model, x, y = ClsTokenHead(), torch.randn(8, 4, 3), torch.randint(0, 2, (8,))
    results = {}
    for curvature in (True, False):
        store = gradstore.open(tmp_path / f"store-{curvature}")
        with store.capture(model, run="r", curvature=curvature) as cap:
            cap.set_ids([f"e{i}" for i in range(8)])
            nn.functional.cross_entropy(model(x), y).backward()
        with store.capture(model, run="r", split="query") as cap:
            cap.set_ids(["q"])
            nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()
        model.zero_grad()
        if curvature:
            with pytest.warns(UserWarning, match=r"leave out layers \['cls'\].*estimated from the rows"):
                results[curvature] = store.attribute(["q"], run="r", k=8, method="kfac", write=False)
        else:
            results[curvature] = store.attribute(["q"], run="r", k=8, method="kfac", write=False)
    got, expected = (results[c].to_pandas().set_index("example_id").score for c in (True, False))
    pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), rtol=1e-5)
