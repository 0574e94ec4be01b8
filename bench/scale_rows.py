"""Ten million rows: one store grown to ``--rows`` rows x ``--dims`` dims through the store's writer, measured at
each size of ``--sizes`` (1M and 10M on the record run: write 1M, measure, append to 10M, measure).

Rows are :mod:`bench/scale.py`'s synthetic structured rows (64 cluster centres in a rank-64 subspace + a shared
rank-32 component + noise) at 1,024 dims, laid out as 16 factorized layers of 8 x 8, generated in blocks of
16,384 rows (each block from its own seed, so an interrupted store resumes where it stopped) and appended
through ``store.writer`` (its background thread encodes and commits one data file per block). Per storage dtype
(``--dtype``: ``float16``, the default encoding, ``int8`` or ``both``), at every size:

* ingest: rows appended since the last size, the wall time of the loop (generation included; the generation's
  own time printed beside it), MB/s of vector bytes (``dims x`` 2 or 1 bytes per row) and of bytes on disk;
* bytes on disk per row (the store directory's size / rows);
* the exact top-10 scan of 64 queries, grad-dot (rows scored as stored: the cheapest exact method), in this
  process (one streaming scan) and on Ray with 2 local workers (:class:`~gradstore.core.engine.RayEngine`, 2
  tasks per CPU), alternated for ``--rounds`` rounds after a warm-up: median seconds, seconds per million rows,
  and whether both engines found the same ids;
* an ANN index (``--index``, default ``IVF256,SQ4`` from 65k rows, probing 8 lists: ``bench/ann_recall.py``'s
  partition with 4-bit codes, 512 bytes a row at 1,024 dims), built over the rows in this process: build time,
  recall@10 of FAISS alone and of the two-stage search (100 FAISS candidates re-ranked exactly from the store)
  against the exact scan, and the two-stage search time. Not ``SQ8``: at 10M rows its 10 GB index, with the
  rest of this process, was killed for memory (17 GB resident) on this 23 GB machine shared with other work.
  Not on Ray: each shard's part of the index comes back through Ray's object store (a second copy). Not
  product-quantised: training ``PQ64`` at 1,024 dims took 210 s and it added 4,900 rows/s here (34 minutes for
  10M). Not HNSW: at 10M x 1,024 an ``HNSW32,SQ8`` graph holds ~13 GB (10 GB of codes + 32 links a row) and
  added ~2,100 rows/s on this 2-core machine (40k rows; slower as the graph grows): over 80 minutes in one
  process, since graphs cannot be built per shard and merged;
* peak RSS (``VmHWM``, reset before each phase through ``/proc/<pid>/clear_refs``) of every process: this one
  and each process Ray started (raylet, GCS, workers...), for the ingest, the scans and the index build.

Flatness: the cost per row at the last size over the first, for the ingest and both scans; ``RESULT
scale_rows_cost_flatness=<the largest of them, every dtype>`` (target <= 1.15). The store lives under
``--dir`` (the temp directory) and is deleted at the end unless ``--keep`` (10M float16 rows: ~21 GB); the run
refuses to start a size that would leave under 10 GB free. The default (``--rows 1000000 --sizes
100000,1000000``, float16) runs in a few minutes on 2 cores; the runs on record (docs/benchmarks.md): ``--rows
10000000 --sizes 1M,10M --rounds 1 --dtype float16`` (24 minutes on the shared machine), then ``--dtype int8``
(11 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import torch
from ann_recall import FirstStage, ivf_kind
from scale import K, log, paired, scan, spec, structure, structured_rows

import gradstore
from gradstore.core.engine import LocalEngine, RayEngine
from gradstore.core.shards import fragment_shards
from gradstore.search.index import INDEXES
from indexers import recall_at_k

RUN, CHECKPOINT = "scale-rows", "final"
BLOCK_ROWS = 16384  # rows per generated block and per commit: one full data file at 1,024 float16 dims
MIN_FREE_BYTES = 10 << 30
TARGET = 1.15
ITEM_BYTES = {"float16": 2, "int8": 1}


def directory_bytes(path: Path) -> int:
    """Bytes on disk under ``path`` (allocated blocks, as ``du``)."""
    return sum(entry.stat().st_blocks * 512 for entry in path.rglob("*") if entry.is_file())


# ---------------------------------------------------------------------------------------------- peak RSS
def processes() -> list[psutil.Process]:
    """This process and every process it started (Ray's raylet, GCS and workers among them)."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def reset_peaks() -> None:
    """Reset every process's ``VmHWM`` to its current RSS (Linux ``clear_refs`` 5)."""
    for process in processes():
        with contextlib.suppress(OSError):  # gone, or not ours
            Path(f"/proc/{process.pid}/clear_refs").write_text("5")


def peaks() -> list[tuple[str, int, float]]:
    """``(name, pid, peak RSS in MB since the last reset)`` of every process, largest first."""
    found = []
    for process in processes():
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
            name = " ".join(process.cmdline()[:1]) if process.pid != os.getpid() else "this process"
        except (OSError, psutil.Error):
            continue
        title = process.name() if name.endswith(("python", "python3")) else Path(name).name
        hwm = int(status.split("VmHWM:")[1].split()[0]) / 1024
        found.append((title or name, process.pid, hwm))
    return sorted(found, key=lambda entry: -entry[2])


def peak_line(phase: str) -> str:
    """One line of every process's peak RSS during ``phase`` (processes under 50 MB summed)."""
    entries = peaks()
    big = [f"{name}[{pid}] {mb:,.0f}" for name, pid, mb in entries if mb >= 50]
    small = [mb for _, _, mb in entries if mb < 50]
    rest = f" + {len(small)} under 50 MB ({sum(small):.0f} MB)" if small else ""
    return f"  peak RSS, {phase} (MB): " + ", ".join(big) + rest


# ---------------------------------------------------------------------------------------------- one size
@dataclass
class Size:
    """What one size measured."""

    rows: int
    ingest_seconds: float  # appending the rows since the last size, generation included
    generate_seconds: float
    vector_mb: float  # of the rows since the last size
    disk_mb: float  # store directory growth since the last size
    bytes_per_row: float
    local_s: float
    ray_s: float
    same_ids: bool
    index: str = ""
    notes: list[str] = field(default_factory=list)

    def per_million(self, seconds: float) -> float:
        return seconds / self.rows * 1e6


def grow(store: gradstore.GradStore, path: Path, rows: int, dims: int, dtype: str) -> tuple[float, float, float, float]:
    """Append structured rows until the run holds ``rows``: ``(loop seconds, generation seconds, vector MB, disk
    MB)`` of the rows appended."""
    _, centres, shared, _ = structure(dims)
    held = store.count()
    if held >= rows:
        return 0.0, 0.0, 0.0, 0.0
    expected = (rows - held) * (dims * ITEM_BYTES[dtype] + 64)
    free = shutil.disk_usage(path).free
    if free - expected < MIN_FREE_BYTES:
        raise SystemExit(f"{rows:,} rows need ~{expected / 1e9:.1f} GB; {free / 1e9:.1f} GB free (keeping 10 GB)")
    before, generating = directory_bytes(path), 0.0
    start = time.perf_counter()
    with store.writer(RUN, commit_rows=BLOCK_ROWS, commit_bytes=1 << 40) as writer:
        for first in range(held - held % BLOCK_ROWS, rows, BLOCK_ROWS):
            begun = time.perf_counter()
            generator = torch.Generator().manual_seed(1 + first // BLOCK_ROWS)
            block = structured_rows(generator, BLOCK_ROWS, centres, shared)[max(0, held - first) : rows - first]
            ids = [f"ex{i:09d}" for i in range(max(first, held), min(first + BLOCK_ROWS, rows))]
            generating += time.perf_counter() - begun
            writer.append(block.numpy(), ids, checkpoint=CHECKPOINT, split="train")
    seconds = time.perf_counter() - start
    store.record_checkpoint(RUN, CHECKPOINT, step=1)
    return seconds, generating, (rows - held) * dims * ITEM_BYTES[dtype] / 1e6, (directory_bytes(path) - before) / 1e6


def first_stage(kind: str, rows: int) -> FirstStage:
    """``--index`` (``auto``: :func:`ann_recall.ivf_kind`'s partition with 4-bit codes, ``IVF256,SQ4`` probing 8 lists
    from 65k rows on), its
    ``10 k`` candidates re-ranked exactly."""
    if kind == "auto":
        return replace(ivf_kind(rows), factory=ivf_kind(rows).factory.replace("SQ8", "SQ4"))
    nlist = int(kind[3:].split(",")[0]) if kind.startswith("IVF") else 0
    return FirstStage(kind, max(4, nlist // 32))


def measure(store, path: Path, ray_engine: RayEngine, args, dtype: str, rows: int, grown) -> Size:
    """Scans and the index at ``rows`` rows (just grown: ``grown`` from :func:`grow`)."""
    queries = structure(args.dims)[3]
    exact = store.build_index(RUN, method="grad-dot")
    space, prepared, where = exact.space, exact.space.queries(queries), exact.selection.filter
    local_shards = fragment_shards(store, RUN, where, 1)
    ray_shards = fragment_shards(store, RUN, where, ray_engine.parallelism)
    reset_peaks()
    exact_ids = scan(LocalEngine(), local_shards, space, prepared)[1]  # warm-up, and the ids to recall
    scan(ray_engine, ray_shards, space, prepared)
    local_s, ray_s, same = paired(local_shards, ray_shards, ray_engine, space, prepared, args.rounds)
    size = Size(rows, *grown, directory_bytes(path) / rows, local_s, ray_s, same)
    size.notes.append(peak_line("exact scans"))

    if args.index != "none":
        kind = first_stage(args.index, rows)
        name = "bench-scale-rows"
        store.core.files.remove(INDEXES, name)
        reset_peaks()
        start = time.perf_counter()
        ann = store.build_index(RUN, method="grad-dot", kind=kind.factory, name=name)
        build = time.perf_counter() - start
        size.notes.append(peak_line("index build"))
        ann.faiss_index.nprobe = kind.breadth
        alone = recall_at_k(ann.search(queries, K)[1], exact_ids)
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            found = ann.search(queries, K, rerank=kind.rerank)[1]
            times.append(time.perf_counter() - start)
        size.index = (
            f"{kind.label()}: build {build:.1f} s (rows added in this process), recall@10 two-stage "
            f"{recall_at_k(found, exact_ids):.3f} (re-rank of {kind.rerank * K}; FAISS alone {alone:.3f}), "
            f"search {statistics.median(times):.2f} s for {len(queries)} queries"
        )
        store.core.files.remove(INDEXES, name)
    return size


def header(dtype: str, dims: int) -> None:
    """The head of one dtype's table (:func:`row` prints a size as soon as it is measured)."""
    print(f"{dtype}, {dims} dims, grad-dot exact top-{K} of 64 queries, medians of the alternated rounds:")
    print(
        f"  {'rows':>11s} {'ingest MB/s':>11s} {'(disk MB/s)':>11s} {'gen s':>6s} {'bytes/row':>9s} "
        f"{'in-proc s':>9s} {'s/1M':>6s} {'ray s':>7s} {'s/1M':>6s} same"
    )


def row(s: Size) -> None:
    """One size's line, its index and its peak RSS lines (flushed: a run killed later keeps them)."""
    ingest = (
        f"{s.vector_mb / s.ingest_seconds:11.1f} {s.disk_mb / s.ingest_seconds:11.1f}"
        if s.ingest_seconds
        else f"{'cached':>23s}"
    )
    print(
        f"  {s.rows:>11,d} {ingest} {s.generate_seconds:6.1f} {s.bytes_per_row:9.1f} {s.local_s:9.2f} "
        f"{s.per_million(s.local_s):6.2f} {s.ray_s:7.2f} {s.per_million(s.ray_s):6.2f} {s.same_ids}"
    )
    if s.index:
        print(f"    {s.index}")
    for note in s.notes:
        print(f"  {note}")
    sys.stdout.flush()


def report(sizes: list[Size]) -> dict[str, float]:
    """Print one dtype's cost-per-row ratios (last size / first) and return them."""
    first, last = sizes[0], sizes[-1]
    ratios = {
        "in-process scan": last.local_s / last.rows / (first.local_s / first.rows),
        "ray scan": last.ray_s / last.rows / (first.ray_s / first.rows),
    }
    if first.ingest_seconds and last.ingest_seconds and len(sizes) > 1:
        grown = last.rows - sizes[-2].rows
        ratios["ingest"] = (last.ingest_seconds / grown) / (first.ingest_seconds / first.rows)
    print(
        f"  cost per row, {last.rows:,} / {first.rows:,} rows: "
        + ", ".join(f"{name} {ratio:.3f}" for name, ratio in ratios.items())
        + f"; bytes per row {last.bytes_per_row / first.bytes_per_row:.3f}"
    )
    return ratios


def run_dtype(dtype: str, ray_engine: RayEngine, args) -> dict[str, float]:
    path = Path(args.dir) / f"gradstore-scale-rows-{dtype}-{args.dims}"
    store = gradstore.open(path, storage_dtype=dtype, row_files=False)
    store.core.catalog.ensure_run(RUN, spec(args.dims))
    sizes = []
    header(dtype, args.dims)
    try:
        for rows in args.sizes:
            log(f"{dtype}: growing the store to {rows:,} rows")
            reset_peaks()
            grown = grow(store, path, rows, args.dims, dtype)
            ingest_peak = peak_line("ingest")
            log(f"{dtype}: {rows:,} rows written; measuring")
            size = measure(store, path, ray_engine, args, dtype, rows, grown)
            size.notes.insert(0, ingest_peak)
            sizes.append(size)
            row(size)
        return report(sizes)
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)


def parse_sizes(text: str) -> list[int]:
    """``1M,10M`` or ``100000,1000000`` as row counts."""
    scale = {"k": 1_000, "m": 1_000_000}
    return [
        int(float(part[:-1]) * scale[part[-1].lower()]) if part[-1] in "kKmM" else int(part) for part in text.split(",")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows at the end (the issue's: 10000000)")
    parser.add_argument(
        "--sizes",
        "--checkpoints",
        type=parse_sizes,
        help="row counts to measure at, ascending, the last one --rows (default: --rows/10,--rows)",
    )
    parser.add_argument("--dims", type=int, default=1024)
    parser.add_argument("--dtype", choices=("float16", "int8", "both"), default="float16")
    parser.add_argument("--rounds", type=int, default=3, help="alternated scan rounds per size")
    parser.add_argument("--index", default="auto", help="FAISS factory of the ANN arm ('auto': IVF<n>,SQ8; 'none')")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the store is written")
    parser.add_argument("--keep", action="store_true", help="keep the store (default: deleted at the end)")
    args = parser.parse_args()
    args.sizes = sorted(set(args.sizes or [args.rows // 10, args.rows]) | {args.rows})
    import ray

    torch.set_num_threads(2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray_engine = RayEngine()
    ratios: dict[str, float] = {}
    try:
        for dtype in ("float16", "int8") if args.dtype == "both" else (args.dtype,):
            ratios.update({f"{dtype} {name}": ratio for name, ratio in run_dtype(dtype, ray_engine, args).items()})
    finally:
        ray.shutdown()
    print(f"peak RSS of this process over the run: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MB")
    worst = max(ratios, key=ratios.__getitem__)
    print(f"largest cost-per-row ratio: {worst}")
    flat = ratios[worst]
    print(f"RESULT scale_rows_cost_flatness={flat:.3f} target<={TARGET} {'PASS' if flat <= TARGET else 'MISS'}")


if __name__ == "__main__":
    sys.exit(main())
