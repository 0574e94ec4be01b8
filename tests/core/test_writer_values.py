"""One bad value is refused in ``append`` itself and loses no good row; nothing is silently stored as inf."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import gradstore

BAD_METADATA = [
    {"step": "abc"},
    {"split": 123},
    {"loss": "x"},
    {"checkpoint": 7},
    {"epoch": 2.5},
    {"rank": 2**40},
    {"loss": [1.0, "y", 2.0]},
    {"step": np.array([1.5, 2.0, 3.0])},
    {"loss": 1e39},
    {"loss": [0.0, 3e39, 1.0]},
    {"learning_rate": "fast"},
    {"num_tokens": [1, 2]},
    {"run_id": "other"},
    {"bogus": 1},
]


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_bad_value_is_refused_in_append_and_good_rows_commit(store_path, dtype):
    store = gradstore.open(store_path, storage_dtype=dtype)
    store.create_run("r", dim=4)
    writer = store.writer("r", commit_rows=1000)
    good = _rows(3, 0)
    writer.append(good, ["a", "b", "c"], step=1, split="train", loss=[0.5, 1.5, 2.5], checkpoint="c0")
    for bad in BAD_METADATA:
        with pytest.raises(gradstore.SchemaMismatchError):
            writer.append(_rows(3, 1), ["x", "y", "z"], **bad)
    writer.append(good[:1], ["d"], step=np.int64(2), loss=np.float32(3.0), epoch=1.0, learning_rate=np.float16(0.5))
    writer.close()
    block = store.read_gradients("r", columns=("example_id", "step", "loss", "epoch", "checkpoint"))
    table = block.metadata.to_pandas().set_index("example_id").sort_index()
    assert list(table.index) == ["a", "b", "c", "d"]
    assert table["step"].tolist() == [1, 1, 1, 2] and table["loss"].tolist() == [0.5, 1.5, 2.5, 3.0]
    assert table.loc["d", "epoch"] == 1 and table.loc["a", "checkpoint"] == "c0"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_rows_beyond_the_storable_range_are_refused_not_stored_as_inf(store_path, dtype):
    store = gradstore.open(store_path, storage_dtype=dtype)
    store.create_run("r", dim=4)
    with store.writer("r") as writer:
        with pytest.raises(gradstore.SchemaMismatchError, match="norm above"):
            writer.append(np.array([[3e38, 3e38, 0, 0], [1, 2, 3, 4]], np.float32), ["big", "ok"])
        with pytest.raises(gradstore.NonFiniteGradientError, match="float32's range"):
            writer.append(np.array([[1e39, 0, 0, 0]]), ["huge"])  # float64 beyond float32
        writer.append(np.array([[3e38, 0, 0, 0], [-2e38, 1e38, 0, 0]], np.float32), ["edge", "edge2"])
    block = store.read_gradients("r")
    assert block.metadata.column("example_id").to_pylist() == ["edge", "edge2"]
    assert np.isfinite(block.vectors).all()
    np.testing.assert_allclose(block.vectors, [[3e38, 0, 0, 0], [-2e38, 1e38, 0, 0]], rtol=1e-3)


def test_capture_refuses_a_non_string_checkpoint_or_split_and_keeps_its_rows(store):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    with store.capture(model, "r", projection=None) as cap:
        cap.set_ids(["a", "b"])
        model(torch.randn(2, 3)).sum().backward()
        with pytest.raises(gradstore.InvalidNameError):
            cap.set_checkpoint(7)
        with pytest.raises(gradstore.InvalidArgumentError):
            cap.set_split(123)
        cap.set_ids(["c"])
        model(torch.randn(1, 3)).sum().backward()
    assert sorted(store.read_gradients("r").metadata.column("example_id").to_pylist()) == ["a", "b", "c"]
    assert store.core.default_checkpoint("r") == "train"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "float32"])
def test_rows_of_subnormal_entries_are_stored_as_they_are(store_path, dtype):
    """A finite row whose norm is below ~2.9e-39 (subnormal float32 entries: a confidently fitted example) has a
    unit vector whose float32 scale would be infinite: it is made unit in float64 and stored, not written as inf
    (float16) or zeros (int8)."""
    store = gradstore.open(store_path, storage_dtype=dtype)
    store.create_run("r", dim=40)
    rows = np.random.default_rng(3).normal(size=(3, 40)).astype(np.float32)
    rows[0] = np.sign(rows[0]) * np.float32(1e-40)
    rows[1] *= np.float32(1e-41)
    with store.writer("r") as writer:
        writer.append(rows, ["tiny", "tinier", "plain"], split="train")
    stored = store.read_gradients("r").vectors.astype(np.float64)
    assert np.isfinite(stored).all() and store.verify().ok
    for got, want in zip(stored, rows.astype(np.float64)):  # each row within its encoding's relative error
        assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want)
