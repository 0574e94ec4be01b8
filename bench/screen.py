"""The exact kernel's bf16 screen on rows it prunes well and on rows it cannot prune: paired against torch fp32.

The bf16 screen (:mod:`indexers.screening`) rescores in float32 only the rows whose error bound reaches some
query's top-k. On N(0,1) rows few do; on tightly clustered rows (each query's top-k among hundreds of its
cluster's rows, all within the screen's error of each other) most rows of a block do, and rescoring them by
gathering cost 3.2x a plain float32 scan before :data:`indexers.screening.DENSE_SHARE` (past it, every row of the
block is scored in float32 as stored). Arms, alternated step by step (order rotating) after a warm-up, prepared
float16 unit rows + norms (the store's default encoding, as the row cache holds them), 64 queries, top-10:

- ``torch fp32``: ``torch.topk(X @ Q.T)`` over the decoded float32 rows;
- ``store kernel``: :class:`indexers.ExactIndex` (``kernel="auto"``: bf16 on a CPU with native bf16 matmul) over
  the prepared rows;

for ``gauss`` rows (N(0,1)) and ``clustered`` rows (64 centres of norm ~8 sqrt(d) plus N(0, 3^2) noise per
entry; queries are centres plus the same noise). Results are checked equal to the float32 kernel's. The last line
is ``RESULT screen_worst_vs_torch_fp32=<x> target<=1.2 PASS|MISS``: the larger median paired ratio of the two
row kinds (the screen must never cost much more than the scan it replaces).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gradstore.core.vectors import encode_rows
from indexers import ExactIndex

TARGET = 1.2


def rows_of(kind: str, n: int, d: int, q: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows [n, d], queries [q, d])`` float32 of one kind."""
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        return rng.standard_normal((n, d), np.float32), rng.standard_normal((q, d), np.float32)
    centres = rng.standard_normal((64, 64), np.float32) @ rng.standard_normal((64, d), np.float32)
    rows = centres[rng.integers(0, 64, n)] + 3 * rng.standard_normal((n, d), np.float32)
    queries = centres[rng.integers(0, 64, q)] + 3 * rng.standard_normal((q, d), np.float32)
    return rows, queries


def paired(kind: str, args: argparse.Namespace) -> float:
    """Median paired ratio store kernel / torch fp32 on rows of ``kind``; prints both arms' medians."""
    rows, queries = rows_of(kind, args.rows, args.dims, args.queries, args.seed)
    values, norms = encode_rows(rows, "float16")
    stored = torch.from_numpy(values)
    decoded = stored.to(torch.float32).mul_(torch.from_numpy(norms.astype(np.float32))[:, None])
    q = torch.from_numpy(queries)
    ids = np.arange(len(rows), dtype=np.int64)
    index = ExactIndex(device="cpu")
    prepared = index.prepare(ids, stored, norms.astype(np.float32))
    found = index.search(q, prepared, args.k)[1]
    expected = ExactIndex(device="cpu", kernel="float32").search(q, (ids, decoded), args.k)[1]
    assert np.array_equal(found, expected), "the store kernel's top-k differs from the float32 kernel's"
    arms = {
        "torch fp32": lambda: torch.topk(decoded @ q.T, args.k, dim=0),
        "store kernel": lambda: index.search(q, prepared, args.k),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for arm in arms.values():  # warm-up
        arm()
    for step in range(args.steps):
        names = list(arms)
        for name in names[step % 2 :] + names[: step % 2]:
            start = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - start)
    ratio = statistics.median(s / t for s, t in zip(times["store kernel"], times["torch fp32"], strict=True))
    medians = ", ".join(f"{name} {statistics.median(t):.3f} s" for name, t in times.items())
    print(f"{kind}: {medians}; store kernel ({index.kernel}) / torch fp32 = {ratio:.3f} (median paired)")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--dims", type=int, default=4_096)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--steps", type=int, default=7, help="paired steps per row kind")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.rows} x {args.dims} float16 unit rows, {args.queries} queries, top-{args.k}, {args.threads} threads")
    worst = max(paired(kind, args) for kind in ("gauss", "clustered"))
    print(f"RESULT screen_worst_vs_torch_fp32={worst:.3f} target<={TARGET} {'PASS' if worst <= TARGET else 'MISS'}")


if __name__ == "__main__":
    main()
