"""gradstore serve under load (issue 30 item 4): W-query rows (float16 storage, top-10), a ``gradstore serve``
process on localhost, clients in this process over Arrow Flight.

- ``serve_batching_speedup``: throughput of ``--clients`` concurrent single-query clients against the server
  (micro-batched into one scoring call per window) over the one-at-a-time in-process loop
  (``store.attribute(q[None], write=False)`` warm, in this process): target >= 8;
- ``serve_exact_p99_vs_inprocess``: warm p99 of one exact lookup through the server over the in-process warm
  p99: target <= 2;
- ``serve_hnsw_p50_ms``: warm p50 of one ``HNSW32,Flat`` lookup through the server: target <= 20 ms;
- ``serve_first_vs_warm``: the first request to a freshly started ``--warm`` server (row file present; the median
  over ``--restarts`` (5) fresh servers) over a
  warm one: target <= 1.2 (the first request to a server started without ``--warm`` is logged beside it);
- ``serve_soak_failed_requests``: ``--soak-clients`` (16) clients mixing attribute, sql and report requests for
  ``--soak-seconds`` (60) while this process appends rows: target 0;
- ``serve_p99_under_abuse_vs_quiet`` (issue 36): ``--abuse-clients`` (64) well-behaved HTTP clients (one-vector
  lookups, a read token) for ``--abuse-seconds``, first alone, then while ``--attackers`` (512) unauthenticated
  connections attack (a third send headers a line at a time, a third ``Content-Length: 100`` and one byte, a third
  announce 50 MB and stream junk; each reconnects ``--abuse-reconnect-s`` after the server drops it): the good
  clients' p99 over their quiet p99, target <= 3; beside it the good clients' non-200 answers (target 0) and the
  server's RSS growth under attack (``serve_abuse_rss_growth_mb``, target <= 256). ``--abuse-only`` runs just this.

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
                   "0", "--batch-window-ms", str(window_ms),
                   # every client of this bench (good and attacking) shares the loopback address
                   "--limit", "max_connections_per_client=4096"]  # fmt: skip
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


def good_clients(url: str, queries: np.ndarray, clients: int, seconds: float, options: dict) -> tuple[list, list]:
    """``clients`` HTTP clients looking up one vector each in a loop for ``seconds``: (latencies, non-200 codes)."""
    import httpx

    latencies: list[float] = []
    refused: list[int] = []
    stop = threading.Event()
    ready = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
            body = {**options, "vectors": queries[c][None].tolist()}
            http.post("/api/attribute", json=body)  # connected and warm
            ready.wait()
            i = c
            while not stop.is_set():
                body = {**options, "vectors": queries[i % len(queries)][None].tolist()}
                start = time.perf_counter()
                try:
                    code = http.post("/api/attribute", json=body).status_code
                except httpx.HTTPError:
                    code = -1
                latencies.append(time.perf_counter() - start)
                if code != 200:
                    refused.append(code)
                i += clients

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    ready.wait()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return latencies, refused


class Attack:
    """``attackers`` unauthenticated connections to ``url`` (asyncio, in a thread of this process): slow headers,
    ``Content-Length: 100`` and one byte, 50 MB announced and junk streamed; each reconnects ``reconnect_s`` after
    the server drops it. ``.connections`` counts the connections made."""

    def __init__(self, url: str, attackers: int, reconnect_s: float) -> None:
        import asyncio
        from urllib.parse import urlsplit

        address = urlsplit(url)
        self.host, self.port = address.hostname, address.port
        self.attackers, self.reconnect_s = attackers, reconnect_s
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    def __enter__(self) -> Attack:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    async def _main(self) -> None:
        import asyncio

        await asyncio.gather(*(self._attacker(i % 3) for i in range(self.attackers)))

    async def _attacker(self, kind: int) -> None:
        import asyncio

        junk = b"[" * 65536
        while not self._stop.is_set():
            writer = None
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                self.connections += 1
                if kind == 0:  # headers a line at a time
                    writer.write(b"POST /api/attribute HTTP/1.1\r\nHost: x\r\n")
                    while not self._stop.is_set():
                        await asyncio.sleep(0.5)
                        writer.write(b"X-Slow: 1\r\n")
                        await writer.drain()
                        if reader.at_eof():
                            break
                elif kind == 1:  # Content-Length: 100 and one byte
                    head = "POST /api/attribute HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
                    writer.write(head.encode())
                    await writer.drain()
                    await reader.read()
                else:  # 50 MB announced, junk streamed as fast as the server takes it
                    writer.write(
                        f"POST /api/attribute HTTP/1.1\r\nHost: x\r\nContent-Length: {50 * 2**20}\r\n\r\n".encode()
                    )
                    for _ in range(800):
                        writer.write(junk)
                        await writer.drain()
            except (OSError, asyncio.TimeoutError):
                pass
            finally:
                if writer is not None:
                    writer.close()
            await asyncio.sleep(self.reconnect_s)


def rss_of(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def abuse(root: Path, queries: np.ndarray, args: argparse.Namespace, options: dict) -> None:
    server = ServerProcess(root, args.window_ms, warm=args.method)
    try:
        log(f"abuse: {args.abuse_clients} good HTTP clients for {args.abuse_seconds} s, quiet")
        quiet, quiet_refused = good_clients(server.http_url, queries, args.abuse_clients, args.abuse_seconds, options)
        rss_quiet = rss_of(server.process.pid)
        log(f"abuse: the same while {args.attackers} unauthenticated connections attack")
        peak = [rss_quiet]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.2):
                peak[0] = max(peak[0], rss_of(server.process.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        with Attack(server.http_url, args.attackers, args.abuse_reconnect_s) as attack:
            time.sleep(2.0)  # every attacker connected
            loud, loud_refused = good_clients(server.http_url, queries, args.abuse_clients, args.abuse_seconds, options)
        sampling.set()
        sampler.join()
    finally:
        server.stop()
    quiet_p99, loud_p99 = percentile(quiet, 99), percentile(loud, 99)
    log(f"abuse: quiet {len(quiet)} lookups, p50 {percentile(quiet, 50) * 1e3:.1f} ms, p99 {quiet_p99 * 1e3:.1f} ms; "
        f"under attack ({attack.connections} attacking connections made) {len(loud)} lookups, "
        f"p50 {percentile(loud, 50) * 1e3:.1f} ms, p99 {loud_p99 * 1e3:.1f} ms; non-200 answers: quiet "
        f"{sorted(set(quiet_refused))} x{len(quiet_refused)}, attacked {sorted(set(loud_refused))} "
        f"x{len(loud_refused)}; "
        f"server RSS {rss_quiet / 2**20:.0f} MB quiet, peak {peak[0] / 2**20:.0f} MB under attack")  # fmt: skip
    print(f"abuse: clients={args.abuse_clients} attackers={args.attackers} seconds={args.abuse_seconds} "
          f"reconnect_s={args.abuse_reconnect_s} cpus={os.cpu_count()}")  # fmt: skip
    result("serve_p99_under_abuse_vs_quiet", loud_p99 / quiet_p99, "<=", 3)
    result("serve_abuse_good_refused", len(quiet_refused) + len(loud_refused), "<=", 0)
    result("serve_abuse_rss_growth_mb", (peak[0] - rss_quiet) / 2**20, "<=", 256)


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
    parser.add_argument("--restarts", type=int, default=5, help="fresh --warm servers whose first request is timed")
    parser.add_argument("--window-ms", type=float, default=0.0)
    parser.add_argument("--method", default="grad-dot")
    parser.add_argument("--soak-clients", type=int, default=16)
    parser.add_argument("--soak-seconds", type=float, default=60.0)
    parser.add_argument("--abuse-clients", type=int, default=64)
    parser.add_argument("--attackers", type=int, default=512)
    parser.add_argument("--abuse-seconds", type=float, default=20.0)
    parser.add_argument("--abuse-reconnect-s", type=float, default=1.0)
    parser.add_argument("--abuse-only", action="store_true", help="only the abuse run (issue 36)")
    args = parser.parse_args()
    options = {"run": RUN, "k": 10, "method": args.method}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        root = Path(tmp) / "store"
        log(f"writing {args.rows} x {args.dim} rows")
        store = write_store(root, args.rows, args.dim)
        queries = np.random.default_rng(1).standard_normal((256, args.dim), dtype=np.float32)
        if args.abuse_only:
            print(f"rows={args.rows} dim={args.dim} method={args.method}")
            abuse(root, queries, args, options)
            return
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
        firsts = []  # --warm: looked up once before serving; the first request of each of --restarts fresh servers
        for restart in range(args.restarts):
            server = ServerProcess(root, args.window_ms, warm=args.method)
            with gradstore.connect(server.flight_uri, token=TOKEN) as remote:
                remote.runs()  # the connection (not the store's first lookup)
                start = time.perf_counter()
                remote.attribute(queries[restart : restart + 1], **options)
                firsts.append(time.perf_counter() - start)
            if restart < args.restarts - 1:
                server.stop()
        first = statistics.median(firsts)
        try:
            with gradstore.connect(server.flight_uri, token=TOKEN) as remote:
                remote.attribute(queries[1:2], **options)
                served = lookups(lambda q: remote.attribute(q, **options), queries, args.lookups)
                remote.attribute(queries[:1], **hnsw_options)
                remote.attribute(queries[1:2], **hnsw_options)
                hnsw = lookups(lambda q: remote.attribute(q, **hnsw_options), queries, args.lookups)
            log(f"served exact: first {first_cold * 1e3:.1f} ms without --warm, {first * 1e3:.1f} ms with (median "
                f"of {args.restarts} restarts: {', '.join(f'{t * 1e3:.1f}' for t in firsts)} ms); "
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
        abuse(root, queries, args, options)
    print(f"rows={args.rows} dim={args.dim} clients={args.clients} cpus={os.cpu_count()} method={args.method}")
    result("serve_batching_speedup", served_qps / loop_qps, ">=", 8)
    result("serve_exact_p99_vs_inprocess", percentile(served, 99) / percentile(in_process, 99), "<=", 2)
    result("serve_hnsw_p50_ms", percentile(hnsw, 50) * 1e3, "<=", 20)
    result("serve_first_vs_warm", first / statistics.median(served), "<=", 1.2)
    result("serve_soak_failed_requests", failed, "<=", 0)


if __name__ == "__main__":
    main()
