"""W-ingest: the streaming writer vs one bulk Lance write of the same rows, in one run.

Streams 4,096-dim rows in training-sized appends (32 rows per call) through ``GradientWriter`` for at least
200 MB of stored data, and writes the same float32 rows, encoded in one go, with one ``lance.write_dataset``.
Both arms start from the same float32 rows and end with the same stored bytes. The arms alternate over
several rounds (paired); prints median MB/s of both, the median per-round ratio and the fragment count.
Target: ratio >= 0.9 with a bounded fragment count.
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
from gradstore.core import schema as S
from gradstore.core.vectors import encode


def _warm_up(root: Path, dim: int, dtype: str) -> None:
    """Load Lance, LanceDB and torch's kernels once so that neither arm pays for first use."""
    rows = np.ones((64, dim), np.float32)
    store = gradstore.open(root / "warm-up", storage_dtype=dtype)
    store.create_run("warm-up", dim=dim)
    with store.writer("warm-up") as writer:
        writer.append(rows, [str(i) for i in range(64)])
    grad, norm = encode(rows, dtype)
    lance.write_dataset(pa.table({"grad": grad, "grad_norm": norm}), root / "warm-up.lance")


def _stream(root: Path, vectors: np.ndarray, ids: list[str], dtype: str, append_rows: int) -> tuple[float, int, int]:
    """Seconds to stream every row through a fresh store's writer (until all are committed), commits, fragments."""
    store = gradstore.open(root, storage_dtype=dtype)
    store.create_run("bench", dim=vectors.shape[1])
    start = time.perf_counter()
    with store.writer("bench") as writer:
        for i in range(0, len(ids), append_rows):
            writer.append(vectors[i : i + append_rows], ids[i : i + append_rows], step=i, split="train")
    seconds = time.perf_counter() - start
    return seconds, writer.commits, len(store.table(S.GRADIENTS).to_lance().get_fragments())


def _bulk(root: Path, vectors: np.ndarray, ids: list[str], dtype: str) -> tuple[float, float]:
    """Seconds to encode the same rows in one go and write them in one Lance write; and the write alone."""
    n = len(ids)
    start = time.perf_counter()
    grad, norm = encode(vectors, dtype)
    table = pa.table(
        {
            "grad_id": np.arange(n),
            "run_id": ["bench"] * n,
            "example_id": ids,
            "step": np.arange(n),
            "split": ["train"] * n,
            "grad": grad,
            "grad_norm": norm,
        }
    )
    encoded = time.perf_counter()
    lance.write_dataset(table, root)
    done = time.perf_counter()
    return done - start, done - encoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=float, default=210.0)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--append-rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds (arm order alternates)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
