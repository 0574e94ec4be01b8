"""Shared by the fault-injection and soak tests and their child jobs (``tests/jobs/store_job.py``).

Rows are derived from their ids, so a test can tell exactly what a stored row must hold: example id
``"<tag>-<n>"`` of run ``run`` has ``step = n`` and a vector drawn from a generator seeded by
``"<run>/<tag>-<n>"``. A job reports what it did as lines appended to a progress file; an ``ack`` line
(``ack STORE RUN TAG START COUNT``) is written only after ``writer.flush()`` returned for those rows, so it
names rows the store has acknowledged. :class:`Zygote` starts jobs as forks of one process that has
imported gradstore once (an import costs seconds; a fork milliseconds), so many trials fit a CI run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gradstore
from gradstore.core.vectors import decode, encode

DIM = 16
CHECKPOINT = "c0"
JOB = Path(__file__).parents[1] / "jobs" / "store_job.py"


def job_environment() -> dict[str, str]:
    """The environment of a child job: this checkout, then ``tests/support`` (this module), first on ``PYTHONPATH``."""
    first = [str(JOB.parents[2]), str(Path(__file__).parent)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*first, os.environ.get("PYTHONPATH", "")])}


def example_ids(tag: str, start: int, count: int) -> list[str]:
    """Ids ``<tag>-<start>`` ... ``<tag>-<start + count - 1>``."""
    return [f"{tag}-{n}" for n in range(start, start + count)]


def step_of(example_id: str) -> int:
    """The ``n`` of ``<tag>-<n>`` (every row is written with ``step = n``)."""
    return int(example_id.rsplit("-", 1)[1])


def vectors_for(run: str, ids: Sequence[str]) -> np.ndarray:
    """The float32 vectors ``[len(ids), DIM]`` rows ``ids`` of ``run`` are written with."""
    rows = [np.random.default_rng(zlib.crc32(f"{run}/{i}".encode())).standard_normal(DIM) for i in ids]
    return np.array(rows, dtype=np.float32).reshape(len(ids), DIM)


def as_stored(vectors: np.ndarray, storage_dtype: str) -> np.ndarray:
    """What reading ``vectors`` back from a store of ``storage_dtype`` returns (exactly)."""
    return decode(encode(vectors, storage_dtype), storage_dtype)


class Progress:
    """Append-only progress lines of one job (each line one ``write``, so a kill never splits it)."""

    def __init__(self, path: str | Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, *parts: object) -> None:
        """Write one line of space-separated ``parts``."""
        os.write(self.fd, (" ".join(str(p) for p in parts) + "\n").encode())


def progress_lines(path: str | Path) -> list[list[str]]:
    """The complete lines of a progress file, split into words."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [line.split() for line in text.split("\n")[:-1]]


@dataclass
class Acknowledged:
    """What a job's progress lines say the store acknowledged: per store, the rows of each run
    (``{run: set of example ids}``), the example ids added to ``examples``, and whether it was opened."""

    rows: dict[str, dict[str, set[str]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    examples: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    opened: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, path: str | Path) -> Acknowledged:
        """Parse the ``ack``, ``examples`` and ``opened`` lines of a progress file."""
        acknowledged = cls()
        for words in progress_lines(path):
            if words[0] == "ack":
                store, run, tag, start, count = words[1:]
                acknowledged.rows[store][run].update(example_ids(tag, int(start), int(count)))
            elif words[0] == "examples":
                store, tag, start, count = words[1:]
                acknowledged.examples[store].update(example_ids(tag, int(start), int(count)))
            elif words[0] == "opened":
                acknowledged.opened.add(words[1])
        return acknowledged


class Zygote:
    """A child process that imported gradstore and forks a job per request (``tests/jobs/store_job.py``)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(JOB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=job_environment(),
        )
        assert self._reply() == {"ready": True}

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the job server exited ({self.process.wait()})")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def start(self, job: str, log: str | Path, **arguments: object) -> int:
        """Fork a process running ``job(**arguments)`` (stdout and stderr to ``log``); its pid."""
        return self._ask({"do": "start", "job": job, "log": str(log), "arguments": arguments})["pid"]

    def wait(self, pid: int) -> int:
        """Wait for job ``pid`` to end: its exit code (``-9`` after SIGKILL)."""
        return self._ask({"do": "wait", "pid": pid})["status"]

    def close(self) -> None:
        """Stop the server."""
        self.process.stdin.close()
        self.process.wait(60)


def has_ended(pid: int) -> bool:
    """Whether job ``pid`` (a child of the zygote, not of this process) has exited (is a zombie or gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_for_lines(path: str | Path, pid: int, enough: Callable[[list[list[str]]], bool]) -> list[list[str]]:
    """Poll a job's progress file until ``enough(lines)`` holds; fails if the job ends before that."""
    while True:
        lines = progress_lines(path)
        if enough(lines):
            return lines
        if has_ended(pid):
            raise AssertionError(f"job {pid} ended before it got that far; its last progress lines: {lines[-5:]}")
        time.sleep(0.01)


def check_rows(store: gradstore.GradStore, run: str, acknowledged: set[str], storage_dtype: str) -> list[str]:
    """Every acknowledged row of ``run`` is stored exactly once and every stored row is whole (vector and
    step as written); returns the stored example ids."""
    block = store.read_gradients(run, columns=("example_id", "step", "checkpoint", "split"))
    ids = block.metadata.column("example_id").to_pylist()
    assert len(ids) == len(set(ids)), f"run {run}: duplicated rows"
    assert len(np.unique(block.grad_ids)) == len(ids), f"run {run}: duplicated grad_ids"
    missing = acknowledged - set(ids)
    assert not missing, f"run {run}: acknowledged rows lost: {sorted(missing)[:5]} ({len(missing)})"
    np.testing.assert_array_equal(block.vectors, as_stored(vectors_for(run, ids), storage_dtype))
    assert block.metadata.column("step").to_pylist() == [step_of(i) for i in ids]
    assert set(block.metadata.column("checkpoint").to_pylist()) <= {CHECKPOINT}
    assert set(block.metadata.column("split").to_pylist()) <= {"train"}
    return ids


def check_queries(store: gradstore.GradStore, stored: dict[str, list[str]]) -> None:
    """SQL counts match the rows read, and attribution finds a stored row as its own top proponent."""
    counts = dict(
        store.sql("select run_id, count(*) from gradients group by run_id").fetchall() if stored else [],
    )
    assert counts == {run: len(ids) for run, ids in stored.items() if ids}
    for run, ids in stored.items():
        if ids:
            probe = ids[len(ids) // 2]
            top = store.attribute(vectors_for(run, [probe]), run=run, checkpoint=CHECKPOINT, k=1, method="cosine")
            assert top.column("example_id").to_pylist() == [probe]


def append_more(store: gradstore.GradStore, run: str, storage_dtype: str, rows: int = 3) -> None:
    """A new writer appends to ``run``: its rows are all there afterwards, once."""
    before = check_rows(store, run, set(), storage_dtype)
    fresh = example_ids("after", 0, rows)
    with store.writer(run) as writer:
        writer.append(vectors_for(run, fresh), fresh, checkpoint=CHECKPOINT, split="train", step=np.arange(rows))
    after = check_rows(store, run, set(fresh), storage_dtype)
    assert sorted(after) == sorted(before + fresh)
