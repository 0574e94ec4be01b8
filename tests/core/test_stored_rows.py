"""Search over rows as stored (float16 or bfloat16 unit rows + norm, or float32): same rows as the decoded reader,
and the streamed first search, the cached later ones and a never-cached index all return the same top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gradstore
from gradstore.core.stored_rows import stored_blocks
from gradstore.core.vector_scanner import late_materialization
from ingest.projection import LayerSlot, ProjectionSpec

DIM = 48


def _store(path, dtype: str, rows: int = 300):
    store = gradstore.open(path, storage_dtype=dtype)
    spec = ProjectionSpec(0, "none", (LayerSlot("w", "linear", 8, 6, None, None, "exact", 0, DIM, False),))
    store.create_run("r", dim=DIM, projection=spec.to_dict())
    vectors = np.random.default_rng(0).standard_normal((rows, DIM)).astype(np.float32)
    vectors *= np.logspace(-6, 2, rows, dtype=np.float32)[:, None]
    with store.writer("r") as writer:
        for start in range(0, rows, 64):
            writer.append(
                vectors[start : start + 64],
                [f"e{i}" for i in range(start, min(rows, start + 64))],
                checkpoint="c",
                split="train",
            )
    return store


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_stored_blocks_hold_the_decoded_rows(tmp_path, dtype: str) -> None:
    store = _store(tmp_path / "s", dtype)
    decoded = store.read_gradients("r", checkpoint="c", split="train", columns=())
    blocks = list(stored_blocks(store.core, "r", "c", "train", block_rows=100)())
    assert [len(block[0]) for block in blocks] == [100, 100, 100]
    assert all(len(block) == (2 if dtype == "float32" else 3) for block in blocks)
    rows = np.concatenate(
        [torch.as_tensor(b[1]).float().numpy() * (b[2][:, None] if len(b) == 3 else 1) for b in blocks]
    )
    np.testing.assert_array_equal(np.concatenate([b[0] for b in blocks]), decoded.grad_ids)
    np.testing.assert_allclose(rows, decoded.vectors, rtol=1e-6)
    assert list(stored_blocks(store.core, "r", "c", "train", where="example_id = 'none'")()) == []


def test_scans_take_or_read_every_vector_by_the_share_selected(tmp_path) -> None:
    """A filter keeping most of a table reads every row's vector and filters after, a narrower one takes the
    vectors of the matching rows (Lance's late materialization): the rows are the same either way."""
    assert not late_materialization(300, 300) and not late_materialization(86, 100)
    assert late_materialization(84, 100) and late_materialization(0, 10)
    store = _store(tmp_path / "s", "float16")
    where = "example_id < 'e2'"  # e0, e1, e10..e19, e100..e199: 112 of 300 rows
    chosen = {}
    for selected in (None, 112, 300):
        blocks = list(stored_blocks(store.core, "r", "c", "train", where, block_rows=1000, selected_rows=selected)())
        chosen[selected] = (np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks]))
    assert len(chosen[None][0]) == 112
    for selected in (112, 300):
        np.testing.assert_array_equal(chosen[selected][0], chosen[None][0])
        np.testing.assert_array_equal(chosen[selected][1], chosen[None][1])


@pytest.mark.parametrize(
    ("method", "dtype"),
    [("grad-dot", "float16"), ("grad-dot", "bfloat16"), ("grad-dot", "float32"), ("cosine", "float16")],
)
def test_streamed_cached_and_uncached_searches_agree(tmp_path, method: str, dtype: str) -> None:
    store = _store(tmp_path / "s", dtype)
    queries = np.random.default_rng(1).standard_normal((5, DIM)).astype(np.float32)
    index = store.build_index("r", checkpoint="c", method=method)
    index.cache_bytes = 0  # over this index's cap: streamed, nothing kept
    streamed = index.search(queries, 7, largest=False)
    assert index.cached_rows() is None
    index.cache_bytes = None
    filled = index.search(queries, 7, largest=False)  # read once into the store's row cache
    assert index.cached_rows() is not None
    cached = index.search(queries, 7, largest=False)
    for other in (filled, cached):
        np.testing.assert_array_equal(other[1], streamed[1])
        np.testing.assert_allclose(other[0], streamed[0], rtol=1e-5, atol=1e-6)
    decoded = store.read_gradients("r", checkpoint="c", split="train", columns=())
    rows = decoded.vectors
    if method == "cosine":
        rows = rows / np.linalg.norm(rows, axis=1, keepdims=True)
        queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    expected = np.argsort(queries.astype(np.float64) @ rows.astype(np.float64).T, axis=1, kind="stable")[:, :7]
    np.testing.assert_array_equal(streamed[1], decoded.grad_ids[expected])


def test_row_cache_serves_repeated_calls_and_drops_rows_of_an_older_version(tmp_path) -> None:
    """Repeated attribute calls read Lance once; rows appended since are searched (the old entry is dropped);
    every method that searches the rows as stored shares one entry; a too small budget streams instead."""
    store = _store(tmp_path / "s", "float16")
    queries = np.random.default_rng(2).standard_normal((3, DIM)).astype(np.float32)
    first = store.attribute(queries, run="r", checkpoint="c", k=4, write=False, method="grad-dot")
    index = store.build_index("r", checkpoint="c", method="grad-dot")
    cached = index.cached_rows()
    assert cached is not None
    fisher = store.build_index("r", checkpoint="c", method="fisher")
    store.attribute(queries, run="r", checkpoint="c", k=4, method="fisher", write=False)
    assert fisher._cache_key() == index._cache_key() and index.cached_rows() is cached
    again = store.attribute(queries, run="r", checkpoint="c", k=4, write=False, method="grad-dot")
    assert again.column("grad_id").to_pylist() == first.column("grad_id").to_pylist()
    assert again.column("example_id").to_pylist() == first.column("example_id").to_pylist()
    old_key = index._cache_key()
    with store.writer("r") as writer:  # a row that beats every stored one for every query
        writer.append(100 * queries.sum(axis=0, keepdims=True), ["new"], checkpoint="c", split="train")
    grown = store.attribute(queries, run="r", checkpoint="c", k=4, write=False, method="grad-dot")
    assert grown.column("example_id").to_pylist()[::4] == ["new"] * 3
    assert store.core.row_cache.get(old_key) is None and index.cached_rows() is not None
    store.core.row_cache.clear()
    store.core.row_cache.budget_bytes = 1
    streamed = store.attribute(queries, run="r", checkpoint="c", k=4, write=False, method="grad-dot")
    assert index.cached_rows() is None
    assert streamed.column("grad_id").to_pylist() == grown.column("grad_id").to_pylist()
    assert streamed.column("example_id").to_pylist() == grown.column("example_id").to_pylist()
