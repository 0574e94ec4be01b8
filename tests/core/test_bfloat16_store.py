"""The bfloat16 encoding (bf16 unit rows as uint16 bit patterns + float32 norm): the store's accuracy rule,
exact search against float32, the encoding read from the table's field tag (old untagged stores still read,
unknown tags refused), verify and SQL on such a store, and the read-ahead of its rows."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

import gradstore
import gradstore.search.index as index_module
from gradstore.core import schema as S
from gradstore.core.stored_rows import stored_blocks
from gradstore.core.vectors import (
    ENCODING_KEY,
    UNIT_DTYPES,
    decode,
    encode,
    encode_rows,
    storage_dtype_of,
    stored_values,
    vector_field,
)
from gradstore.errors import GradstoreError, StoreCorruptError
from indexers import UNIT_BF16_NORM, ExactIndex, prefetched

DIM = 4096


def _rows(n: int, dim: int, seed: int, scale: float | np.ndarray = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, dim)) * scale).astype(np.float32)


def _write(store: gradstore.GradStore, run: str, vectors: np.ndarray, checkpoint: str = "c") -> None:
    store.create_run(run, dim=vectors.shape[1])
    with store.writer(run) as writer:
        for start in range(0, len(vectors), 256):
            part = vectors[start : start + 256]
            ids = [f"{run}{i}" for i in range(start, start + len(part))]
            writer.append(part, ids, checkpoint=checkpoint, split="train")


def test_bfloat16_rows_are_rounded_unit_rows_stored_as_their_bits() -> None:
    vectors = _rows(7, 33, seed=0, scale=np.logspace(-8, 3, 7)[:, None])
    vectors[3] = 0.0
    values, norms = encode_rows(vectors, "bfloat16")
    assert values.dtype == np.uint16 and values.shape == vectors.shape
    unit = torch.from_numpy(vectors / np.where(norms > 0, norms, 1)[:, None].astype(np.float32))
    np.testing.assert_array_equal(values, unit.bfloat16().view(torch.int16).numpy().view(np.uint16))
    encoded = encode(vectors, "bfloat16")
    column = encoded[S.VECTOR_COLUMN]
    assert column.type == pa.list_(pa.uint16(), 33) and set(encoded) == {S.VECTOR_COLUMN, S.NORM_COLUMN}
    decoded = decode(encoded, "bfloat16")
    assert decoded.dtype == np.float32 and not decoded[3].any()
    np.testing.assert_allclose(decoded, vectors, rtol=2**-8, atol=0)
    shared = stored_values(column, "bfloat16")
    assert shared.dtype == torch.bfloat16 and shared.shape == (7, 33)
    np.testing.assert_array_equal(shared.view(torch.int16).numpy().view(np.uint16), values)


@pytest.mark.parametrize("dtype", UNIT_DTYPES)
def test_unit_encodings_keep_inner_products_of_tiny_gradients(dtype: str) -> None:
    """The store's accuracy rule: inner products within 1e-3 |a| |b| of float32's, entries down to 1e-8."""
    a = _rows(64, DIM, seed=1, scale=1e-8)
    b = a + _rows(64, DIM, seed=2, scale=5e-9)
    c = _rows(64, DIM, seed=3, scale=1e-8)
    for left, right in ((a, b), (a, c)):
        exact = np.sum(left.astype(np.float64) * right, axis=1)
        got = np.sum(decode(encode(left, dtype), dtype).astype(np.float64) * decode(encode(right, dtype), dtype), 1)
        bound = 1e-3 * np.linalg.norm(left.astype(np.float64), axis=1) * np.linalg.norm(right.astype(np.float64), 1)
        assert (np.abs(got - exact) <= bound).all()


def test_exact_search_on_a_bfloat16_store_matches_float32(tmp_path) -> None:
    """Every score within 1e-3 |q| |g| of the float64 product of the original rows, and the top-k ids those of
    the float32 ranking except where true scores tie within that tolerance; first (cold) and repeat calls,
    and a streamed search (over the row cache's budget) agree exactly."""
    store = gradstore.open(tmp_path / "s", storage_dtype="bfloat16")
    vectors = _rows(1500, DIM, seed=4, scale=np.logspace(-8, 2, 1500)[:, None])
    vectors[::7] += 30 * vectors[1::7].mean(axis=0)  # many near ties among the largest rows
    _write(store, "r", vectors)
    queries = _rows(12, DIM, seed=5)
    index = store.build_index("r", checkpoint="c", method="grad-dot")
    first = index.search(queries, 10)
    assert index.cached_rows() is not None
    again = index.search(queries, 10)
    store.core.row_cache.clear()
    store.core.row_cache.budget_bytes = 1
    streamed = index.search(queries, 10)
    assert index.cached_rows() is None
    for other in (again, streamed):
        np.testing.assert_array_equal(other[1], first[1])
        np.testing.assert_array_equal(other[0], first[0])
    grad_ids = store.read_gradients("r", columns=()).grad_ids
    position = {g: i for i, g in enumerate(grad_ids.tolist())}
    found = np.vectorize(position.get)(first[1])
    true = queries.astype(np.float64) @ vectors.astype(np.float64).T
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1)
    tolerance = 1e-3 * np.linalg.norm(queries, axis=1)[:, None] * norms[found]
    assert (np.abs(first[0] - np.take_along_axis(true, found, 1)) <= tolerance).all()
    kth = np.sort(true, axis=1)[:, -10]
    assert (np.take_along_axis(true, found, 1) >= kth[:, None] - tolerance).all()
    float32_top = np.argsort(-true, axis=1, kind="stable")[:, :10]
    for row in range(len(queries)):  # a float32 top-k row that is missing must tie the k-th within tolerance
        missing = np.setdiff1d(float32_top[row], found[row])
        slack = 1e-3 * np.linalg.norm(queries[row]) * (norms[missing] + norms[found[row]].max())
        assert (true[row, missing] <= kth[row] + slack).all()


