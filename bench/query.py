"""W-query (large variant): top-10 inner-product search over 200,000 x 4,096 stored rows, 64 queries.

Arms, measured in one process: the exact index (float32 rows, and the store's default float16 unit rows),
plain ``torch.topk(X @ Q.T)``, plain numpy ``X @ Q.T`` + ``argpartition``, reading the vectors once, FAISS
``Flat``, and one IVF index at two nprobe settings (recall@10 against exact). The exact/torch/numpy/read
arms alternate step by step (paired) for ``--steps`` steps after a warm-up; medians are reported.
Ends with ``RESULT exact_vs_torch=<ratio> target<=1.2 PASS|MISS``. Needs ``faiss`` (``gradstore[bench]``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from indexers import ExactIndex, FaissIndex, blocks_from_arrays, default_nprobe, recall_at_k, require_faiss

K = 10
EXACT, TORCH, READ = "exact index (float32 rows)", "torch.topk(X @ Q.T)", "read vectors once (torch sum)"
Row = tuple[float, float | None, str]
"""(median seconds, recall@K against exact or None, note)"""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def standard_normal(rows: int, dim: int, seed: int, chunk: int = 16384) -> np.ndarray:
    """float32 standard normal rows from one torch generator, filled chunk by chunk (no float64 copy)."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, dim, dtype=torch.float32)
    for start in range(0, rows, chunk):
        out[start : start + chunk] = torch.randn(min(chunk, rows - start), dim, generator=generator)
    return out.numpy()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def numpy_top_k(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    scores = x @ q.T
    top = np.argpartition(-scores, K, axis=0)[:K]
    order = np.argsort(-np.take_along_axis(scores, top, 0), axis=0)
    return np.take_along_axis(top, order, 0).T


def paired_arms(x: np.ndarray, q: np.ndarray, steps: int) -> tuple[dict[str, Row], np.ndarray]:
    """Exact (float32, float16 store layout), torch, numpy and read-once arms, alternated step by step."""
    ids = np.arange(len(x), dtype=np.int64)
    norms = np.linalg.norm(x, axis=1).astype(np.float32)
    unit16 = (x / norms[:, None]).astype(np.float16)  # the store's default: float16 unit rows + float32 norm

    def store_rows() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        yield ids, unit16, norms  # a VectorBlocks block with scales

    xt, qt = torch.from_numpy(x), torch.from_numpy(q)
    exact = ExactIndex(device="cpu")
    arms: dict[str, Callable[[], object]] = {
        EXACT: lambda: exact.search(q, (ids, x), K),
        "exact index (float16 unit rows x norm)": lambda: exact.search(q, store_rows, K),
        TORCH: lambda: torch.topk(xt @ qt.T, K, dim=0),
        "numpy X @ Q.T + argpartition": lambda: numpy_top_k(x, q),
        READ: lambda: xt.sum(),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    log(f"paired arms: 1 warm-up + {steps} steps")
    for step in range(steps + 1):
        names = list(arms)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            elapsed, _ = timed(arms[name])
            if step:
                times[name].append(elapsed)
    _, exact_ids = exact.search(q, (ids, x), K)
    found = {
        "exact index (float16 unit rows x norm)": exact.search(q, store_rows, K)[1],
        TORCH: torch.topk(xt @ qt.T, K, dim=0).indices.T.numpy(),
        "numpy X @ Q.T + argpartition": numpy_top_k(x, q),
    }
    rows = {
        name: (statistics.median(values), recall_at_k(found[name], exact_ids) if name in found else None, "")
        for name, values in times.items()
    }
    return rows, exact_ids


def faiss_arms(
    x: np.ndarray, q: np.ndarray, exact_ids: np.ndarray, args: argparse.Namespace
) -> dict[str, Row]:
    """FAISS Flat, then one IVF index searched at two nprobe settings (recall against exact)."""
    ids = np.arange(len(x), dtype=np.int64)
    rows: dict[str, Row] = {}
    log("FAISS Flat")
    flat = FaissIndex("Flat", args.dim)
    build, _ = timed(lambda: flat.add(ids, x))
    rows["FAISS Flat"] = searched(flat, q, exact_ids, args.faiss_steps, f"build {build:.1f} s")
    flat = None  # free its copy of the rows before building the IVF index
    log(f"FAISS IVF{args.nlist},Flat: training on {args.train_sample} random rows")
    source = blocks_from_arrays(ids, x)
    ivf = FaissIndex(f"IVF{args.nlist},Flat", args.dim)
    train, _ = timed(lambda: ivf.train(source, sample_size=args.train_sample))
    add, _ = timed(lambda: ivf.add_from(source))
    for nprobe in args.nprobes:
        ivf.nprobe = nprobe
        note = f"train {train:.0f} s, add {add:.0f} s" + (
            " (default nprobe)" if nprobe == default_nprobe(args.nlist) else ""
        )
        rows[f"FAISS IVF{args.nlist},Flat nprobe={nprobe}"] = searched(
            ivf, q, exact_ids, args.faiss_steps, note
        )
    return rows


def searched(index: FaissIndex, q: np.ndarray, exact_ids: np.ndarray, steps: int, note: str) -> Row:
    """Median search time over ``steps`` searches, recall@K against exact, and a note."""
    times, found = [], None
    for _ in range(steps):
        elapsed, (_, found) = timed(lambda: index.search(q, K))
        times.append(elapsed)
    return statistics.median(times), recall_at_k(found, exact_ids), note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--faiss-steps", type=int, default=3)
    parser.add_argument("--nlist", type=int, default=512)
    parser.add_argument("--nprobes", type=int, nargs=2, default=[16, 64])
    parser.add_argument("--train-sample", type=int, default=25_000)
    args = parser.parse_args()
    faiss = require_faiss()
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)

    log(f"generating {args.rows} x {args.dim} float32 rows")
    x = standard_normal(args.rows, args.dim, seed=0)
    q = standard_normal(args.queries, args.dim, seed=1)
    rows, exact_ids = paired_arms(x, q, args.steps)
    rows.update(faiss_arms(x, q, exact_ids, args))

    torch_s, exact_s, read_s = rows[TORCH][0], rows[EXACT][0], rows[READ][0]
    print(
        f"W-query large: {args.rows} x {args.dim} float32 N(0,1), {args.queries} queries, top-{K}, "
        f"2 threads; medians of {args.steps} paired steps (FAISS: {args.faiss_steps} steps)"
    )
    print(f"| arm | median s | vs torch | recall@{K} | notes |")
    print("|---|---:|---:|---:|---|")
    for name, (seconds, recall, note) in rows.items():
        recall_text = "1.000 (reference)" if name == EXACT else "-" if recall is None else f"{recall:.3f}"
        print(f"| {name} | {seconds:.3f} | {seconds / torch_s:.2f}x | {recall_text} | {note} |")
    gflops = 2 * args.rows * args.dim * args.queries / exact_s / 1e9
    print(f"exact / read-once = {exact_s / read_s:.2f}x; exact throughput {gflops:.0f} GFLOP/s")
    ratio = exact_s / torch_s
    print(f"RESULT exact_vs_torch={ratio:.3f} target<=1.2 {'PASS' if ratio <= 1.2 else 'MISS'}")


if __name__ == "__main__":
    main()
