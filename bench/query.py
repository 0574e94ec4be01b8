"""W-query: exact top-10 search over the store's own rows (default encoding), 50,000 and 200,000 x 4,096.

For each size, in one process: N(0,1) float32 rows are encoded as the store encodes them (the default float16
unit rows and a float32 norm, or ``--storage-dtype bfloat16``/``float32``) and written to a store on disk.
These arms then alternate step by step (paired, the order rotating every step) after a warm-up, and the
median of each arm and of each paired ratio is reported:

- ``torch fp32``: ``torch.topk(X @ Q.T)`` over the decoded float32 rows (the reference of the target);
- ``exact float32 kernel``: :class:`ExactIndex` with ``kernel="float32"`` over the same rows;
- ``exact store kernel, store rows prepared``: the store's kernel (bfloat16 on a CPU with native bf16 matmul)
  over the rows the store's row cache holds for the attribution index (float16 unit rows + norms and their bf16
  copy, or bfloat16 rows as read + norms; read and prepared once, then mapped from the row file the first search
  wrote): **the headline**, ``exact_store_vs_torch_fp32``;
- ``exact float32 kernel, stored -> float32 blocks``: the same rows upcast block by block (what a search
  streamed from disk computes when the rows exceed the row cache's budget; bf16-screened rows only);
- ``bf16 GEMM + topk, rows already bf16``: the kernel limit (no exactness guarantee);
- ``store.attribute from disk, repeat call``: end to end (``method="grad-dot"``, the in-memory arm's: index,
  queries, search over the cached rows, example ids, result table; ``write=False``), against the in-memory search:
  target ``<= 1.2``;
- ``store.attribute from disk, first call, row file``: the same with the row cache emptied first, as a new
  process finds it once an earlier one searched the rows: the rows prepared are memory-mapped from the row file
  that search wrote (:mod:`gradstore.core.row_cache`), the metadata it reads (run, checkpoints, the selection's ids
  and example ids) from scan files (:mod:`gradstore.core.row_cache`);
- ``store.attribute from disk, first call, Lance read``: the first search ever (row cache emptied, no row or scan
  files: a store opened with ``row_files=False``): Lance read with read-ahead, bf16 preparation of float16 rows,
  search; in the first ``--cold-steps`` steps only.

FAISS ``Flat`` is timed after the paired steps. Above the last line: ``attribute_disk_vs_memory=<x> target<=1.2``
(the largest of the sizes' median paired ratios of repeat calls and of first calls with the row file; the first
call ever is printed beside it). The last line is ``RESULT
exact_store_vs_torch_fp32=<x> target<=0.5 PASS|MISS``: the larger of the sizes' median paired ratios. On a CPU
without a native bf16 GEMM the store's kernel is the float32 one and a line above it says so. Needs
``faiss`` (``gradstore[bench]``).

``--device cuda`` (``bench/gpu_check.sh``) runs every arm on the GPU: the rows, the queries, the exact kernels
(float32 there: the bf16 screen is a CPU kernel) and FAISS ``Flat`` (moved by ``FaissIndex.to_gpu`` when faiss
has GPU support). The store searches on CUDA by itself wherever torch sees a GPU, so CPU figures on a GPU machine
need ``CUDA_VISIBLE_DEVICES=``. The last line is then ``RESULT exact_store_vs_torch_fp32_cuda=<x> target<=1.2``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

import gradstore
from gradstore.core.vectors import DEFAULT_STORAGE_DTYPE, STORAGE_DTYPES, decode, encode
from indexers import ExactIndex, FaissIndex, gpu_available, recall_at_k, require_faiss
from indexers.screening import RowPieces, ScreenedBlock, fast_bfloat16_matmul
from ingest.projection import LayerSlot, ProjectionSpec

K = 10
TORCH = "torch fp32 topk(X @ Q.T)"
FP32 = "exact float32 kernel"
STORE = "exact store kernel, store rows prepared"
TILES32 = "exact float32 kernel, stored -> float32 blocks"
LIMIT = "bf16 GEMM + topk, rows already bf16"
DISK = "store.attribute from disk, repeat call"
COLD = "store.attribute from disk, first call, row file"
FIRST = "store.attribute from disk, first call, Lance read"
MEMORY = "read the rows the store's kernel scans, once (memory bound)"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def standard_normal(rows: int, dim: int, seed: int, chunk: int = 16384) -> np.ndarray:
    """float32 standard normal rows from one torch generator, filled chunk by chunk (no float64 copy)."""
    generator = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, dim, dtype=torch.float32)
    for start in range(0, rows, chunk):
        out[start : start + chunk] = torch.randn(min(chunk, rows - start), dim, generator=generator)
    return out.numpy()


def as_stored(x: np.ndarray, dtype: str, chunk: int = 16384) -> None:
    """Overwrite ``x`` with what the store's float32 reader returns for it when stored as ``dtype``."""
    for start in range(0, len(x), chunk):
        x[start : start + chunk] = decode(encode(x[start : start + chunk], dtype), dtype)


