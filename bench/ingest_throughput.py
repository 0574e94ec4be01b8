"""W-ingest: the streaming writer vs one bulk Lance write of the same rows, in one run.

Streams 4,096-dim rows in training-sized appends (32 rows per call) through ``GradientWriter`` for 1,500 MB of
stored data by default (W-ingest asks for >= 200 MB; arms that short take under a second and their ratio is
noise), and writes the same float32 rows, encoded in one go, with one ``lance.write_dataset``. Both arms start
from the same float32 rows and end with the same stored bytes. The arms alternate over several rounds (paired);
prints median MB/s of both, the median per-round ratio and the fragment count.
Target: ratio >= 0.9 with a bounded fragment count.

``--writers N`` (e.g. 4) measures instead the aggregate MB/s of N concurrent writer processes (spawned once,
reused every round) against one writer process streaming the same rows (the N shares end to end), paired
and alternated: the N writers share one run, or each writes its own run. Every arm is checked afterwards
(each row present exactly once, sampled vectors equal to what was written); exceptions, lost, duplicated
and wrong rows count as failures. Then the object-store arm: the same single-writer ingest (in this
process) into a store on a local S3-compatible server (moto, started here) against local disk, paired;
its ratio is reported without a target. Target: N writers >= 1.3x one writer (the worse of the shared-run
and own-run medians) with zero failures.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa

import gradstore
from gradstore.core import schema as S
from gradstore.core.vectors import encode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # the tests' local S3 server (moto)
from local_s3 import moto_server, new_bucket


def _warm_up(root: Path, dim: int, dtype: str) -> None:
    """Load Lance, LanceDB and torch's kernels once so that neither arm pays for first use."""
    rows = np.ones((64, dim), np.float32)
    store = gradstore.open(root / "warm-up", storage_dtype=dtype)
    store.create_run("warm-up", dim=dim)
    with store.writer("warm-up") as writer:
        writer.append(rows, [str(i) for i in range(64)])
    lance.write_dataset(pa.table(encode(rows, dtype)), root / "warm-up.lance")


def _stream(
    root: Path | str,
    vectors: np.ndarray,
    ids: list[str],
    dtype: str,
    append_rows: int,
    storage_options: dict[str, str] | None = None,
) -> tuple[float, int, int]:
    """Seconds to stream every row through a fresh store's writer (until all are committed), commits, fragments."""
    store = gradstore.open(root, storage_dtype=dtype, storage_options=storage_options)
    store.create_run("bench", dim=vectors.shape[1])
    start = time.perf_counter()
    with store.writer("bench") as writer:
        for i in range(0, len(ids), append_rows):
            writer.append(vectors[i : i + append_rows], ids[i : i + append_rows], step=i, split="train")
    seconds = time.perf_counter() - start
    return seconds, writer.commits, len(store.core.table(S.GRADIENTS).to_lance().get_fragments())


def _bulk(root: Path, vectors: np.ndarray, ids: list[str], dtype: str) -> tuple[float, float]:
    """Seconds to encode the same rows in one go and write them in one Lance write; and the write alone."""
    n = len(ids)
    start = time.perf_counter()
    table = pa.table(
        {
            "grad_id": np.arange(n),
            "run_id": ["bench"] * n,
            "example_id": ids,
            "step": np.arange(n),
            "split": ["train"] * n,
            **encode(vectors, dtype),
        }
    )
    encoded = time.perf_counter()
    lance.write_dataset(table, root)
    done = time.perf_counter()
    return done - start, done - encoded


def _share(tag: int, rows: int, dim: int) -> np.ndarray:
    """Writer ``tag``'s rows (the same in every arm)."""
    return np.random.default_rng(tag).standard_normal((rows, dim), dtype=np.float32)


def _share_ids(tag: int, rows: int) -> list[str]:
    return [f"w{tag}-{i}" for i in range(rows)]


