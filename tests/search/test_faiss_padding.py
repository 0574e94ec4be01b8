"""FAISS searches that find fewer than k rows (IVF lists or HNSW graphs holding fewer candidates): the missing
entries are marked, packed at the end of their rows, warned about once per call, and never reach results."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gradstore
from gradstore.search.index import valid_entries
from indexers import MISSING_ID, ExactIndex, FaissIndex, FewerResultsWarning, blocks_from_arrays, found_counts, packed
from ingest import LayerSlot, ProjectionSpec

faiss = pytest.importorskip("faiss")

DIM = 32
ROWS = 2000


def _filled(factory: str, ids: np.ndarray, vectors: np.ndarray, **settings) -> FaissIndex:
    index = FaissIndex(factory, vectors.shape[1], **settings)
    source = blocks_from_arrays(ids, vectors)
    index.train(source)
    index.add_from(source)
    return index


def _fewer_warnings(caught: list) -> list:
    return [w for w in caught if issubclass(w.category, FewerResultsWarning)]


def _search(index, queries, k, **options):
    """``index.search`` and the FewerResultsWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = index.search(queries, k, **options)
    return found, _fewer_warnings(caught)


def _assert_packed(scores: np.ndarray, ids: np.ndarray, fill: float = -np.inf) -> None:
    """Missing entries only at the end of each row, with the fill score; found ids unique per row."""
    for row_scores, row_ids in zip(scores, ids, strict=True):
        found = int((row_ids != MISSING_ID).sum())
        assert (row_ids[:found] != MISSING_ID).all() and (row_ids[found:] == MISSING_ID).all()
        assert (row_scores[found:] == fill).all() and np.isfinite(row_scores[:found]).all()
        assert len(np.unique(row_ids[:found])) == found


