"""The streaming writer: batching, backpressure, compaction, concurrency and crash safety."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import lance
import numpy as np
import pytest

import gradstore
from gradstore.core import commits
from gradstore.core.writer import GradientWriter, WriterConfig
from gradstore.distributed import FragmentStager


def test_appends_are_committed_in_large_batches(store):
    store.create_run("r", dim=16)
    with store.writer("r", commit_rows=256) as writer:
        for i in range(40):
            writer.append(np.ones((32, 16)), [f"{i}-{j}" for j in range(32)])
        assert writer.commits <= 40 * 32 // 256  # at most one commit per 256 rows so far
    assert writer.commits == 5 and writer.rows_committed == 1280
    assert store.count() == 1280


def test_time_threshold_commits_without_flush(store):
    store.create_run("r", dim=4)
    writer = store.writer("r", commit_seconds=0.2)
    writer.append(np.ones((3, 4)), ["a", "b", "c"])
    deadline = time.monotonic() + 10
    while store.count() < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.count() == 3
    writer.close()


@pytest.mark.parametrize(
    ("thresholds", "message"),
    [
        ({"commit_rowz": 5}, r"unknown keyword\(s\) \['commit_rowz'\]: the writer's thresholds are \['commit_rows', "),
        ({"commit_seconds": float("nan")}, "commit_seconds must be a finite number of seconds >= 0"),
        ({"commit_seconds": -5.0}, r"finite number of seconds >= 0 \(0: commit at every append\), got -5.0"),
        ({"commit_seconds": float("inf")}, "pass a large number"),
        ({"commit_seconds": "30"}, "commit_seconds must be a finite number"),
        ({"commit_rows": 2.5}, "commit_rows must be a whole number >= 1, got 2.5"),
        ({"commit_bytes": 0}, "commit_bytes must be a whole number >= 1"),
        ({"max_fragments": -1}, "max_fragments must be a whole number >= 0"),
        ({"max_pending_commits": True}, "max_pending_commits must be a whole number >= 1"),
        ({"config": {"commit_rows": 5}}, "config must be a gradstore.WriterConfig"),
    ],
)
def test_a_writer_refuses_thresholds_it_cannot_use(store, thresholds, message):
    """An unknown keyword (a typo) or a threshold no writer can use (NaN or negative seconds) is an
    ``InvalidArgumentError`` naming what to pass, not a ``TypeError`` or a writer that never commits by time."""
    store.create_run("r", dim=4)
    with pytest.raises(gradstore.InvalidArgumentError, match=message):
        store.writer("r", **thresholds)


def test_a_writer_of_commit_seconds_0_commits_every_append(store):
    store.create_run("r", dim=4)
    writer = store.writer("r", commit_seconds=0, commit_rows=np.int64(8))
    writer.append(np.ones((1, 4)), ["a"])
    deadline = time.monotonic() + 10
    while store.count() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.count() == 1  # committed without a flush
    writer.close()


def test_compaction_keeps_fragments_bounded(store):
    store.create_run("r", dim=8)
    config = WriterConfig(commit_rows=10, max_fragments=6)
    with store.writer("r", config) as writer:
        for i in range(100):
            writer.append(np.full((10, 8), i, np.float32), [f"{i}-{j}" for j in range(10)])
    assert writer.compactions >= 1
    assert len(store.core.table("gradients").to_lance().get_fragments()) <= 6
    assert store.count() == 1000
    assert len(set(store.read_gradients().grad_ids.tolist())) == 1000
    assert store.compact()["gradients"] == 1


@pytest.mark.parametrize("path", ["commit", "rank fragments"])
def test_gradients_are_cut_into_files_of_bounded_size(store, monkeypatch, path):
    """A commit of more rows than :func:`commits.file_rows`, and the fragments a rank of a distributed capture
    stages, are written as several data files of at most that many rows (Lance reads a file's vectors into one
    buffer of its size); metadata tables keep Lance's default."""
    store.create_run("r", dim=256)  # float16: 512 bytes a row
    monkeypatch.setattr(commits, "FILE_VECTOR_BYTES", 512 * 300)
    assert commits.file_rows(store.core.table("gradients").schema) == 300
    rows = np.random.default_rng(0).standard_normal((1000, 256)).astype(np.float32)
    config = WriterConfig(commit_rows=1000, max_fragments=0)
    stager = FragmentStager(store.core.gradient_table("r"))
    if path == "commit":
        target = store.writer("r", config)
    else:
        target = GradientWriter(stager, run_id="r", dim=256, storage_dtype=store.storage_dtype, config=config)
    with target as writer:
        writer.append(rows, [f"e{i}" for i in range(1000)])
    assert writer.commits == 1
    if path == "rank fragments":
        staged = stager.take()
        assert [fragment.physical_rows for fragment in staged] == [300, 300, 300, 100]
        dataset = stager.to_lance()
        lance.LanceDataset.commit(dataset, lance.LanceOperation.Append(staged), read_version=dataset.version)
        store.core.table("gradients").checkout_latest()
    sizes = [fragment.count_rows() for fragment in store.core.table("gradients").to_lance().get_fragments()]
    assert sizes == [300, 300, 300, 100]
    assert len(store.core.table("runs").to_lance().get_fragments()) == 1
    block = store.read_gradients(columns=["example_id"])
    assert block.metadata.column("example_id").to_pylist() == [f"e{i}" for i in range(1000)]
    np.testing.assert_allclose(block.vectors, rows, rtol=1e-3, atol=1e-3)