def write_store(root: Path, x: np.ndarray, dtype: str, chunk: int = 8192) -> gradstore.GradStore:
    """A store on disk holding ``x`` as run ``bench`` (checkpoint ``train``, split ``train``), stored as ``dtype``,
    its row files in ``root/row-files``."""
    store = gradstore.open(root, storage_dtype=dtype, row_files=root / "row-files")
    spec = ProjectionSpec(0, "none", (LayerSlot("w", "linear", 64, 64, None, None, "exact", 0, x.shape[1], False),))
    store.create_run("bench", dim=x.shape[1], projection=spec.to_dict())
    store.record_checkpoint("bench", "train", step=0)  # as a capture records the checkpoint it writes rows of
    with store.writer("bench") as writer:
        for start in range(0, len(x), chunk):
            end = min(len(x), start + chunk)
            writer.append(x[start:end], [f"e{i}" for i in range(start, end)], checkpoint="train", split="train")
    return store


def synchronized() -> None:
    """Wait for the GPU's queued work (a no-op without CUDA), so that a timing covers it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    synchronized()
    start = time.perf_counter()
    fn()
    synchronized()
    return time.perf_counter() - start


def one_size(rows: int, args: argparse.Namespace, root: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of every arm, and the median paired ratios (store / torch, disk / in-memory, ...)."""
    log(f"{rows} rows: generating and encoding")
    x = standard_normal(rows, args.dim, seed=0)
    q = standard_normal(args.queries, args.dim, seed=1)
    as_stored(x, args.storage_dtype)
    log(f"{rows} rows: writing the store")
    store = write_store(root / f"s{rows}", x, args.storage_dtype)
    device = torch.device(args.device)
    times = paired_arms(x, q, store, args.steps, args.cold_steps, device)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {
        "store / torch fp32": paired(times, STORE, TORCH),
        "disk repeat / in-memory": paired(times, DISK, STORE),
        "disk first, row file / in-memory": paired(times, COLD, STORE),
        "disk first, Lance read / in-memory": paired(times, FIRST, STORE),
        "store / memory read": paired(times, STORE, MEMORY),
        "memory read / torch fp32": paired(times, MEMORY, TORCH),
    }
    if TILES32 in times:
        ratios["stored -> float32 blocks / in-memory"] = paired(times, TILES32, STORE)
    log(f"{rows} rows: FAISS Flat")
    flat = FaissIndex("Flat", args.dim)
    flat.add(np.arange(rows, dtype=np.int64), x)
    on_gpu = device.type == "cuda" and gpu_available()
    flat = flat.to_gpu() if on_gpu else flat
    flat_name = "FAISS Flat (GPU)" if on_gpu else "FAISS Flat"
    medians[flat_name] = statistics.median(timed(lambda: flat.search(q, K)) for _ in range(args.faiss_steps))
    shutil.rmtree(root / f"s{rows}", ignore_errors=True)
    return medians, ratios


def joined(rows: torch.Tensor | RowPieces) -> torch.Tensor:
    """A prepared block's rows as one tensor (the row cache keeps rows read in pieces as they were read)."""
    return torch.cat(rows.pieces) if isinstance(rows, RowPieces) else rows


def scanned_bytes(prepared: object, screened: bool) -> list[torch.Tensor]:
    """The bytes every exact search reads in full (the bf16 screening copy of screened rows, else the prepared
    rows) as integer views: their maximum reads each byte once (about 17 GB/s on 2 cores of the reference
    machine; an int32 sum promotes and runs 30x slower), the memory-bandwidth floor of a scan."""
    pieces = []
    for block in prepared.blocks:
        rows = block.screen if screened else block[0]
        for piece in rows.pieces if isinstance(rows, RowPieces) else [rows]:
            flat = piece.contiguous().view(-1).view(torch.uint8)
            pieces.append(
                next(flat.view(d) for d in (torch.int64, torch.int32, torch.uint8) if flat.numel() % d.itemsize == 0)
            )
    return pieces


