"""gradstore serve under load (issue 30 item 4): W-query rows (float16 storage, top-10), a ``gradstore serve``
process on localhost, clients in this process over Arrow Flight.

- ``serve_batching_speedup``: throughput of ``--clients`` concurrent single-query clients against the server
  (micro-batched into one scoring call per window) over the one-at-a-time in-process loop
  (``store.attribute(q[None], write=False)`` warm, in this process): target >= 8;
- ``serve_exact_p99_vs_inprocess``: warm p99 of one exact lookup through the server over the in-process warm
  p99: target <= 2;
- ``serve_hnsw_p50_ms``: warm p50 of one ``HNSW32,Flat`` lookup through the server: target <= 20 ms;
- ``serve_first_vs_warm``: the first request to a freshly started ``--warm`` server (row file present) over a
  warm one: target <= 1.2 (the first request to a server started without ``--warm`` is logged beside it);
- ``serve_soak_failed_requests``: ``--soak-clients`` (16) clients mixing attribute, sql and report requests for
  ``--soak-seconds`` (60) while this process appends rows: target 0.

Default 20,000 x 4,096 rows (under 10 minutes on 2 cores); ``--rows 100000`` is the issue's size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import gradstore
from ingest.projection import LayerSlot, ProjectionSpec

TOKEN = "bench-token-0123456789abcdef"
RUN = "bench"
HNSW = "HNSW32,Flat"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_store(root: Path, rows: int, dim: int) -> gradstore.GradStore:
    store = gradstore.open(root)  # row files where a server finds them too
    spec = ProjectionSpec(0, "none", (LayerSlot("w", "linear", 64, 64, None, None, "exact", 0, dim, False),))
    store.create_run(RUN, dim=dim, projection=spec.to_dict())
    store.record_checkpoint(RUN, "train", step=0)
    generator = torch.Generator().manual_seed(0)
    with store.writer(RUN) as writer:
        for start in range(0, rows, 8192):
            end = min(rows, start + 8192)
            block = torch.randn(end - start, dim, generator=generator).numpy()
            writer.append(block, [f"e{i}" for i in range(start, end)], checkpoint="train", split="train")
    return store


class ServerProcess:
    def __init__(self, store: Path, window_ms: float, warm: str | None = None) -> None:
        env = {**os.environ, "GRADSTORE_TOKENS": TOKEN}
        command = [sys.executable, "-m", "gradstore.cli", "serve", str(store), "--flight-port", "0", "--http-port",
                   "0", "--batch-window-ms", str(window_ms)]  # fmt: skip
        if warm:
            command += ["--warm", warm, "--warm-kinds", f"exact,{HNSW}"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
        self.flight_uri = self.process.stdout.readline().split()[1]
        self.http_url = self.process.stdout.readline().split()[1]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def lookups(call, queries: np.ndarray, n: int) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        call(queries[i % len(queries)][None])
        times.append(time.perf_counter() - start)
    return times


def throughput(uri: str, queries: np.ndarray, clients: int, seconds: float, options: dict) -> float:
    done = [0] * clients
    stop = threading.Event()
    ready = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        with gradstore.connect(uri, token=TOKEN) as remote:
            remote.attribute(queries[c][None], **options)  # connected and warm
            ready.wait()
            i = c
            while not stop.is_set():
                remote.attribute(queries[i % len(queries)][None], **options)
                done[c] += 1
                i += clients

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    start = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - start)


def soak(server: ServerProcess, store: gradstore.GradStore, queries: np.ndarray, clients: int, seconds: float,
         options: dict) -> tuple[int, int, int]:  # fmt: skip
    """``clients`` clients mixing attribute (Flight), sql (Flight) and report (HTTP) requests for ``seconds`` while
    this process appends rows to the store: (requests, failures, versions seen)."""
    import httpx

    stop = threading.Event()
    counts = [0] * clients
    failures: list[BaseException] = []
    versions: set = set()

    def client(c: int) -> None:
        try:
            with gradstore.connect(server.flight_uri, token=TOKEN) as remote, httpx.Client(
                base_url=server.http_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300
            ) as http:  # fmt: skip
                turn = c
                while not stop.is_set():
                    turn += 1
                    if turn % 5 == 0:
                        remote.sql("SELECT split, count(*) FROM gradients GROUP BY split").df()
                    elif turn % 11 == 0:
                        response = http.get("/report", params={"top": 5})
                        if response.status_code != 200:
                            raise RuntimeError(f"report: {response.status_code}")
                    else:
                        remote.attribute(queries[turn % len(queries)][None], **options)
                    versions.add(remote.last_version)
                    counts[c] += 1
        except BaseException as error:
            failures.append(error)

    def writer() -> None:
        generator = np.random.default_rng(9)
        batch = 0
        while not stop.is_set():
            rows = generator.standard_normal((256, queries.shape[1]), dtype=np.float32)
            with store.writer(RUN) as w:
                w.append(rows, [f"new-{batch}-{i}" for i in range(256)], checkpoint="train", split="train")
            batch += 1
            stop.wait(2.0)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)] + [threading.Thread(target=writer)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    for error in failures[:3]:
        log(f"failure: {error!r}")
    return sum(counts), len(failures), len(versions)


def result(name: str, value: float, op: str, target: float) -> None:
    ok = value >= target if op == ">=" else value <= target
    print(f"RESULT {name}={value:.3f} target{op}{target} {'PASS' if ok else 'MISS'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--lookups", type=int, default=100)
    parser.add_argument("--window-ms", type=float, default=0.0)
    parser.add_argument("--method", default="grad-dot")
    parser.add_argument("--soak-clients", type=int, default=16)
    parser.add_argument("--soak-seconds", type=float, default=60.0)
    args = parser.parse_args()
    options = {"run": RUN, "k": 10, "method": args.method}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp) / "store"
        log(f"writing {args.rows} x {args.dim} rows")
        store = write_store(root, args.rows, args.dim)
        queries = np.random.default_rng(1).standard_normal((256, args.dim), dtype=np.float32)
        log("in-process warm loop")

        def local_call(q):
            return store.attribute(q, write=False, **options)

        local_call(queries[:1])
        local_call(queries[:1])
        in_process = lookups(local_call, queries, args.lookups)
        loop_qps = len(in_process) / sum(in_process)
        log(f"in-process: p50 {percentile(in_process, 50) * 1e3:.1f} ms, p99 {percentile(in_process, 99) * 1e3:.1f} "
            f"ms, {loop_qps:.1f} queries/s")  # fmt: skip
        log(f"building {HNSW}")
        store.build_index(RUN, method=args.method, kind=HNSW)
        hnsw_options = {**options, "kind": HNSW}
        store.attribute(queries[:1], write=False, **hnsw_options)

        server = ServerProcess(root, args.window_ms)  # no warm-up: the first request reads the row file
        try:
            with gradstore.connect(server.flight_uri, token=TOKEN) as remote:
                remote.runs()  # the connection (not the store's first lookup)
                start = time.perf_counter()
                remote.attribute(queries[:1], **options)
                first_cold = time.perf_counter() - start
        finally:
            server.stop()
        server = ServerProcess(root, args.window_ms, warm=args.method)  # --warm: looked up once before serving
        try:
            with gradstore.connect(server.flight_uri, token=TOKEN) as remote:
                remote.runs()  # the connection (not the store's first lookup)
                start = time.perf_counter()
                remote.attribute(queries[:1], **options)
                first = time.perf_counter() - start
                remote.attribute(queries[1:2], **options)
                served = lookups(lambda q: remote.attribute(q, **options), queries, args.lookups)
                remote.attribute(queries[:1], **hnsw_options)
                remote.attribute(queries[1:2], **hnsw_options)
                hnsw = lookups(lambda q: remote.attribute(q, **hnsw_options), queries, args.lookups)
            log(f"served exact: first {first_cold * 1e3:.1f} ms without --warm, {first * 1e3:.1f} ms with; "
                f"p50 {percentile(served, 50) * 1e3:.1f} ms, "
                f"p99 {percentile(served, 99) * 1e3:.1f} ms; hnsw p50 {percentile(hnsw, 50) * 1e3:.1f} ms, "
                f"p99 {percentile(hnsw, 99) * 1e3:.1f} ms")  # fmt: skip
            log(f"{args.clients} clients for {args.seconds} s")
            served_qps = throughput(server.flight_uri, queries, args.clients, args.seconds, options)
            log(f"served: {served_qps:.1f} queries/s vs the in-process loop's {loop_qps:.1f}")
            log(f"soak: {args.soak_clients} clients mixing attribute/sql/report for {args.soak_seconds} s, a writer "
                "appending")  # fmt: skip
            requests, failed, seen = soak(server, store, queries, args.soak_clients, args.soak_seconds, options)
            log(f"soak: {requests} requests, {failed} failed, {seen} gradients versions seen")
        finally:
            server.stop()
    print(f"rows={args.rows} dim={args.dim} clients={args.clients} cpus={os.cpu_count()} method={args.method}")
    result("serve_batching_speedup", served_qps / loop_qps, ">=", 8)
    result("serve_exact_p99_vs_inprocess", percentile(served, 99) / percentile(in_process, 99), "<=", 2)
    result("serve_hnsw_p50_ms", percentile(hnsw, 50) * 1e3, "<=", 20)
    result("serve_first_vs_warm", first / statistics.median(served), "<=", 1.2)
    result("serve_soak_failed_requests", failed, "<=", 0)


if __name__ == "__main__":
    main()