def test_compaction_writes_fragments_of_bounded_size(store, monkeypatch):
    """Compaction merges small fragments up to the byte-bounded target, never into one huge fragment (a scan's
    shards are groups of whole fragments: a huge one would be one task's work alone)."""
    store.create_run("r", dim=256)  # float16: 512 bytes a row
    monkeypatch.setattr(commits, "FILE_VECTOR_BYTES", 512 * 4096)
    assert commits.file_rows(store.core.table("gradients").schema) == 4096
    assert commits.file_rows(store.core.table("runs").schema) is None  # metadata tables: Lance's default
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((20_000, 256)).astype(np.float32)
    with store.writer("r", WriterConfig(commit_rows=1000, max_fragments=0)) as writer:
        for start in range(0, len(rows), 1000):
            writer.append(rows[start : start + 1000], [f"e{i}" for i in range(start, start + 1000)])
    dataset = store.core.table("gradients").to_lance()
    assert len(dataset.get_fragments()) == 20 and commits.small_fragments(dataset) == 20
    store.compact()
    dataset = store.core.table("gradients").to_lance()
    sizes = [fragment.count_rows() for fragment in dataset.get_fragments()]
    assert sum(sizes) == 20_000 and max(sizes) < 2 * 4096 and len(sizes) >= 3  # about the target, not all rows
    assert commits.small_fragments(dataset) <= 1  # only the remainder is under half the target
    block = store.read_gradients(columns=["example_id"])
    stored = dict(zip(block.metadata.column("example_id").to_pylist(), block.vectors))
    assert len(stored) == 20_000
    np.testing.assert_allclose(np.stack([stored[f"e{i}"] for i in range(20_000)]), rows, rtol=2e-3, atol=2e-3)


def test_backpressure_bounds_the_queue(store):
    store.create_run("r", dim=4)
    with store.writer("r", commit_rows=1, max_pending_commits=1) as writer:
        for i in range(20):
            writer.append(np.ones((1, 4)), [str(i)])
            assert writer._queue.qsize() <= 1
    assert store.count() == 20


def test_writers_in_two_processes_never_share_grad_ids(store_path):
    store = gradstore.open(store_path)
    store.create_run("r", dim=4)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_rows, args=(str(store_path), 200, k)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ids = store.read_gradients().grad_ids
    assert len(ids) == 400 and len(set(ids.tolist())) == 400


def _write_rows(path: str, n: int, tag: int) -> None:
    store = gradstore.open(path)
    with store.writer("r", commit_rows=50) as writer:
        for i in range(0, n, 10):
            writer.append(np.full((10, 4), tag, np.float32), [f"{tag}-{i + j}" for j in range(10)])


_WRITER_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, gradstore
    store = gradstore.open(sys.argv[1])
    store.create_run("r", dim=32)
    with store.writer("r", commit_rows=64, max_fragments=4) as writer:
        for i in range(100000):
            rows = np.full((16, 32), i, np.float32)
            writer.append(rows, [f"{i}-{j}" for j in range(16)], step=i)
            if i % 4 == 3:
                writer.flush()
                print(i, flush=True)  # every row of batches 0..i is committed
