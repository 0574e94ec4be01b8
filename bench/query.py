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
from collections.abc import Callable

import numpy as np
import torch

from indexers import ExactIndex, FaissIndex, blocks_from_arrays, recall_at_k, require_faiss

K = 10


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
    ids = np.arange(args.rows, dtype=np.int64)
    norms = np.linalg.norm(x, axis=1).astype(np.float32)
    x16 = (x / norms[:, None]).astype(np.float16)  # the store's default: float16 unit rows + float32 norm
    store_rows = lambda: iter([(ids, x16, norms)])  # noqa: E731  (a VectorBlocks with scales)
    xt, qt = torch.from_numpy(x), torch.from_numpy(q)
    exact = ExactIndex(device="cpu")

    arms: dict[str, Callable[[], object]] = {
        "exact index (float32 rows)": lambda: exact.search(q, (ids, x), K),
        "exact index (float16 unit rows x norm)": lambda: exact.search(q, store_rows, K),
        "torch.topk(X @ Q.T)": lambda: torch.topk(xt @ qt.T, K, dim=0),
        "numpy X @ Q.T + argpartition": lambda: numpy_top_k(x, q),
        "read vectors once (torch sum)": lambda: xt.sum(),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    log(f"paired arms: 1 warm-up + {args.steps} steps")
    for step in range(args.steps + 1):
        names = list(arms)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            elapsed, _ = timed(arms[name])
            if step:
                times[name].append(elapsed)
    _, exact_ids = exact.search(q, (ids, x), K)
    torch_ids = torch.topk(xt @ qt.T, K, dim=0).indices.T.numpy()
    numpy_ids = numpy_top_k(x, q)
    _, store_ids = exact.search(q, store_rows, K)
    del x16, store_rows
    rows = {name: (statistics.median(values), None, "") for name, values in times.items()}
    rows["torch.topk(X @ Q.T)"] = (*rows["torch.topk(X @ Q.T)"][:1], recall_at_k(torch_ids, exact_ids), "")
    rows["numpy X @ Q.T + argpartition"] = (rows["numpy X @ Q.T + argpartition"][0],
                                            recall_at_k(numpy_ids, exact_ids), "")
    rows["exact index (float16 unit rows x norm)"] = (rows["exact index (float16 unit rows x norm)"][0],
                                                      recall_at_k(store_ids, exact_ids), "float16 rounding")

    log("FAISS Flat")
    flat = FaissIndex("Flat", args.dim)
    build, _ = timed(lambda: flat.add(ids, x))
    flat_times = []
    for _ in range(args.faiss_steps):
        elapsed, (_, flat_ids) = timed(lambda: flat.search(q, K))
        flat_times.append(elapsed)
    rows["FAISS Flat"] = (statistics.median(flat_times), recall_at_k(flat_ids, exact_ids), f"build {build:.1f} s")
    del flat

    log(f"FAISS IVF{args.nlist},Flat: training on {args.train_sample} random rows")
    source = blocks_from_arrays(ids, x)
    ivf = FaissIndex(f"IVF{args.nlist},Flat", args.dim)
    train, _ = timed(lambda: ivf.train(source, sample_size=args.train_sample))
    add, _ = timed(lambda: ivf.add_from(source))
    for nprobe in args.nprobes:
        ivf.nprobe = nprobe
        ivf_times = []
        for _ in range(args.faiss_steps):
            elapsed, (_, ivf_ids) = timed(lambda: ivf.search(q, K))
            ivf_times.append(elapsed)
        rows[f"FAISS IVF{args.nlist},Flat nprobe={nprobe}"] = (
            statistics.median(ivf_times), recall_at_k(ivf_ids, exact_ids), f"train {train:.0f} s, add {add:.0f} s")

    torch_s = rows["torch.topk(X @ Q.T)"][0]
    exact_s = rows["exact index (float32 rows)"][0]
    print(f"W-query large: {args.rows} x {args.dim} float32 N(0,1), {args.queries} queries, top-{K}, "
          f"2 threads; medians of {args.steps} paired steps (FAISS: {args.faiss_steps} steps)")
    print(f"| arm | median s | vs torch | recall@{K} | notes |")
    print("|---|---:|---:|---:|---|")
    for name, (seconds, recall, note) in rows.items():
        recall_text = "1.000 (reference)" if name.startswith("exact index (float32") else (
            "-" if recall is None else f"{recall:.3f}")
        print(f"| {name} | {seconds:.3f} | {seconds / torch_s:.2f}x | {recall_text} | {note} |")
    read_s = rows["read vectors once (torch sum)"][0]
    gflops = 2 * args.rows * args.dim * args.queries / exact_s / 1e9
    print(f"exact / read-once = {exact_s / read_s:.2f}x; exact throughput {gflops:.0f} GFLOP/s")
    ratio = exact_s / torch_s
    print(f"RESULT exact_vs_torch={ratio:.3f} target<=1.2 {'PASS' if ratio <= 1.2 else 'MISS'}")


if __name__ == "__main__":
    main()