@pytest.fixture(scope="module")
def gaussian() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """2,000 Gaussian rows (no clusters: IVF lists of about 60 rows) under scattered ids, and 6 queries."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    return np.arange(ROWS, dtype=np.int64) * 3 + 7, vectors, rng.standard_normal((6, DIM)).astype(np.float32)


def _duplicated(rng: np.random.Generator) -> np.ndarray:
    """900 rows, two thirds of them in two tight knots (300 copies of one row, 300 near another): a sparse HNSW
    graph over them falls apart, and its searches reach a fraction of the rows."""
    return np.concatenate(
        [
            np.tile(rng.standard_normal((1, DIM)), (300, 1)),
            rng.standard_normal((300, DIM)) * 0.001 + 5,
            rng.standard_normal((300, DIM)),
        ]
    ).astype(np.float32)


# ------------------------------------------------------------------------------------------- indexers level
def test_packed_moves_missing_entries_to_the_end_in_order() -> None:
    scores = np.array([[5.0, -3e38, 4.0, 3.0], [2.0, 1.0, 0.5, 0.25]], np.float32)
    ids = np.array([[10, -1, 11, 12], [1, 2, 3, 4]], np.int64)
    got_scores, got_ids = packed(scores, ids, ids < 0)
    np.testing.assert_array_equal(got_ids, [[10, 11, 12, -1], [1, 2, 3, 4]])
    np.testing.assert_array_equal(got_scores, [[5.0, 4.0, 3.0, -np.inf], [2.0, 1.0, 0.5, 0.25]])
    assert found_counts(got_ids).tolist() == [3, 4]
    full_scores, full_ids = scores[1:].copy(), ids[1:].copy()
    assert packed(full_scores, full_ids, full_ids < 0)[1] is full_ids  # nothing missing: the arrays as they are


def test_ivf_with_few_lists_probed_packs_and_warns_once(gaussian) -> None:
    ids, vectors, queries = gaussian
    index = _filled("IVF32,Flat", ids, vectors, nprobe=1)
    (scores, found), caught = _search(index, queries, 500)
    assert found.shape == (6, 500)
    assert (found_counts(found) < 500).all()  # one list of ~60 rows each
    _assert_packed(scores, found)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "fewer than k=500 rows for 6 of 6 queries" in message and "nprobe" in message and "exact" in message.lower()
    # the rows found are every row of the probed list, best first, with their exact scores
    ivf = faiss.extract_index_ivf(index._index)
    _, row_lists = ivf.quantizer.search(vectors, 1)
    _, probed = ivf.quantizer.search(queries, 1)
    for q in range(len(queries)):
        candidates = np.flatnonzero(row_lists[:, 0] == probed[q, 0])
        exact = vectors[candidates] @ queries[q]
        order = np.lexsort((ids[candidates], -exact))
        n = found_counts(found[q : q + 1])[0]
        assert n == len(candidates)
        np.testing.assert_array_equal(found[q, :n], ids[candidates][order])
        np.testing.assert_allclose(scores[q, :n], exact[order], rtol=1e-4, atol=1e-4)


def test_no_warning_when_asked_or_when_every_row_is_found(gaussian) -> None:
    ids, vectors, queries = gaussian
    index = _filled("IVF32,Flat", ids, vectors, nprobe=1)
    (_, found), caught = _search(index, queries, 500, warn=False)
    assert not caught and (found_counts(found) < 500).all()
    (_, found), caught = _search(index, queries, 10)  # each list holds 10
    assert not caught and (found_counts(found) == 10).all()


def test_ivf_probing_every_list_equals_exact_top_k(gaussian) -> None:
    ids, vectors, queries = gaussian
    index = _filled("IVF32,Flat", ids, vectors, nprobe=32)
    (scores, found), caught = _search(index, queries, 500)
    assert not caught and (found != MISSING_ID).all()
    exact_scores, exact_ids = ExactIndex(device="cpu", kernel="float32").search(queries, (ids, vectors), 500)
    np.testing.assert_array_equal(found, exact_ids)
    np.testing.assert_allclose(scores, exact_scores, rtol=1e-4, atol=1e-4)


def test_l2_padding_scores_are_plus_infinity(gaussian) -> None:
    ids, vectors, queries = gaussian
    index = _filled("IVF32,Flat", ids, vectors, metric="l2", nprobe=1)
    (scores, found), caught = _search(index, queries, 500)
    assert len(caught) == 1
    _assert_packed(scores, found, fill=np.inf)


def test_hnsw_graph_that_reaches_few_rows_packs_and_warns_once() -> None:
    vectors = _duplicated(np.random.default_rng(1))
    ids = np.arange(len(vectors), dtype=np.int64) + 100
    index = _filled("HNSW2,Flat", ids, vectors, ef_search=1)
    queries = vectors[::75]
    (scores, found), caught = _search(index, queries, len(vectors))
    assert (found_counts(found) < len(vectors)).any()
    _assert_packed(scores, found)
    assert len(caught) == 1 and "ef_search" in str(caught[0].message)
    for q in range(len(queries)):  # the rows found come with their exact scores, best first
        n = found_counts(found[q : q + 1])[0]
        exact = vectors[found[q, :n] - 100] @ queries[q]
        np.testing.assert_allclose(scores[q, :n], exact, rtol=1e-4, atol=1e-4)
        assert (np.diff(scores[q, :n]) <= 1e-5).all()


# ------------------------------------------------------------------------------------------- store level
def _store(path, rows: np.ndarray) -> gradstore.GradStore:
    store = gradstore.open(path, storage_dtype="float32")
    layers = tuple(LayerSlot(f"l{i}", "linear", 8, 8, 4, 4, "factorized", 16 * i, 16, False) for i in range(2))
    store.core.catalog.ensure_run("run", ProjectionSpec(seed=0, kind="factorized", layers=layers))
    with store.writer("run") as writer:
        writer.append(rows, [f"x{i:04d}" for i in range(len(rows))], checkpoint="train", split="train")
    return store


@pytest.fixture(scope="module")
def gaussian_store(tmp_path_factory, gaussian):
    _, vectors, queries = gaussian
    return _store(tmp_path_factory.mktemp("padding") / "store", vectors), queries


def test_index_search_marks_missing_rows_and_valid_entries_drops_them(gaussian_store) -> None:
    store, queries = gaussian_store
    index = store.build_index("run", kind="IVF32,Flat", method="grad-dot")
    index.faiss_index.nprobe = 1
    (scores, found), caught = _search(index, queries, 500)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "fewer than k=500 rows for 6 of 6 queries" in message
    assert "kind='exact'" in message and "nprobe" in message
    _assert_packed(scores, found)
    positions, ranks, flat_scores, flat_ids = valid_entries(scores, found)
    assert (flat_ids != MISSING_ID).all() and np.isfinite(flat_scores).all()
    for q, n in enumerate(found_counts(found)):
        assert ranks[positions == q].tolist() == list(range(1, n + 1))
        np.testing.assert_array_equal(flat_ids[positions == q], found[q, :n])
    names = index.example_ids(found)  # entries not found get a null example_id, the others theirs
    assert names.null_count == int((found == MISSING_ID).sum())
    assert index.example_ids(flat_ids).null_count == 0


def test_index_probing_every_list_equals_exact_search(gaussian_store) -> None:
    store, queries = gaussian_store
    index = store.build_index("run", kind="IVF32,Flat", method="grad-dot")
    index.faiss_index.nprobe = 32
    (scores, found), caught = _search(index, queries, 500)
    assert not caught
    want_scores, want = store.build_index("run", method="grad-dot").search(queries, 500)
    np.testing.assert_array_equal(found, want)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-4)


def test_rerank_of_few_candidates_packs_and_warns_once(gaussian_store) -> None:
    store, queries = gaussian_store
    index = store.build_index("run", kind="IVF32,Flat", method="grad-dot")
    index.faiss_index.nprobe = 1
    (scores, found), caught = _search(index, queries, 500, rerank=2)
    assert len(caught) == 1 and "fewer than k=500" in str(caught[0].message)
    _assert_packed(scores, found)
    (_, alone), _ = _search(index, queries, 500)
    for q in range(len(queries)):  # the same candidates (every row of the probed list), exactly re-scored
        assert set(found[q][found[q] >= 0]) == set(alone[q][alone[q] >= 0])


def test_hnsw_index_in_a_store_warns_with_rerank_advice(tmp_path) -> None:
    vectors = _duplicated(np.random.default_rng(2))
    store = _store(tmp_path / "store", vectors)
    index = store.build_index("run", kind="HNSW2,Flat", method="grad-dot")
    index.faiss_index.ef_search = 1
    (scores, found), caught = _search(index, vectors[::75], len(vectors))
    assert (found_counts(found) < len(vectors)).any()
    _assert_packed(scores, found)
    assert len(caught) == 1 and "rerank" in str(caught[0].message) and "ef_search" in str(caught[0].message)


def test_attribute_over_few_probed_rows_returns_fewer_rows_not_padding(gaussian_store) -> None:
    store, queries = gaussian_store
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = store.attribute(queries, run="run", kind="IVF32,Flat", k=500, write=False, method="grad-dot")
    assert len(_fewer_warnings(caught)) == 1
    grad_ids = table.column("grad_id").to_numpy()
    assert (grad_ids != MISSING_ID).all() and table.column("example_id").null_count == 0
    assert 0 < table.num_rows < 6 * 500
    for query in set(table.column("query_id").to_pylist()):
        ranks = [
            r for q, r in zip(table.column("query_id").to_pylist(), table.column("rank").to_pylist()) if q == query
        ]
        assert ranks == list(range(1, len(ranks) + 1))