""")


def test_reader_process_sees_committed_rows_while_writer_runs(store_path):
    gradstore.open(store_path)
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER_SCRIPT, str(store_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        reader = gradstore.open(store_path)
        flushed = int(writer.stdout.readline())  # the writer prints a step once its rows are committed
        first = reader.count()
        assert first >= (flushed + 1) * 16
        while (flushed + 1) * 16 <= first:  # wait (on the pipe, not a clock) for a commit beyond what we saw
            flushed = int(writer.stdout.readline())
        later = reader.count()
        assert later >= (flushed + 1) * 16 > first  # the same reader sees the other process's new commits
    finally:
        writer.kill()
        writer.wait()


def test_sigkill_mid_run_loses_only_unflushed_rows(store_path):
    gradstore.open(store_path)
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER_SCRIPT, str(store_path)], stdout=subprocess.PIPE, text=True
    )
    last_flushed = -1
    while last_flushed < 40:
        last_flushed = int(writer.stdout.readline())
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    store = gradstore.open(store_path)
    frame = store.sql("select example_id, step from gradients").df()
    assert frame.example_id.is_unique
    steps = frame.groupby("step").size()
    assert (steps == 16).all()  # no partial batch (a 16-row append is never split across commits here)
    assert set(range(last_flushed + 1)) <= set(steps.index)  # everything flushed before the kill is present
    block = store.read_gradients(columns=("step",))
    np.testing.assert_allclose(block.vectors[:, 0], block.metadata.column("step").to_numpy(), rtol=1e-3)
    # the store keeps working: append after the crash
    with store.writer("r") as again:
        again.append(np.ones((1, 32)), ["after"])
    assert store.count("gradients", "example_id = 'after'") == 1


def test_appends_larger_than_a_commit_and_uneven_sizes_keep_every_row(store):
    store.create_run("r", dim=3)
    rows = np.arange(3 * 57, dtype=np.float32).reshape(57, 3)
    sizes = [4, 25, 1, 9, 18]  # 25 exceeds commit_rows; 9 overflows a partly filled buffer
    with store.writer("r", commit_rows=10) as writer:
        start = 0
        for size in sizes:
            writer.append(rows[start : start + size], [str(i) for i in range(start, start + size)])
            start += size
    block = store.read_gradients("r")
    order = np.argsort(block.metadata.column("example_id").to_numpy(zero_copy_only=False).astype(int))
    np.testing.assert_allclose(block.vectors[order], rows, rtol=1e-3)


def test_encoding_in_chunks_covers_every_row_in_place():
    from gradstore.core.vectors import ENCODE_CHUNK_VALUES, encode_rows

    dim = 100
    rows = np.random.default_rng(0).standard_normal((3 * (ENCODE_CHUNK_VALUES // dim) + 7, dim)).astype(np.float32)
    rows[5] = 0.0
    values, norms = encode_rows(rows, "float16")
    np.testing.assert_allclose(norms, np.linalg.norm(rows.astype(np.float64), axis=1), rtol=1e-6)
    scale = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0).astype(np.float32)
    np.testing.assert_array_equal(values, (rows * scale[:, None]).astype(np.float16))


def test_buffers_reused_across_commits_keep_every_rows_own_values(store_path):
    store = gradstore.open(store_path, storage_dtype="float32")
    store.create_run("r", dim=64)
    rows = np.random.default_rng(1).standard_normal((3000, 64)).astype(np.float32)
    with store.writer("r", commit_rows=700, max_pending_commits=1) as writer:
        for start in range(0, len(rows), 300):
            writer.append(rows[start : start + 300], [str(i) for i in range(start, start + 300)])
    assert writer.commits == 5
    block = store.read_gradients("r")
    order = np.argsort(block.metadata.column("example_id").to_numpy(zero_copy_only=False).astype(int))
    np.testing.assert_array_equal(block.vectors[order], rows)


def test_a_writer_left_open_commits_its_rows_at_exit_and_says_so(tmp_path):
    """A program that appends rows and exits without closing its writer (the background thread is a daemon) lost
    them silently: they are committed at interpreter exit, with a warning saying to close writers."""
    store = gradstore.open(tmp_path / "store")
    store.create_run("r", dim=8)
    child = textwrap.dedent(
        f"""
        import numpy as np, gradstore
        writer = gradstore.open({str(tmp_path / "store")!r}).writer("r")
        writer.append(np.ones((100, 8), np.float32), [f"a{{i}}" for i in range(100)], split="train")
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "was left open; its last 100 buffered row(s) were committed at exit" in done.stderr
    assert gradstore.open(tmp_path / "store").count() == 100
