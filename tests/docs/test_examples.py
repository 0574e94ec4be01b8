"""The examples in ``examples/`` run end to end (``--quick`` sizes) and show what their docstrings promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.slow


def run_example(name: str, store: Path) -> str:
    """Run ``examples/<name>.py --store STORE --quick`` in a fresh interpreter; its stdout (fails on rc != 0)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--store", str(store), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def number_after(pattern: str, text: str) -> tuple[float, ...]:
    """The numbers captured by ``pattern`` in ``text`` (fails if it does not occur)."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text[-2000:]}"
    return tuple(float(g) for g in match.groups())


def test_plain_pytorch_loop(tmp_path):
    out = run_example("plain_pytorch_loop", tmp_path / "store")
    assert out.count("proponents (rank 1 = most helpful)") == 3
    assert out.count("opponents (rank 1 = most harmful)") == 3
    (share,) = number_after(r"proponents with the query's label: ([\d.]+)", out)
    assert share > 0.5  # chance is 0.25
    import gradstore

    store = gradstore.open(tmp_path / "store", create=False)
    assert store.sql("SELECT count(*) FROM scores").fetchall()[0][0] == 3 * 5 * 2
    assert store.sql("SELECT count(DISTINCT epoch) FROM gradients").fetchall()[0][0] == 3


def test_checkpoint_pass_finds_mislabeled(tmp_path):
    out = run_example("checkpoint_pass", tmp_path / "store")
    top, found, flipped = number_after(r"mislabeled in the top-(\d+) of self-influence: (\d+) of (\d+)", out)
    assert top == flipped
    assert flipped >= 5 and found >= 0.6 * flipped, out[-1500:]
    for method in ("tracin", "fisher"):
        (share,) = number_after(method + r"\s*: \d+ queries x top-5; proponents with the query's label ([\d.]+)", out)
        assert share > 0.6


def test_data_selection_exports(tmp_path):
    import datasets
    import pyarrow.parquet as pq

    out = run_example("data_selection", tmp_path / "store")
    selection = pq.read_table(tmp_path / "store-selection.parquet")
    assert selection.num_rows == 30  # ceil(0.1 * 300)
    assert selection.column_names == ["example_id", "score", "rank"]
    selected = datasets.load_from_disk(str(tmp_path / "store-selected-dataset"))
    assert sorted(selected["example_id"]) == sorted(selection.column("example_id").to_pylist())
    (base,) = number_after(r"'code' is ([\d.]+) of the", out)
    (share,) = number_after(r"preconditioner='grad-dot'\): 30 examples, 'code' share ([\d.]+)", out)
    assert share > max(0.8, 2 * base)


def test_sql_questions(tmp_path):
    out = run_example("sql_questions", tmp_path / "store")
    for title in (
        "top_proponents",
        "top_opponents",
        "influential_examples",
        "influence_by('source')",
        "influence_by('label')",
        "most_self_influential",
        "custom:",
    ):
        assert f"-- {title}" in out
    assert "shape: (" in out  # a polars frame was printed
    import gradstore

    store = gradstore.open(tmp_path / "store", create=False)
    assert store.sql("SELECT count(*) FROM scores").fetchall()[0][0] == 30 * 5 * 2
    flagged = store.sql("SELECT avg(mislabeled::INT) FROM most_self_influential(8)").fetchall()[0][0]
    assert flagged >= 0.5  # 5% of the labels were flipped


def test_train_lora_captures_adapters_and_attributes(tmp_path):
    out = run_example("train_lora", tmp_path / "store")
    assert "all LoRA adapters: True" in out
    found, total = number_after(r"top-1 proponent is the repeated training document: (\d+) of (\d+)", out)
    assert found == total == 3
    import gradstore

    store = gradstore.open(tmp_path / "store", create=False)
    assert store.sql("SELECT count(*) FROM gradients WHERE split = 'train'").fetchall()[0][0] == 32 * 2 + 32


def test_vision_cnn_captures_convolutions(tmp_path):
    out = run_example("vision_cnn", tmp_path / "store")
    assert out.count("proponents (rank 1 = most helpful)") == 4
    (share,) = number_after(r"proponents with the query's label: ([\d.]+)", out)
    assert share > 0.5  # chance is 0.10
    import gradstore

    store = gradstore.open(tmp_path / "store", create=False)
    coverage = store.info()["coverage"]["digits-cnn"]
    assert coverage["fraction"] == 1.0 and coverage["not_captured"] == []
    assert len(coverage["captured"]) == 6  # both convolutions and the head, weights and biases
    assert store.dim == 10 * 8 + 16 * 16 + 16 * 10  # factorized 16 x 16, capped at each slot's sides
