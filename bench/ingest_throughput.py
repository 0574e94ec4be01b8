"""W-ingest: the streaming writer vs one bulk Lance write of the same rows, in one run.

Streams 4,096-dim rows in training-sized appends (32 rows per call) through ``GradientWriter`` for at least
200 MB of stored data, then writes the same rows with one ``lance.write_dataset``. Prints MB/s of both,
their ratio and the fragment count at the end. Target: ratio >= 0.9 with a bounded fragment count.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

import gradstore
from gradstore import schema as S
from gradstore.vectors import encode


def _warm_up(root: Path, dim: int, dtype: str) -> None:
    """Load Lance, LanceDB and torch's kernels once so that neither arm pays for first use."""
    rows = np.ones((64, dim), np.float32)
    store = gradstore.open(root / "warm-up", storage_dtype=dtype)
    store.create_run("warm-up", dim=dim)
    with store.writer("warm-up") as writer:
        writer.append(rows, [str(i) for i in range(64)])
    grad, norm = encode(rows, dtype)
    lance.write_dataset(pa.table({"grad": grad, "grad_norm": norm}), root / "warm-up.lance")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=float, default=210.0)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--append-rows", type=int, default=32)
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    args = parser.parse_args()

    bytes_per_row = args.dim * (2 if args.dtype == "float16" else 4) + 4
    n = int(args.megabytes * 1e6 / bytes_per_row) // args.append_rows * args.append_rows
    vectors = np.random.default_rng(0).standard_normal((n, args.dim), dtype=np.float32)
    ids = [f"ex{i}" for i in range(n)]
    megabytes = n * bytes_per_row / 1e6
    root = Path(tempfile.mkdtemp(prefix="gradstore-bench-ingest-"))
    try:
        _warm_up(root, args.dim, args.dtype)
        store = gradstore.open(root / "store", storage_dtype=args.dtype)
        store.create_run("bench", dim=args.dim)
        start = time.perf_counter()
        with store.writer("bench") as writer:
            for i in range(0, n, args.append_rows):
                writer.append(vectors[i:i + args.append_rows], ids[i:i + args.append_rows], step=i, split="train")
        streaming_s = time.perf_counter() - start
        fragments = len(store.table(S.GRADIENTS).to_lance().get_fragments())
        commits = writer.commits

        # bulk arm: the same float32 rows encoded in one go and written in one Lance write
        start = time.perf_counter()
        grad, norm = encode(vectors, args.dtype)
        table = pa.table({"grad_id": np.arange(n), "run_id": ["bench"] * n, "example_id": ids,
                          "step": np.arange(n), "split": ["train"] * n, "grad": grad, "grad_norm": norm})
        encoded_s = time.perf_counter() - start
        lance.write_dataset(table, root / "bulk.lance")
        bulk_s = time.perf_counter() - start
        write_only_s = bulk_s - encoded_s
    finally:
        shutil.rmtree(root, ignore_errors=True)

    streaming, bulk = megabytes / streaming_s, megabytes / bulk_s
    ratio = streaming / bulk
    print(f"rows {n}  dim {args.dim}  dtype {args.dtype}  {megabytes:.0f} MB  appends of {args.append_rows} rows")
    print(f"streaming writer  {streaming:8.1f} MB/s  ({streaming_s:.2f} s, {commits} commits, {fragments} fragments)")
    print(f"bulk write        {bulk:8.1f} MB/s  ({bulk_s:.2f} s: encode {encoded_s:.2f} s"
          f" + write {write_only_s:.2f} s)")
    print(f"streaming / bulk write alone (rows pre-encoded): {write_only_s / streaming_s:.2f}")
    verdict = "PASS" if ratio >= 0.9 and fragments <= 64 else "MISS"
    print(f"RESULT ingest_ratio={ratio:.2f} target>=0.9 {verdict}")


if __name__ == "__main__":
    main()