def test_attribute_verify_sql_and_a_second_dim_on_a_bfloat16_store(tmp_path) -> None:
    store = gradstore.open(tmp_path / "s", storage_dtype="bfloat16")
    vectors = _rows(300, 64, seed=6)
    _write(store, "r", vectors, checkpoint="train")
    _write(store, "small", _rows(20, 8, seed=7), checkpoint="train")
    reopened = gradstore.open(tmp_path / "s")
    assert reopened.storage_dtype == "bfloat16"
    for name in reopened.core.gradient_tables.by_dim().values():  # one encoding per store, each table tagged
        assert storage_dtype_of(reopened.core.table(name).schema.field(S.VECTOR_COLUMN)) == "bfloat16"
    table = reopened.attribute(vectors[:3], run="r", k=1, write=False, method="grad-dot")
    assert table.column("example_id").to_pylist() == ["r0", "r1", "r2"]
    report = reopened.verify()
    assert report.problems == [] and report.tables["gradients"] == 300
    counts = reopened.sql("SELECT run_id, count(*) AS n FROM gradients GROUP BY run_id ORDER BY run_id").fetchall()
    assert counts == [("r", 300), ("small", 20)]
    blocks = list(stored_blocks(reopened, "r", "train", "train", block_rows=128)())
    assert all(block[1].dtype == torch.bfloat16 and len(block) == 3 for block in blocks)
    rows = torch.cat([block[1].float() * torch.from_numpy(block[2])[:, None] for block in blocks]).numpy()
    np.testing.assert_array_equal(rows, reopened.read_gradients("r", columns=()).vectors)


def test_a_store_made_before_the_tag_reads_as_float16(tmp_path, monkeypatch) -> None:
    """A gradients table whose ``grad`` field carries no encoding tag (every store before bfloat16) is float16
    or float32 by its value type, and keeps reading, searching and taking appends as such."""
    untagged = S.gradients_schema

    def old_schema(dim: int, dtype: str) -> pa.Schema:
        schema = untagged(dim, dtype)
        index = schema.get_field_index(S.VECTOR_COLUMN)
        return schema.set(index, schema.field(index).remove_metadata())

    monkeypatch.setattr(S, "gradients_schema", old_schema)
    store = gradstore.open(tmp_path / "s", storage_dtype="float16")
    vectors = _rows(200, 32, seed=8)
    _write(store, "r", vectors, checkpoint="train")
    monkeypatch.undo()
    old = gradstore.open(tmp_path / "s")
    assert old.core.table(S.GRADIENTS).schema.field(S.VECTOR_COLUMN).metadata is None
    assert old.storage_dtype == "float16"
    with old.writer("r") as writer:
        writer.append(vectors[:5], [f"more{i}" for i in range(5)], checkpoint="train", split="train")
    got = old.read_gradients("r", columns=())
    assert len(got) == 205
    np.testing.assert_allclose(got.vectors[:200], vectors, rtol=2e-3, atol=2e-3 * np.abs(vectors).max())
    top = old.attribute(vectors[:2], run="r", k=2, write=False, method="grad-dot").column("example_id").to_pylist()
    assert sorted(top[:2]) == ["more0", "r0"] and sorted(top[2:]) == ["more1", "r1"]  # equal rows tie
    assert old.verify().problems == []
    with pytest.raises(gradstore.errors.SchemaMismatchError):
        gradstore.open(tmp_path / "s", storage_dtype="bfloat16")


