"""The store: round trips, filters, examples, errors."""

from __future__ import annotations

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import gradstore
from gradstore.core.vectors import decode, encode


def _rows(n: int, dim: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, dim)) * scale).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_vectors_and_metadata_round_trip(store_path, dtype):
    store = gradstore.open(store_path, storage_dtype=dtype)
    store.create_run("r", dim=24, projection={"kind": "test"})
    vectors = _rows(50, 24)
    ids = [f"ex{i}" for i in range(50)]
    with store.writer("r", commit_rows=16) as writer:
        grad_ids = np.concatenate(
            [
                writer.append(
                    vectors[i : i + 10],
                    ids[i : i + 10],
                    step=i // 10,
                    epoch=1,
                    split="train",
                    loss=np.arange(i, i + 10, dtype=np.float32),
                    num_tokens=[7] * 10,
                    learning_rate=0.5,
                    checkpoint="c0",
                    rank=0,
                )
                for i in range(0, 50, 10)
            ]
        )
    assert len(set(grad_ids.tolist())) == 50
    block = store.read_gradients("r", columns=("example_id", "step", "loss", "num_tokens", "learning_rate"))
    order = np.argsort(block.grad_ids)
    assert block.grad_ids[order].tolist() == sorted(grad_ids.tolist())
    got = block.vectors[order]
    tolerance = {"float16": 2e-3, "bfloat16": 8e-3}.get(dtype, 0)
    np.testing.assert_allclose(got, vectors, rtol=tolerance, atol=tolerance * np.abs(vectors).max())
    meta = block.metadata.take(pa.array(order)).to_pydict()
    assert meta["example_id"] == ids
    assert meta["step"] == [i // 10 for i in range(50)]
    assert meta["loss"] == list(range(50))
    assert set(meta["num_tokens"]) == {7} and set(meta["learning_rate"]) == {0.5}
    assert store.storage_dtype == dtype and store.dim == 24


def test_default_dtype_keeps_inner_products_of_tiny_gradients():
    """Entries around 1e-8: plain float16 underflows; the default (unit float16 + norm) stays within 1e-3."""
    a = _rows(64, 4096, seed=1, scale=1e-8)
    b = a + _rows(64, 4096, seed=2, scale=5e-9)
    exact = np.sum(a.astype(np.float64) * b, axis=1)
    decoded_a = decode(encode(a, "float16"), "float16").astype(np.float64)
    decoded_b = decode(encode(b, "float16"), "float16").astype(np.float64)
    relative = np.abs(np.sum(decoded_a * decoded_b, axis=1) - exact) / np.abs(exact)
    assert relative.max() <= 1e-3
    naive = np.sum(a.astype(np.float16).astype(np.float64) * b.astype(np.float16), axis=1)
    assert (np.abs(naive - exact) / np.abs(exact)).max() > 1e-2  # why the default is not a plain float16 column


def test_filters_by_run_checkpoint_split_and_steps(store):
    store.create_run("a", dim=4)
    store.create_run("b", dim=4)
    with store.writer("a") as wa, store.writer("b") as wb:
        for step in range(6):
            wa.append(
                _rows(3, 4, step),
                [f"a{step}-{i}" for i in range(3)],
                step=step,
                split="train" if step < 4 else "query",
                checkpoint=f"c{step % 2}",
            )
            wb.append(_rows(2, 4, step + 100), [f"b{step}-{i}" for i in range(2)], step=step, split="train")
    frame = store.sql("select * from gradients").df()
    cases = [
        (dict(run="a"), frame.run_id == "a"),
        (dict(run=["a", "b"], split="query"), frame.split == "query"),
        (dict(run="a", checkpoint="c1"), (frame.run_id == "a") & (frame.checkpoint == "c1")),
        (dict(steps=(2, 4)), frame.step.between(2, 4)),
        (dict(steps=(None, 1), run="b"), (frame.step <= 1) & (frame.run_id == "b")),
        (dict(where="example_id LIKE 'a5%'"), frame.example_id.str.startswith("a5")),
    ]
    for filters, expected in cases:
        run = filters.pop("run", None)
        got = store.read_gradients(run, **filters)
        assert sorted(got.grad_ids.tolist()) == sorted(frame.grad_id[expected].tolist()), filters


def test_iter_gradients_streams_bounded_blocks(store):
    store.create_run("r", dim=8)
    vectors = _rows(1000, 8)
    with store.writer("r", commit_rows=300) as writer:
        for i in range(0, 1000, 100):
            writer.append(vectors[i : i + 100], [str(j) for j in range(i, i + 100)])
    blocks = list(store.iter_gradients("r", block_rows=128))
    assert [len(b) for b in blocks] == [128] * 7 + [104]
    ids = np.concatenate([b.metadata.column("example_id").to_numpy(zero_copy_only=False) for b in blocks])
    got = np.concatenate([b.vectors for b in blocks])[np.argsort(ids.astype(int))]
    np.testing.assert_allclose(got, vectors, rtol=2e-3, atol=2e-3 * np.abs(vectors).max())


def _example_inputs(tmp_path):
    rows = [{"uid": f"e{i}", "text": f"example {i}", "label": i % 3} for i in range(6)]
    frame = pd.DataFrame(rows)
    parquet = tmp_path / "examples.parquet"
    pq.write_table(pa.Table.from_pandas(frame), parquet)
    import datasets

    return rows, {
        "list of dicts": rows,
        "arrow": pa.Table.from_pylist(rows),
        "pandas": frame,
        "polars": pl.DataFrame(rows),
        "parquet": parquet,
        "hf dataset": datasets.Dataset.from_list(rows),
    }


def test_add_examples_from_every_input_kind(tmp_path):
    rows, inputs = _example_inputs(tmp_path)
    for kind, data in inputs.items():
        store = gradstore.open(tmp_path / kind.replace(" ", "_"))
        assert store.add_examples(data, id_column="uid") == len(rows)
        got = store.sql("select example_id, text, label from examples order by example_id").fetchall()
        assert got == [(r["uid"], r["text"], r["label"]) for r in rows], kind


def test_add_examples_errors(store):
    store.add_examples([{"example_id": 1, "text": "a"}])
    with pytest.raises(gradstore.SchemaMismatchError, match="columns"):
        store.add_examples([{"example_id": 2, "other": "b"}])
    with pytest.raises(gradstore.SchemaMismatchError, match="no id column"):
        store.add_examples([{"text": "c"}], id_column="uid")
    with pytest.raises(gradstore.InvalidArgumentError, match="cannot read examples"):
        store.add_examples(42)
    assert store.sql("select example_id from examples").fetchall() == [("1",)]


def test_open_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(gradstore.NotAStoreError):
        gradstore.open(tmp_path / "file")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("a,b")
    with pytest.raises(gradstore.NotAStoreError, match="not a gradstore store"):
        gradstore.open(tmp_path / "other")
    with pytest.raises(gradstore.NotAStoreError):
        gradstore.open(tmp_path / "missing", create=False)
    with pytest.raises(ValueError, match="storage_dtype"):
        gradstore.open(tmp_path / "s", storage_dtype="int4")


def test_corrupt_table_raises_store_corrupt(store_path):
    store = gradstore.open(store_path)
    store.create_run("r", dim=4)
    for manifest in (store_path / "gradients.lance" / "_versions").iterdir():
        manifest.write_bytes(b"garbage")
    with pytest.raises(gradstore.StoreCorruptError):
        gradstore.open(store_path).read_gradients("r")


def test_append_errors_reject_the_whole_batch(store):
    store.create_run("r", dim=4)
    with store.writer("r") as writer:
        with pytest.raises(gradstore.SchemaMismatchError, match=r"\[n, 4\]"):
            writer.append(np.zeros((2, 5)), ["a", "b"])
        with pytest.raises(gradstore.SchemaMismatchError, match="example ids"):
            writer.append(np.zeros((2, 4)), ["a"])
        with pytest.raises(gradstore.SchemaMismatchError, match="unknown metadata"):
            writer.append(np.zeros((1, 4)), ["a"], colour="red")
        bad = np.ones((3, 4), np.float32)
        bad[1, 2] = np.nan
        with pytest.raises(gradstore.NonFiniteGradientError, match="'y'"):
            writer.append(bad, ["x", "y", "z"])
        writer.append(np.ones((1, 4)), ["ok"])
    assert store.sql("select example_id from gradients").fetchall() == [("ok",)]
    store.create_run("other", dim=8)  # a run of another dim gets a table of its own
    with store.writer("other") as writer, pytest.raises(gradstore.SchemaMismatchError, match=r"\[n, 8\]"):
        writer.append(np.zeros((1, 4)), ["a"])
    with pytest.raises(gradstore.UnknownRunError, match="unknown run 'nope'"):
        store.writer("nope")
    with pytest.raises(gradstore.UnknownRunError):
        store.read_gradients("nope")
    with pytest.raises(ValueError, match="already exists"):
        store.create_run("r", dim=4)


def test_nonfinite_drop_mode_keeps_the_finite_rows(store):
    store.create_run("r", dim=3)
    bad = np.ones((3, 3), np.float32)
    bad[0, 0] = np.inf
    with store.writer("r", nonfinite="drop") as writer:
        kept = writer.append(bad, ["x", "y", "z"], loss=[1.0, 2.0, 3.0])
        assert len(kept) == 2 and writer.rows_dropped == 1
    assert store.sql("select example_id, loss from gradients order by 1").fetchall() == [("y", 2.0), ("z", 3.0)]


def test_run_with_same_projection_can_be_reopened(store):
    store.create_run("r", dim=4, projection={"seed": 1})
    assert store.create_run("r", dim=4, projection={"seed": 1}, exist_ok=True)["run_id"] == "r"
    with pytest.raises(gradstore.SchemaMismatchError, match="projection"):
        store.create_run("r", dim=4, projection={"seed": 2}, exist_ok=True)
    assert store.core.run_projection("r") == {"seed": 1}


def test_checkpoints_are_upserted(store):
    store.create_run("r", dim=4)
    store.record_checkpoint("r", "c1", step=10, epoch=0, learning_rate=0.1)
    store.record_checkpoint("r", "c0", step=5, epoch=0, learning_rate=0.2)
    store.record_checkpoint("r", "c1", step=10, epoch=0, learning_rate=0.05)
    got = store.checkpoints("r").select(["checkpoint", "step", "learning_rate"]).to_pylist()
    assert got == [
        {"checkpoint": "c0", "step": 5, "learning_rate": 0.2},
        {"checkpoint": "c1", "step": 10, "learning_rate": 0.05},
    ]
    with pytest.raises(gradstore.UnknownRunError):
        store.record_checkpoint("x", "c")


def test_a_checkpoint_recorded_again_keeps_what_the_new_record_does_not_give(tmp_path):
    """``record_checkpoint`` with a value left out (``None``: a checkpoint pass captured without
    ``learning_rate=``) keeps the recorded one; given values replace."""
    store = gradstore.open(tmp_path / "store")
    store.create_run("r", dim=4)
    store.core.record_checkpoint("r", "c", step=3, epoch=1, learning_rate=0.5)
    store.core.record_checkpoint("r", "c", step=3)
    assert store.sql("select step, epoch, learning_rate from checkpoints").fetchall() == [(3, 1, 0.5)]
    store.core.record_checkpoint("r", "c", step=4, epoch=2, learning_rate=0.25)
    assert store.sql("select step, epoch, learning_rate from checkpoints").fetchall() == [(4, 2, 0.25)]
