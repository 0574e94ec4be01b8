"""SIGKILL at random points of store workloads (tests/jobs/store_job.py): creating stores, appending, committing,
compacting, building and updating indexes. After each kill the store opens, ``verify`` finds nothing
damaged, every acknowledged (flushed) row is stored exactly once, every stored row is whole (its vector
and step are the ones written for its id), SQL and attribution work, indexes rebuild, and a new writer
appends to the same run.

Each trial is seeded (``trial`` picks the workload, its random sizes and the kill point), so a failure
names its seed; where the kill lands in time varies, and no assertion depends on it: the checks use only
what the job acknowledged before it was killed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from store_workload import (
    CHECKPOINT,
    Acknowledged,
    Zygote,
    append_more,
    check_queries,
    check_rows,
    vectors_for,
    wait_for_lines,
)

import gradstore

#: workload -> (progress line counted, range of how many of them to wait for, largest delay after, in s)
WORKLOADS = {
    "create": ("opened", (0, 3), 0.3),
    "append": ("ack", (1, 8), 0.3),
    "commit": ("op", (1, 12), 0.3),
    "compact": ("op", (1, 4), 0.3),
    "index": ("op", (1, 8), 0.6),
}
TRIALS = 50


def _workload(trial: int) -> str:
    return list(WORKLOADS)[trial % len(WORKLOADS)]


@pytest.fixture(scope="module")
def zygote():
    server = Zygote()
    yield server
    server.close()


def _kill_at_random_point(zygote: Zygote, job: str, directory: Path, trial: int, storage_dtype: str) -> Path:
    """Start ``job`` on stores under ``directory/stores``, SIGKILL it at the trial's point; its progress file."""
    counted, (low, high), max_delay = WORKLOADS[job]
    rng = np.random.default_rng(trial)
    progress, log = directory / "progress", directory / "log"
    (directory / "stores").mkdir()
    arguments = {"root": str(directory / "stores"), "progress": str(progress), "seed": trial}
    pid = zygote.start(job, log, storage_dtype=storage_dtype, **arguments)
    after = int(rng.integers(low, high + 1))
    try:
        wait_for_lines(progress, pid, lambda lines: sum(words[0] == counted for words in lines) >= after)
        time.sleep(rng.uniform(0, max_delay))
    except AssertionError as error:
        raise AssertionError(f"{error}\n{log.read_text()}") from None
    finally:
        os.kill(pid, signal.SIGKILL)  # a job that ended on its own stays a zombie (its pid taken) until waited for
        status = zygote.wait(pid)
    assert status == -signal.SIGKILL, f"the job failed before it was killed:\n{log.read_text()}"
    return progress


def _check_indexes(store: gradstore.GradStore, storage_dtype: str) -> None:
    """The FAISS and the diagonal-Fisher index of run ``a`` rebuild (or update) over exactly the stored rows."""
    block = store.read_gradients("a")
    queries = vectors_for("a", ["probe-0", "probe-1"])
    flat = store.build_index("a", checkpoint=CHECKPOINT, kind="Flat", name="flat", method="grad-dot")
    assert flat.manifest["rows"] == len(block) and sorted(flat.indexed_ids) == sorted(block.grad_ids)
    _, found = flat.search(queries, 3)
    expected = block.grad_ids[np.argsort(-(queries @ block.vectors.T), axis=1)[:, :3]]
    np.testing.assert_array_equal(found, expected)
    diagonal = store.build_index("a", checkpoint=CHECKPOINT, method="diagonal", name="diagonal")
    assert diagonal.manifest["rows"] == len(block)
    assert store.index("diagonal").search(queries, 3)[1].shape == (2, 3)
    top = store.attribute(queries, run="a", checkpoint=CHECKPOINT, k=3, kind="Flat", method="grad-dot")
    assert top.num_rows == 6


def _check_store(path: Path, acknowledged: Acknowledged, storage_dtype: str, indexes: bool) -> None:
    name = path.name
    store = gradstore.open(path, create=name not in acknowledged.opened)
    report = store.verify()
    assert report.ok, report.problems
    runs = store.runs().column("run_id").to_pylist()
    assert set(acknowledged.rows[name]) <= set(runs)
    stored = {run: check_rows(store, run, acknowledged.rows[name][run], storage_dtype) for run in runs}
    if store.core.has_table("examples"):
        assert not store.sql("select example_id from examples group by example_id having count(*) > 1").fetchall()
        ids = {row[0] for row in store.sql("select example_id from examples").fetchall()}
        assert acknowledged.examples[name] <= ids
    else:
        assert not acknowledged.examples[name]
    check_queries(store, stored)
    if indexes and stored.get("a"):
        _check_indexes(store, storage_dtype)
    for run in runs:
        append_more(store, run, storage_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS), ids=lambda trial: f"{_workload(trial)}-{trial}")
def test_a_store_killed_at_a_random_point_keeps_every_acknowledged_row(zygote, tmp_path, trial):
    job = _workload(trial)
    storage_dtype = ("float16", "float32")[trial // len(WORKLOADS) % 2]
    progress = _kill_at_random_point(zygote, job, tmp_path, trial, storage_dtype)
    acknowledged = Acknowledged.read(progress)
    stores = sorted((tmp_path / "stores").iterdir())
    assert {path.name for path in stores} >= acknowledged.opened
    for path in stores:
        _check_store(path, acknowledged, storage_dtype, indexes=job == "index")