def paired(times: dict[str, list[float]], arm: str, base: str) -> float:
    """Median over the steps of ``arm / base`` measured in the same step."""
    return statistics.median(a / b for a, b in zip(times[arm], times[base]))


def paired_arms(
    x: np.ndarray, q: np.ndarray, store: gradstore.GradStore, steps: int, cold_steps: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds of every arm in each of ``steps`` paired steps (arm order rotates; one warm-up step; the first
    call arm in the first ``cold_steps`` only)."""
    first_grad_id = store.sql("select min(grad_id) from gradients").fetchall()[0][0]  # rows are numbered in order
    xt, qt = torch.from_numpy(x).to(device), torch.from_numpy(q).to(device)
    fp32 = ExactIndex(device=device, kernel="float32")
    prepared32 = fp32.prepare(np.arange(len(x), dtype=np.int64), xt)
    log(f"{len(x)} rows: first store.attribute (reads the rows into the store's row cache)")
    # grad-dot, as the in-memory arm searches: the default method (fisher) would add its query transform (method
    # arithmetic, ~33 ms for 64 queries at 4,096 dims), not the store's overhead that this ratio is about
    attribute = partial(store.attribute, q, run="bench", k=K, write=False, method="grad-dot")
    attribute()
    store.core.row_files.wait()
    if device.type == "cpu" and not store.core.row_files.entries():
        raise SystemExit("the first search wrote no row file")
    without_files = gradstore.open(store.uri, row_files=False)
    prepared = store.build_index("bench", method="grad-dot").cached_rows()
    if prepared is None:
        raise SystemExit("the store's row cache holds no prepared rows (budget too small)")
    if device.type == "cpu" and fast_bfloat16_matmul() and prepared.kernel != "bfloat16":
        raise SystemExit("the store's row cache holds no bf16-prepared rows on a CPU with native bf16 matmul")
    first = prepared.blocks[0]
    screened = isinstance(first, ScreenedBlock)
    rows_device = (first.ids if screened else first[0]).device
    if rows_device.type != device.type:
        raise SystemExit(
            f"the store searches on {rows_device.type}: run with --device {rows_device.type} "
            "(CUDA_VISIBLE_DEVICES= hides a GPU for CPU figures)"
        )
    store_kernel = ExactIndex(device=device, kernel=prepared.kernel)
    limit_rows = xt.to(torch.bfloat16)
    stored = [(block.ids, joined(block.exact), block.scales) for block in prepared.blocks] if screened else None
    scanned = scanned_bytes(prepared, screened)

    def cold() -> object:
        store.core.row_cache.clear()
        return attribute()

    def first() -> object:
        without_files.core.row_cache.clear()
        return without_files.attribute(q, run="bench", k=K, write=False, method="grad-dot")

    arms: dict[str, Callable[[], object]] = {
        TORCH: lambda: torch.topk(xt @ qt.T, K, dim=0),
        FP32: lambda: fp32.search(q, prepared32, K),
        STORE: lambda: store_kernel.search(q, prepared, K),
        TILES32: lambda: fp32.search(q, lambda: iter(stored), K),
        LIMIT: lambda: torch.topk(limit_rows @ qt.T.bfloat16(), K, dim=0),
        DISK: attribute,
        COLD: cold,
        FIRST: first,
        MEMORY: lambda: [piece.amax() for piece in scanned],
    }
    if stored is None:
        del arms[TILES32]
    reference_ids = torch.topk(xt @ qt.T, K, dim=0).indices.T.cpu().numpy()
    found_by = {
        STORE: lambda: store_kernel.search(q, prepared, K)[1] - first_grad_id,
        TILES32: lambda: fp32.search(q, lambda: iter(stored), K)[1] - first_grad_id,
        FP32: lambda: fp32.search(q, prepared32, K)[1],
        DISK: lambda: attribute().column("grad_id").to_numpy().reshape(len(q), K) - first_grad_id,
        COLD: lambda: cold().column("grad_id").to_numpy().reshape(len(q), K) - first_grad_id,
    }
    for name, found in ((name, search()) for name, search in found_by.items() if name in arms):
        recall = recall_at_k(found, reference_ids)
        if recall < 1.0:
            log(f"  {name}: recall@{K} vs torch {recall:.4f} (ties at float32 resolution)")
    log(f"{len(x)} rows: 1 warm-up + {steps} paired steps")
    # a first call reads every row again: in the first steps only
    return run_paired(arms, steps, skip=lambda name, step: name == FIRST and step > cold_steps)


def run_paired(
    arms: dict[str, Callable[[], object]], steps: int, skip: Callable[[str, int], bool] = lambda name, step: False
) -> dict[str, list[float]]:
    """Seconds of every arm in each of ``steps`` paired steps after one warm-up step; the arms' order rotates
    every step; ``skip(name, step)`` leaves an arm out of a step."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for step in range(steps + 1):
        names = list(arms)
        for name in names[step % len(names) :] + names[: step % len(names)]:
            if skip(name, step):
                continue
            elapsed = timed(arms[name])
            if step:
                times[name].append(elapsed)
    return times


def worst_over_sizes(
    args: argparse.Namespace,
    measure: Callable[[int, argparse.Namespace, Path], tuple[dict[str, float], dict[str, float]]],
    prefix: str,
) -> dict[str, float]:
    """``measure`` every size of ``args.rows`` (in one temporary directory named with ``prefix``), print each
    size's medians (and each against torch fp32) and paired ratios; return each ratio's largest over the sizes."""
    worst: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for rows in args.rows:
            medians, ratios = measure(rows, args, Path(tmp))
            report_size(rows, medians, ratios, worst)
    return worst


def report_size(rows: int, medians: dict[str, float], ratios: dict[str, float], worst: dict[str, float]) -> None:
    """Print one size's medians (and each against torch fp32) and its paired ratios; keep each ratio's largest
    over the sizes in ``worst``."""
    print(f"\n{rows} rows | median s | vs torch fp32")
    print("|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.3f} | {seconds / medians[TORCH]:.2f}x |")
    print(f"{rows} rows, median paired ratios: " + "; ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    for name, value in ratios.items():
        worst[name] = max(worst.get(name, 0.0), value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[50_000, 200_000])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--cold-steps", type=int, default=3)
    parser.add_argument("--faiss-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--storage-dtype", choices=STORAGE_DTYPES, default=DEFAULT_STORAGE_DTYPE)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every arm runs")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU")
    faiss = require_faiss()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    kernel = ExactIndex(device=args.device).kernel
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"
    print(
        f"W-query: {args.storage_dtype} store rows x {args.dim}, {args.queries} queries, top-{K}, {where}; "
        f"native bf16 matmul: {fast_bfloat16_matmul()} (kernel='auto' runs {kernel}); medians of "
        f"{args.steps} paired steps (FAISS: {args.faiss_steps})"
    )
    worst = worst_over_sizes(args, one_size, "gradstore-query-")
    disk = max(worst["disk repeat / in-memory"], worst["disk first, row file / in-memory"])
    headline = worst["store / torch fp32"]
    print(
        f"attribute_disk_vs_memory={disk:.3f} target<=1.2 {'PASS' if disk <= 1.2 else 'MISS'} "
        f"(repeat calls and first calls with the row file; the first call ever, Lance read: "
        f"{worst['disk first, Lance read / in-memory']:.2f}x)"
    )
    print(
        f"exact_store_vs_memory_read={worst['store / memory read']:.2f} (the store's scan over the time to read the "
        f"bytes it scans once; that read is {worst['memory read / torch fp32']:.3f}x torch fp32: the bandwidth floor)"
    )
    if args.device == "cpu" and not fast_bfloat16_matmul():
        print(
            "no native bf16 matmul on this CPU: the store's kernel is the float32 GEMM, the fastest exact kernel "
            "here (see the bf16 GEMM row above); the 0.5 target needs a CPU with a bf16 GEMM (AVX-512 BF16 or AMX)"
        )
    name, target = "exact_store_vs_torch_fp32", 0.5
    if args.device == "cuda":
        name, target = f"{name}_cuda", 1.2
    print(f"RESULT {name}={headline:.3f} target<={target} {'PASS' if headline <= target else 'MISS'}")


if __name__ == "__main__":
    main()