def test_unknown_or_contradictory_encodings_are_refused(tmp_path, monkeypatch) -> None:
    field = vector_field("grad", 4, "bfloat16")
    assert field.metadata == {ENCODING_KEY: b"bfloat16"} and storage_dtype_of(field) == "bfloat16"
    assert storage_dtype_of(pa.field("grad", pa.list_(pa.float32(), 4))) == "float32"
    refused = [
        pa.field("grad", pa.list_(pa.uint16(), 4)),  # untagged uint16: nothing ever wrote that
        pa.field("grad", pa.list_(pa.int8(), 4), metadata={ENCODING_KEY: b"int4"}),  # a newer encoding
        pa.field("grad", pa.list_(pa.float16(), 4), metadata={ENCODING_KEY: b"bfloat16"}),  # tag and type disagree
    ]
    for bad in refused:
        with pytest.raises(StoreCorruptError, match="grad"):
            storage_dtype_of(bad)
    tagged = S.gradients_schema

    def future_schema(dim: int, dtype: str) -> pa.Schema:
        schema = tagged(dim, dtype)
        index = schema.get_field_index(S.VECTOR_COLUMN)
        return schema.set(index, schema.field(index).with_metadata({ENCODING_KEY: b"float8_e4m3"}))

    store = gradstore.open(tmp_path / "s", storage_dtype="float16")
    monkeypatch.setattr(S, "gradients_schema", future_schema)
    store.create_run("r", dim=4)
    monkeypatch.undo()
    reopened = gradstore.open(tmp_path / "s")
    assert reopened.runs().num_rows == 1  # the rest of the store stays readable
    with pytest.raises(GradstoreError, match="float8_e4m3"):
        reopened.read_gradients("r")


def test_read_ahead_of_stored_rows_same_results_errors_raised_no_thread_left(tmp_path, monkeypatch) -> None:
    """The first search reads the bf16 rows with a read-ahead thread: the same top-k as reading in line; a
    failure while reading reaches the caller, leaves nothing in the row cache and no thread behind."""
    store = gradstore.open(tmp_path / "s", storage_dtype="bfloat16")
    vectors = _rows(700, 64, seed=9)
    _write(store, "r", vectors, checkpoint="train")
    queries = _rows(4, 64, seed=10)
    source = stored_blocks(store.core, "r", "train", "train", block_rows=128)
    kernel = ExactIndex(block_rows=256, max_norm=UNIT_BF16_NORM)
    inline = kernel.search(queries, source, 5)
    ahead = kernel.search(queries, prefetched(source, depth=2), 5)
    np.testing.assert_array_equal(ahead[1], inline[1])
    np.testing.assert_array_equal(ahead[0], inline[0])

    def failing(*args, **kwargs):
        blocks = stored_blocks(*args, **{**kwargs, "block_rows": 128})

        def source():
            for number, block in enumerate(blocks()):
                if number == 2:
                    raise OSError("lance: data file unreadable")
                yield block

        return source

    before = threading.active_count()
    monkeypatch.setattr(index_module, "stored_blocks", failing)
    with pytest.raises(OSError, match="unreadable"):
        store.attribute(queries, run="r", k=5, write=False, method="grad-dot")
    assert store.build_index("r", method="grad-dot").cached_rows() is None and threading.active_count() == before
    monkeypatch.undo()
    found = (
        store.attribute(queries, run="r", k=5, write=False, method="grad-dot")
        .column("grad_id")
        .to_numpy()
        .reshape(4, 5)
    )
    np.testing.assert_array_equal(found, inline[1])
