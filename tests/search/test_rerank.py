"""Two-stage search: FAISS candidates re-scored exactly from the stored rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradstore
from gradstore.search.rerank import RowLocator
from indexers import recall_at_k
from ingest import LayerSlot, ProjectionSpec

pytest.importorskip("faiss")

DIM = 32


def _clustered_store(path) -> tuple[gradstore.GradStore, np.ndarray]:
    """1,200 float32 rows around 12 cluster centres, and 16 query rows near them."""
    store = gradstore.open(path, storage_dtype="float32")
    layers = tuple(LayerSlot(f"l{i}", "linear", 8, 8, 4, 4, "factorized", 16 * i, 16, False) for i in range(2))
    store.core.catalog.ensure_run("run", ProjectionSpec(seed=0, kind="factorized", layers=layers))
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((12, DIM)) * 3
    rows = (centres[rng.integers(0, 12, 1200)] + rng.standard_normal((1200, DIM))).astype(np.float32)
    with store.writer("run") as writer:
        writer.append(rows, [f"x{i:04d}" for i in range(1200)], checkpoint="train", split="train")
    queries = (centres[rng.integers(0, 12, 16)] + rng.standard_normal((16, DIM))).astype(np.float32)
    return store, queries


@pytest.fixture(scope="module")
def clustered(tmp_path_factory):
    return _clustered_store(tmp_path_factory.mktemp("rerank") / "store")


def test_rerank_of_every_row_equals_exact_search(clustered):
    store, queries = clustered
    exact = store.build_index("run", method="fisher")
    approximate = store.build_index("run", method="fisher", kind="IVF4,SQ8")
    want = exact.search(queries, 10)
    got = approximate.search(queries, 10, rerank=1200)  # every row is a candidate
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)


def test_rerank_scores_are_exact_and_recall_does_not_drop(clustered):
    store, queries = clustered
    exact = store.build_index("run", method="fisher")
    approximate = store.build_index("run", method="fisher", kind="IVF16,PQ4")
    approximate.faiss_index.nprobe = 2
    _, want = exact.search(queries, 10)
    _, alone = approximate.search(queries, 10)
    scores, got = approximate.search(queries, 10, rerank=4)
    assert recall_at_k(got, want) >= recall_at_k(alone, want)
    assert recall_at_k(got, want) > 0.8  # 0.94 here, FAISS alone 0.53
    block = store.read_gradients("run")
    rows = dict(zip(block.grad_ids.tolist(), block.vectors))
    prepared = exact.prepare_queries(queries).numpy()
    for query, ids, values in zip(prepared, got, scores):
        np.testing.assert_allclose(values, [query @ rows[i] for i in ids], rtol=1e-4, atol=1e-5)
        assert list(values) == sorted(values, reverse=True)
    table = store.attribute(queries, run="run", method="fisher", kind="IVF16,PQ4", rerank=4, k=10, write=False)
    assert table.num_rows == 160


def _stored(store) -> dict[int, np.ndarray]:
    block = store.read_gradients("run")
    return dict(zip(block.grad_ids.tolist(), block.vectors))


def test_row_locator_reads_the_asked_rows_after_appends_deletions_and_compaction(tmp_path):
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    store.create_run("run", dim=4)
    rng = np.random.default_rng(1)
    locator = RowLocator()

    def append(n: int, prefix: str) -> None:
        with store.writer("run", commit_rows=16) as writer:
            writer.append(
                rng.standard_normal((n, 4)).astype(np.float32), [f"{prefix}{i}" for i in range(n)], checkpoint="c"
            )

    def check(asked: np.ndarray) -> None:
        rows = _stored(store)
        found, got = locator.read(store.core, "run", asked)
        assert found.tolist() == [g in rows for g in asked.tolist()]
        np.testing.assert_array_equal(got, np.stack([rows[g] for g in asked[found].tolist()]))

    append(50, "a")
    first = np.array(sorted(_stored(store)))
    check(first[::3])
    append(40, "b")  # a new writer: a second id prefix, more fragments
    check(np.array(sorted(_stored(store)))[1::4])
    store.core.table("gradients").delete("example_id IN ('a3', 'a4', 'a10', 'b7')")  # offsets after them shift
    check(first[::2])  # some of them deleted: reported as not found
    assert len(store.core.table("gradients").to_lance().get_fragments()) > 1
    store.compact()  # rows move to new fragments
    assert len(store.core.table("gradients").to_lance().get_fragments()) == 1
    every = np.array(sorted(_stored(store)))
    check(every[::-1][::5][::-1].copy())
    found, got = locator.read(store.core, "run", np.empty(0, np.int64))
    assert found.shape == (0,) and got.shape == (0, 4)


def test_rerank_drops_candidates_deleted_since_the_build(tmp_path):
    store, queries = _clustered_store(tmp_path / "store")
    approximate = store.build_index("run", method="fisher", kind="IVF4,SQ8")
    _, before = approximate.search(queries, 10, rerank=1200)
    gone = sorted({int(g) for g in before[:, 0]})
    store.core.table("gradients").delete(f"grad_id IN ({', '.join(map(str, gone))})")
    stale = "holds 1200 rows and its selection 1184 now: build it again .* drop the deleted ones"
    with pytest.warns(gradstore.StaleIndexWarning, match=stale):
        scores, got = approximate.search(queries, 10, rerank=1200)  # every remaining row is a candidate
    rows = _stored(store)
    assert not set(gone) & set(rows)
    ids = np.array(sorted(rows))
    exact = (
        approximate.prepare_queries(queries)
        @ approximate.space.rows(torch.from_numpy(np.stack([rows[g] for g in ids]))).T
    )
    want = torch.topk(exact, 10, dim=1)
    np.testing.assert_array_equal(got, ids[want.indices.numpy()])
    np.testing.assert_allclose(scores, want.values.numpy(), rtol=1e-5)


@pytest.mark.parametrize("method", ["fisher", "diagonal", "kfac", "ekfac", "grad-dot", "trackstar"])
def test_faiss_holds_balanced_rows_whose_inner_products_are_the_scores(clustered, method):
    store, queries = clustered
    exact = store.build_index("run", method=method)
    flat = store.build_index("run", method=method, kind="Flat")
    assert flat.manifest["first_stage"] == "balanced"
    rows = store.read_gradients("run").vectors
    balanced = flat.first_stage(queries, rows=False) @ flat.first_stage(rows, rows=True).T
    np.testing.assert_allclose(
        balanced, exact.space.scores(exact.prepare_queries(queries), torch.from_numpy(rows)), rtol=1e-4, atol=1e-4
    )
    want_scores, want = exact.search(queries, 10)
    got_scores, got = flat.search(queries, 10)  # FAISS alone, no re-rank
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-4, atol=1e-4)


def test_hnsw_two_stage_equals_exact_after_reload_and_append(tmp_path):
    store, queries = _clustered_store(tmp_path / "store")
    graph = store.build_index("run", method="fisher", kind="HNSW16,Flat", name="graph")
    assert graph.faiss_index.graph and graph.faiss_index.ef_search == 128
    exact = store.build_index("run", method="fisher")
    want_scores, want = exact.search(queries, 10)
    scores, got = graph.search(queries, 10, rerank=2)
    assert recall_at_k(got, want) >= 0.95  # 1.0 here
    rows = _stored(store)
    prepared = exact.prepare_queries(queries).numpy()
    for query, ids, values in zip(prepared, got, scores):  # re-ranked: exact scores of the stored rows
        np.testing.assert_allclose(values, [query @ rows[i] for i in ids], rtol=1e-5, atol=1e-5)
    reloaded = store.index("graph")
    assert reloaded.faiss_index.graph and reloaded.faiss_index.ef_search == 128
    assert recall_at_k(reloaded.search(queries, 10, rerank=2)[1], want) >= 0.95

    rng = np.random.default_rng(5)
    fresh = (queries[:4, None] * 3 + rng.standard_normal((4, 5, DIM))).reshape(20, DIM).astype(np.float32)
    with store.writer("run") as writer:  # rows near the queries: the new best answers of the first 4 queries
        writer.append(fresh, [f"y{i:04d}" for i in range(20)], checkpoint="train", split="train")
    appended = store.build_index("run", method="fisher", kind="HNSW16,Flat", name="graph")  # the same fit
    assert appended.faiss_index.ntotal == appended.manifest["rows"] == 1220
    exact = store.build_index("run", method="fisher")
    want_scores, want = exact.search(queries, 10)
    new_ids = set(np.setdiff1d(list(_stored(store)), list(rows)).tolist())
    assert set(want[:4].ravel().tolist()) & new_ids  # the appended rows matter
    scores, got = appended.search(queries, 10, rerank=2)
    assert recall_at_k(got, want) >= 0.95
    np.testing.assert_allclose(scores[got == want], want_scores[got == want], rtol=1e-5)
    # the rows were refitted, the indexed rows were not moved: FAISS searches in the space of the build's fit
    assert store.fits.fitted == 2
    every = _stored(store)
    with pytest.warns(gradstore.StaleIndexWarning, match="whose rows were 1200 then and are 1220 now"):
        alone_scores, alone = appended.search(queries, 10)
    first = appended.first_stage(queries, rows=False)
    for query, ids, values in zip(first, alone, alone_scores):
        np.testing.assert_allclose(
            values, appended.first_stage(np.stack([every[i] for i in ids]), rows=True) @ query, rtol=1e-4
        )
    np.testing.assert_array_equal(store.index("graph").first_stage(queries, rows=False), first)