def _cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _writer_loop(tasks: Any, go: Any, results: Any) -> None:
    """A writer process: for each task, prepare its rows and writer, report ready, wait for go, stream, report."""
    while (task := tasks.get()) is not None:
        uri, run, tags, rows, dim, dtype, append_rows = task
        try:
            vectors = np.concatenate([_share(t, rows, dim) for t in tags])
            ids = [i for t in tags for i in _share_ids(t, rows)]
            writer = gradstore.open(uri, storage_dtype=dtype).writer(run)
        except Exception as error:  # reported as a failure, the parent does not wait for it
            results.put(("failed", repr(error)))
            continue
        results.put(("ready", None))
        go.get()
        try:
            start, cpu = time.monotonic(), _cpu_seconds()
            for i in range(0, len(ids), append_rows):
                writer.append(vectors[i : i + append_rows], ids[i : i + append_rows], step=i, split="train")
            writer.close()
            results.put(("done", (start, time.monotonic(), writer.commits, _cpu_seconds() - cpu)))
        except Exception as error:
            results.put(("failed", repr(error)))


class _Writers:
    """``n`` spawned writer processes, each with its task and go queues, reused across arms."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(n)]
        self.go = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=_writer_loop, args=(t, g, self.results), daemon=True)
            for t, g in zip(self.tasks, self.go)
        ]
        for p in self.procs:
            p.start()

    def run(self, tasks: list[tuple]) -> tuple[float, float, int, list[str]]:
        """Run one task per process (the first ``len(tasks)``), started together: wall seconds from the
        first start to the last commit, CPU seconds of the writers, commits, errors."""
        for queue, task in zip(self.tasks, tasks):
            queue.put(task)
        errors, ready = [], 0
        for _ in tasks:
            kind, value = self.results.get(timeout=600)
            if kind == "ready":
                ready += 1
            else:
                errors.append(value)
        for queue in self.go[:ready]:
            queue.put(True)
        spans, cpu, commits = [], 0.0, 0
        for _ in range(ready):
            kind, value = self.results.get(timeout=600)
            if kind == "done":
                spans.append(value[:2])
                commits += value[2]
                cpu += value[3]
            else:
                errors.append(value)
        seconds = max(e for _, e in spans) - min(s for s, _ in spans) if spans else float("nan")
        return seconds, cpu, commits, errors

    def close(self) -> None:
        for queue in self.tasks:
            queue.put(None)
        for p in self.procs:
            p.join(60)
        errors = [p.exitcode for p in self.procs if p.exitcode != 0]
        if errors:
            raise RuntimeError(f"writer processes exited with {errors}")


def _check(path: Path, n: int, rows: int, dim: int, sample: int = 16) -> list[str]:
    """What is wrong with a store that ``n`` writers of ``rows`` rows each filled: lost, duplicated rows
    (example ids and grad_ids), sampled vectors that differ from what was written."""
    store = gradstore.open(path)
    stored = store.sql("SELECT example_id, grad_id FROM gradients").fetchall()
    ids = [example_id for example_id, _ in stored]
    expected = {i for t in range(n) for i in _share_ids(t, rows)}
    problems = []
    if len(ids) != len(set(ids)) or len({grad_id for _, grad_id in stored}) != len(ids):
        problems.append(f"{len(ids) - len(set(ids))} duplicated rows")
    if expected - set(ids) or set(ids) - expected:
        problems.append(f"{len(expected - set(ids))} lost rows, {len(set(ids) - expected)} unknown rows")
    rng = np.random.default_rng(n)
    for t in range(n):
        picks = sorted(rng.choice(rows, size=min(sample, rows), replace=False).tolist())
        names = [f"w{t}-{i}" for i in picks]
        quoted = ", ".join(f"'{name}'" for name in names)
        block = store.read_gradients(where=f"example_id IN ({quoted})")
        got = dict(zip(block.metadata.column("example_id").to_pylist(), block.vectors))
        want = _share(t, rows, dim)[picks]
        wrong = [
            name
            for name, vector in zip(names, want)
            if name not in got or np.linalg.norm(got[name] - vector) > 1e-2 * np.linalg.norm(vector)
        ]
        if wrong:
            problems.append(f"wrong vectors: {wrong[:3]}")
    return problems


def _writer_arm(writers: _Writers, path: Path, arm: str, n: int, rows: int, args: argparse.Namespace) -> tuple:
    """One arm: "1" (one process writes all ``n`` shares), "shared" (``n`` processes, one run) or "own"
    (``n`` processes, a run each). Returns (seconds, CPU seconds, commits, failures)."""
    store = gradstore.open(path, storage_dtype=args.dtype)
    runs = [f"bench{k}" for k in range(n)] if arm == "own" else ["bench"] * n
    for run in sorted(set(runs)):
        store.create_run(run, dim=args.dim)
    settings = (rows, args.dim, args.dtype, args.append_rows)
    if arm == "1":
        tasks = [(str(path), "bench", list(range(n)), *settings)]
    else:
        tasks = [(str(path), run, [k], *settings) for k, run in enumerate(runs)]
    seconds, cpu, commits, errors = writers.run(tasks)
    failures = errors + _check(path, n, rows, args.dim)
    return seconds, cpu, commits, failures


def _object_store_arm(args: argparse.Namespace, root: Path) -> None:
    """Single-writer ingest into a moto S3 store vs local disk, paired; prints the figures."""
    bytes_per_row = args.dim * (2 if args.dtype == "float16" else 4) + 4
    n = int(args.s3_megabytes * 1e6 / bytes_per_row) // args.append_rows * args.append_rows
    vectors = _share(0, n, args.dim)
    ids = _share_ids(0, n)
    megabytes = n * bytes_per_row / 1e6
    seconds: dict[str, list[float]] = {"s3": [], "local": []}
    with moto_server() as endpoint:
        for round_ in range(args.rounds):
            for arm in ["s3", "local"] if round_ % 2 == 0 else ["local", "s3"]:
                if arm == "s3":
                    bucket = f"bench-{uuid.uuid4().hex[:12]}"
                    options = new_bucket(endpoint, bucket)
                    took, _, _ = _stream(f"s3://{bucket}/store", vectors, ids, args.dtype, args.append_rows, options)
                    assert gradstore.open(f"s3://{bucket}/store", storage_options=options).count() == n
                else:
                    path = root / f"local-{round_}"
                    took, _, _ = _stream(path, vectors, ids, args.dtype, args.append_rows)
                    shutil.rmtree(path, ignore_errors=True)
                seconds[arm].append(took)
    ratios = [local / s3 for s3, local in zip(seconds["s3"], seconds["local"])]
    print(
        f"object store (moto S3 on localhost) vs local disk, one writer, {megabytes:.0f} MB, {args.rounds} paired "
        f"rounds: {megabytes / np.median(seconds['s3']):.1f} vs {megabytes / np.median(seconds['local']):.1f} MB/s; "
        f"per-round ratios {', '.join(f'{r:.2f}' for r in ratios)}; median ratio (no target) {np.median(ratios):.2f}"
    )


def writers_mode(args: argparse.Namespace) -> None:
    """N writer processes vs one, then the object-store arm; ends with the RESULT line."""
    n = args.writers
    bytes_per_row = args.dim * (2 if args.dtype == "float16" else 4) + 4
    rows = int(args.megabytes * 1e6 / bytes_per_row / n) // args.append_rows * args.append_rows
    megabytes = n * rows * bytes_per_row / 1e6
    arms = ["1", "shared", "own"]
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    commits: dict[str, int] = {}
    failures: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="gradstore-bench-writers-"))
    writers = _Writers(n)
    try:
        _warm_up(root, args.dim, args.dtype)
        _writer_arm(writers, root / "warm-up-writers", "shared", n, args.append_rows, args)
        for round_ in range(args.rounds):
            for arm in arms[round_ % 3 :] + arms[: round_ % 3]:  # rotate the order
                path = root / f"{arm}-{round_}"
                took, used, commits[arm], failed = _writer_arm(writers, path, arm, n, rows, args)
                seconds[arm].append(took)
                cpu[arm].append(used)
                failures += [f"{arm} round {round_}: {f}" for f in failed]
                shutil.rmtree(path, ignore_errors=True)
        writers.close()
        print(
            f"{n} writer processes vs 1, {megabytes:.0f} MB in all ({n} x {rows} rows of dim {args.dim}, "
            f"{args.dtype}, appends of {args.append_rows} rows); {args.rounds} rounds, order rotated, medians"
        )
        ratios = {}
        for arm in arms:
            median = float(np.median(seconds[arm]))
            label = {"1": "1 writer", "shared": f"{n} writers, one run", "own": f"{n} writers, a run each"}[arm]
            print(
                f"{label:24s} {megabytes / median:8.1f} MB/s  ({median:.2f} s, {commits[arm]} commits, "
                f"{np.median(cpu[arm]):.2f} CPU s = {np.median(cpu[arm]) / median:.2f} cores busy)"
            )
            if arm != "1":
                ratios[arm] = [one / took for one, took in zip(seconds["1"], seconds[arm])]
                print(f"  per-round ratios vs 1 writer: {', '.join(f'{r:.2f}' for r in ratios[arm])}")
        print(f"failures (exceptions, lost, duplicated or wrong rows): {len(failures)}")
        for failure in failures[:10]:
            print(f"  {failure}")
        if args.s3_megabytes > 0:
            _object_store_arm(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratio = min(float(np.median(r)) for r in ratios.values())
    verdict = "PASS" if ratio >= 1.3 and not failures else "MISS"
    print(f"RESULT ingest_writers{n}_vs_1={ratio:.2f} target>=1.3 {verdict}")


def bulk_mode(args: argparse.Namespace) -> None:
    """The streaming writer vs one bulk Lance write; ends with the RESULT line."""
    bytes_per_row = args.dim * (2 if args.dtype == "float16" else 4) + 4
    n = int(args.megabytes * 1e6 / bytes_per_row) // args.append_rows * args.append_rows
    vectors = np.random.default_rng(0).standard_normal((n, args.dim), dtype=np.float32)
    ids = [f"ex{i}" for i in range(n)]
    megabytes = n * bytes_per_row / 1e6
    root = Path(tempfile.mkdtemp(prefix="gradstore-bench-ingest-"))
    streams, bulks, writes = [], [], []
    try:
        _warm_up(root, args.dim, args.dtype)
        for round_ in range(args.rounds):
            arms = ["stream", "bulk"] if round_ % 2 == 0 else ["bulk", "stream"]
            for arm in arms:
                path = root / f"{arm}-{round_}"
                if arm == "stream":
                    seconds, commits, fragments = _stream(path, vectors, ids, args.dtype, args.append_rows)
                    streams.append(seconds)
                else:
                    seconds, write_only = _bulk(path, vectors, ids, args.dtype)
                    bulks.append(seconds)
                    writes.append(write_only)
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ratios = [b / s for s, b in zip(streams, bulks)]
    ratio = float(np.median(ratios))
    print(
        f"rows {n}  dim {args.dim}  dtype {args.dtype}  {megabytes:.0f} MB  appends of {args.append_rows} rows; "
        f"{args.rounds} paired rounds, medians"
    )
    print(
        f"streaming writer  {megabytes / np.median(streams):8.1f} MB/s  ({np.median(streams):.2f} s, "
        f"{commits} commits, {fragments} fragments at the end)"
    )
    print(
        f"bulk write        {megabytes / np.median(bulks):8.1f} MB/s  ({np.median(bulks):.2f} s, "
        f"of which the Lance write {np.median(writes):.2f} s)"
    )
    print(f"per-round ratios (streaming MB/s / bulk MB/s): {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"streaming vs the bulk Lance write alone (rows pre-encoded): {np.median(writes) / np.median(streams):.2f}")
    verdict = "PASS" if ratio >= 0.9 and fragments <= 64 else "MISS"
    print(f"RESULT ingest_ratio={ratio:.2f} target>=0.9 {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--megabytes",
        type=float,
        default=None,
        help="stored data per arm, all writers together (default 1,500 against the bulk write: 210 MB arms take under"
        " a second each on a fast disk and their ratio is noise; 210 with --writers)",
    )
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--append-rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds (arm order alternates)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    parser.add_argument("--writers", type=int, default=0, help="N: N writer processes vs 1 instead of the bulk arm")
    parser.add_argument("--s3-megabytes", type=float, default=60.0, help="object-store arm size (0: skip it)")
    args = parser.parse_args()
    if args.megabytes is None:
        args.megabytes = 210.0 if args.writers else 1500.0
    if args.writers:
        writers_mode(args)
    else:
        bulk_mode(args)


if __name__ == "__main__":
    main()
