"""Store workloads for tests/core/test_fault_injection.py and tests/core/test_soak.py, run as forked child processes.

Run as a script it is a job server: it imports gradstore once, answers ``{"ready": true}`` and then reads
JSON requests on stdin, one per line: ``{"do": "start", "job": NAME, "log": PATH, "arguments": {...}}``
forks a process running ``JOBS[NAME](**arguments)`` with stdout and stderr to ``PATH`` and answers its
``pid``; ``{"do": "wait", "pid": PID}`` waits for it and answers its exit ``status``. A job that raises
writes ``failed`` to its progress file and exits 1.

Every job writes progress lines (see :mod:`store_workload`): ``opened STORE`` once a store is open,
``ack STORE RUN TAG START COUNT`` once rows are flushed, ``examples STORE TAG START COUNT`` once examples
are upserted, ``op NAME`` before an operation, ``read N`` after a reader's N-th pass.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
from store_workload import CHECKPOINT, DIM, Progress, as_stored, example_ids, step_of, vectors_for

import gradstore

# ------------------------------------------------------------------ writing acknowledged rows


class AckingWriter:
    """A writer of one run whose rows are ``<tag>-<n>`` for n = 0, 1, ...; ``flush`` acknowledges them."""

    def __init__(self, store: gradstore.GradStore, name: str, run: str, tag: str, progress: Progress, **config) -> None:
        self.writer = store.writer(run, **config)
        self.name, self.run, self.tag, self.progress = name, run, tag, progress
        self.next = 0
        self.pending: list[tuple[int, int]] = []

    def append(self, count: int) -> tuple[int, int]:
        """Append ``count`` new rows; their ``(start, count)``."""
        ids = example_ids(self.tag, self.next, count)
        steps = np.arange(self.next, self.next + count)
        self.writer.append(vectors_for(self.run, ids), ids, checkpoint=CHECKPOINT, split="train", step=steps)
        self.pending.append((self.next, count))
        self.next += count
        return self.pending[-1]

    def flush(self) -> None:
        """Flush, then acknowledge every row appended since the last flush."""
        self.writer.flush()
        for start, count in self.pending:
            self.progress.line("ack", self.name, self.run, self.tag, start, count)
        self.pending = []

    def close(self) -> None:
        """Close the writer (nothing is pending after a flush)."""
        self.writer.close()


def _open(root: str, name: str, storage_dtype: str, progress: Progress) -> gradstore.GradStore:
    store = gradstore.open(Path(root) / name, create=True, storage_dtype=storage_dtype)
    progress.line("opened", name)
    return store


# ------------------------------------------------------------------ fault-injection workloads (run until killed)


def create(root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str) -> None:
    """Create store after store: open, create a run, write and flush a few rows."""
    for i in itertools.count():
        store = _open(root, f"s{i}", storage_dtype, progress)
        store.create_run("r", dim=DIM)
        writer = AckingWriter(store, f"s{i}", "r", "w", progress)
        writer.append(int(rng.integers(1, 20)))
        writer.flush()
        writer.close()


def append(root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str) -> None:
    """Stream small batches through a writer with small commits, flushing now and then (the writer's own
    compaction runs often)."""
    store = _open(root, "s0", storage_dtype, progress)
    store.create_run("a", dim=DIM, exist_ok=True)
    config = {"commit_rows": int(rng.integers(8, 64)), "max_fragments": int(rng.integers(2, 6))}
    writer = AckingWriter(store, "s0", "a", "w", progress, **config)
    while True:
        writer.append(int(rng.integers(1, 50)))
        if rng.random() < 0.3:
            writer.flush()


def commit(root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str) -> None:
    """Large commits to three runs in turn, each followed by a checkpoint record and an examples upsert
    (some ids again, some new)."""
    store = _open(root, "s0", storage_dtype, progress)
    writers: dict[str, AckingWriter] = {}
    for i in itertools.count():
        run = f"r{i % 3}"
        progress.line("op", "create_run")
        store.create_run(run, dim=DIM, exist_ok=True)
        if run not in writers:
            writers[run] = AckingWriter(store, "s0", run, f"x{run}", progress, commit_rows=1 << 20, max_fragments=0)
        start, count = writers[run].append(int(rng.integers(500, 3000)))
        progress.line("op", "commit")
        writers[run].flush()
        progress.line("op", "checkpoint")
        store.record_checkpoint(run, CHECKPOINT, step=i)
        progress.line("op", "examples")
        first = max(0, start - count // 2)  # half of them again
        ids = example_ids(f"x{run}", first, start + count - first)
        store.add_examples([{"example_id": e, "text": f"{run} {e}"} for e in ids])
        progress.line("examples", "s0", f"x{run}", first, start + count - first)


def compact(root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str) -> None:
    """Many small commits, and every few of them a compaction of the store (some deleting old versions)."""
    store = _open(root, "s0", storage_dtype, progress)
    store.create_run("a", dim=DIM, exist_ok=True)
    writer = AckingWriter(store, "s0", "a", "w", progress, max_fragments=0)
    for i in itertools.count():
        writer.append(int(rng.integers(5, 60)))
        writer.flush()
        if i % 3 == 2:
            cleanup = rng.random() < 0.3
            progress.line("op", "compact-cleanup" if cleanup else "compact")
            store.compact(cleanup_older_than=timedelta(0) if cleanup else None)


def index(root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str) -> None:
    """Rows keep arriving while indexes (exact with a fitted diagonal Fisher, FAISS ``Flat``) are built, updated in
    place with the new rows, and attributed with."""
    store = _open(root, "s0", storage_dtype, progress)
    store.create_run("a", dim=DIM, exist_ok=True)
    writer = AckingWriter(store, "s0", "a", "w", progress, max_fragments=4)
    writer.append(200)
    writer.flush()
    operations: list[tuple[str, Callable[[], object]]] = [
        ("build-exact", lambda: store.build_index("a", checkpoint=CHECKPOINT, method="diagonal", name="diagonal")),
        (
            "build-flat",
            lambda: store.build_index("a", checkpoint=CHECKPOINT, kind="Flat", name="flat", method="grad-dot"),
        ),
        (
            "attribute-flat",
            lambda: store.attribute(queries(), run="a", checkpoint=CHECKPOINT, k=3, kind="Flat", method="grad-dot"),
        ),
        ("attribute-exact", lambda: store.attribute(queries(), run="a", checkpoint=CHECKPOINT, k=3, method="diagonal")),
    ]

    def queries() -> np.ndarray:
        return vectors_for("a", example_ids("w", int(rng.integers(0, writer.next)), 2))

    while True:
        for name, operation in operations:
            writer.append(int(rng.integers(20, 80)))
            writer.flush()
            progress.line("op", name)
            operation()


# ------------------------------------------------------------------ soak workloads (run until a stop file exists)


def soak_writer(
    root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str, stop: str, tag: str
) -> None:
    """Append rows ``<tag>-<n>`` to run ``own-<tag>`` and to run ``shared`` in turn, flushing now and then;
    two rounds at least, then until ``stop`` exists."""
    store = gradstore.open(Path(root) / "s0", create=False)
    writers = [AckingWriter(store, "s0", run, tag, progress, commit_rows=64) for run in (f"own-{tag}", "shared")]
    for round_ in itertools.count():
        for writer in writers:
            writer.append(int(rng.integers(1, 40)))
            if rng.random() < 0.5:
                writer.flush()
        if round_ and os.path.exists(stop):
            break
    for writer in writers:
        writer.flush()
        writer.close()


def soak_sql_reader(root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str, stop: str) -> None:
    """SQL over the gradients and scores tables: no run ever holds a duplicated row, and no count ever goes
    down; at least one pass, then until ``stop`` exists."""
    store = gradstore.open(Path(root) / "s0", create=False)
    seen: dict[str, int] = {}
    query = (
        "select run_id, count(*), count(distinct example_id), count(distinct grad_id), "
        "count(*) filter (where step < 0 or grad_norm is null) from gradients group by run_id"
    )
    for passes in itertools.count(1):
        for run, rows, distinct_ids, distinct_grad_ids, bad in store.sql(query).fetchall():
            assert rows == distinct_ids == distinct_grad_ids and bad == 0, (run, rows, distinct_ids, bad)
            assert rows >= seen.get(run, 0), f"run {run}: {rows} rows after {seen[run]}"
            seen[run] = rows
        store.sql("select query_id, count(*) from scores group by query_id").fetchall()
        progress.line("read", passes)
        if os.path.exists(stop):
            return


def soak_vector_reader(root: str, progress: Progress, rng: np.random.Generator, storage_dtype: str, stop: str) -> None:
    """Stream every run's rows (each one whole: vector and step as written; no duplicates; counts never go
    down) and attribute one of them, which must come back as its own top proponent; at least one pass,
    then until ``stop`` exists."""
    store = gradstore.open(Path(root) / "s0", create=False)
    seen: dict[str, int] = {}
    for passes in itertools.count(1):
        for run in store.runs().column("run_id").to_pylist():
            ids: list[str] = []
            for block in store.iter_gradients(run, columns=("example_id", "step"), block_rows=512):
                block_ids = block.metadata.column("example_id").to_pylist()
                np.testing.assert_array_equal(block.vectors, as_stored(vectors_for(run, block_ids), storage_dtype))
                assert block.metadata.column("step").to_pylist() == [step_of(i) for i in block_ids]
                ids.extend(block_ids)
            assert len(ids) == len(set(ids)) and len(ids) >= seen.get(run, 0), run
            seen[run] = len(ids)
            if ids:
                probe = ids[int(rng.integers(len(ids)))]
                top = store.attribute(
                    vectors_for(run, [probe]),
                    run=run,
                    checkpoint=CHECKPOINT,
                    k=1,
                    method="cosine",
                    write=bool(passes % 2),
                )
                assert top.column("example_id").to_pylist() == [probe], (run, probe)
        progress.line("read", passes)
        if os.path.exists(stop):
            return


JOBS: dict[str, Callable[..., None]] = {
    job.__name__: job
    for job in (create, append, commit, compact, index, soak_writer, soak_sql_reader, soak_vector_reader)
}


# ------------------------------------------------------------------ the job server


def _run_job(request: dict) -> None:
    """In a forked child: run the job, then exit (never returns)."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    arguments = dict(request["arguments"])
    progress = Progress(arguments.pop("progress"))
    status = 0
    try:
        rng = np.random.default_rng(arguments.pop("seed"))
        JOBS[request["job"]](progress=progress, rng=rng, **arguments)
    except BaseException:
        traceback.print_exc()
        progress.line("failed")
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve() -> None:
    """Answer start/wait requests on stdin until it closes."""
    warnings.filterwarnings("ignore", message="lancedb fork support")  # nothing runs in this process
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["do"] == "start":
            pid = os.fork()
            if pid == 0:
                _run_job(request)
            print(json.dumps({"pid": pid}), flush=True)
        elif request["do"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
