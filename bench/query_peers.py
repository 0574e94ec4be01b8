"""W-query: gradstore's exact search against bergson's exact ``Attributor.search``, in one sitting.

The workload of WORKLOADS.md: N(0,1) float32 rows (50,000 x 4,096 by default; ``--rows 200000`` for the larger
variant), 64 queries, top-10, generated as ``bench/query.py`` generates them. Each tool holds the rows in its
default float16 encoding: gradstore's store on disk (float16 unit rows and a float32 norm) and a bergson 2.5.1
index (float16 values in ``gradients.bin`` + ``info.json`` + a saved ``GradientProcessor``, 16 modules of 256
columns, as 16 x 16 projections of 16 layers make), written from the same float32 rows.

The arms alternate step by step (the order rotating every step) after a warm-up; the script reports each arm's
median and the median paired ratios:

- ``torch fp32``: ``torch.topk(X @ Q.T)`` over the float32 rows in memory (the reference of ``bench/query.py``);
- ``gradstore search``: the store's exact kernel over the rows its row cache holds (prepared once);
- ``bergson search``: ``Attributor.search`` over the rows its constructor copied into memory (float32, its
  default), plus ``torch.topk`` over all of them as its ``search`` does;
- ``gradstore store.attribute, repeat call``: end to end (queries, search, example ids, result table);
- ``gradstore store.attribute, first call``: row cache emptied first (rows mapped from the row file an earlier
  search wrote, as a new process finds them);
- ``bergson load + search``: a new ``Attributor`` (reads its memory map into float32 tensors) and one search, as a
  new process finds it.

Before timing, both tools' top-10 ids are checked against torch's (recall@10 printed; ties at float16/float32
resolution aside they must agree: at least 0.99). The last line is ``RESULT exact_vs_bergson=<gradstore search / bergson
search> target<=1.0 PASS|MISS`` (the larger over the sizes); the first-call ratio is printed above it.

bergson is not a dependency of gradstore; install it as ``bench/capture_peers.py`` says.

    python bench/query_peers.py [--rows 50000] [--steps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from query import TORCH, K, as_stored, log, paired, run_paired, standard_normal, worst_over_sizes, write_store

from indexers import ExactIndex, recall_at_k

try:
    from bergson.data import create_index
    from bergson.gradients import GradientProcessor
    from bergson.query.attributor import Attributor
except ImportError as error:  # the peer is optional: say how to get it
    raise SystemExit(f"bench/query_peers.py needs bergson 2.5.1 ({error}); see bench/capture_peers.py") from None

TARGET = 1.0  # issue 12: exact search at least as fast as the best peer's
MODULES = 16  # 16 layers x 16 x 16 = 4,096 columns
OURS = "gradstore search"
THEIRS = "bergson search"
ATTRIBUTE = "gradstore store.attribute, repeat call"
OURS_FIRST = "gradstore store.attribute, first call"
THEIRS_FIRST = "bergson load + search"


def write_bergson_index(root: Path, x: np.ndarray) -> dict[str, int]:
    """A bergson index at ``root`` holding ``x`` as float16 in ``MODULES`` equal modules; returns its sizes."""
    width = x.shape[1] // MODULES
    sizes = {f"layer{m}": width for m in range(MODULES)}
    grads = create_index(root, num_grads=len(x), grad_sizes=sizes, dtype=np.float16)
    grads[:] = x.reshape(len(x), -1).astype(np.float16)
    grads.flush()
    GradientProcessor({}, projection_dim=16).save(root)
    return sizes


def by_module(q: np.ndarray, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Queries split into bergson's per-module columns."""
    bounds = np.cumsum([0, *sizes.values()])
    return {name: torch.from_numpy(q[:, lo:hi]) for name, lo, hi in zip(sizes, bounds[:-1], bounds[1:])}


def one_size(rows: int, args: argparse.Namespace, root: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of every arm, and the median paired ratios."""
    log(f"{rows} rows: generating, encoding, writing both stores")
    x = standard_normal(rows, args.dim, seed=0)
    q = standard_normal(args.queries, args.dim, seed=1)
    as_stored(x, "float16")  # x = what gradstore's reader returns; bergson's float16 rounds it once more
    store = write_store(root / f"gradstore{rows}", x, "float16")
    sizes = write_bergson_index(root / f"bergson{rows}", x)
    xt, qt = torch.from_numpy(x), torch.from_numpy(q)
    queries = by_module(q, sizes)

    attribute = partial(store.attribute, q, run="bench", k=K, write=False)
    attribute()  # reads the rows into the row cache and writes the row file
    store.core.row_files.wait()
    prepared = store.build_index("bench", method="grad-dot").cached_rows()
    if prepared is None:
        raise SystemExit("the store's row cache holds no prepared rows (budget too small)")
    kernel = ExactIndex(kernel=prepared.kernel)
    first_grad_id = store.sql("select min(grad_id) from gradients").fetchall()[0][0]
    attributor = Attributor(root / f"bergson{rows}")

    def first_call() -> object:
        store.core.row_cache.clear()
        return attribute()

    def bergson_first() -> object:
        return Attributor(root / f"bergson{rows}").search(queries, K)

    reference = torch.topk(xt @ qt.T, K, dim=0).indices.T.numpy()
    ours = kernel.search(q, prepared, K)[1] - first_grad_id
    theirs = attributor.search(queries, K).indices.numpy()
    log(
        f"{rows} rows: recall@{K} vs torch: gradstore {recall_at_k(ours, reference):.4f}, "
        f"bergson {recall_at_k(theirs, reference):.4f}"
    )
    for name, found in (("gradstore", ours), ("bergson", theirs)):
        if recall_at_k(found, reference) < 0.99:
            raise SystemExit(f"{name}'s top-{K} disagrees with torch's: not the same search")

    arms: dict[str, Callable[[], object]] = {
        TORCH: lambda: torch.topk(xt @ qt.T, K, dim=0),
        OURS: lambda: kernel.search(q, prepared, K),
        THEIRS: lambda: attributor.search(queries, K),
        ATTRIBUTE: attribute,
        OURS_FIRST: first_call,
        THEIRS_FIRST: bergson_first,
    }
    log(f"{rows} rows: 1 warm-up + {args.steps} paired steps")
    times = run_paired(arms, args.steps)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {
        "gradstore / bergson, search": paired(times, OURS, THEIRS),
        "gradstore / bergson, first call": paired(times, OURS_FIRST, THEIRS_FIRST),
        "gradstore / torch fp32": paired(times, OURS, TORCH),
        "bergson / torch fp32": paired(times, THEIRS, TORCH),
    }
    return medians, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[50_000])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"W-query against bergson: float16 rows x {args.dim}, {args.queries} queries, top-{K}, "
        f"CPU, {args.threads} threads; medians of {args.steps} paired steps"
    )
    worst = worst_over_sizes(args, one_size, "gradstore-query-peers-")
    first = worst["gradstore / bergson, first call"]
    print(f"query_first_call_vs_bergson={first:.3f} (store.attribute end to end vs bergson load + search)")
    headline = worst["gradstore / bergson, search"]
    print(f"RESULT exact_vs_bergson={headline:.3f} target<={TARGET} {'PASS' if headline <= TARGET else 'MISS'}")


if __name__ == "__main__":
    main()
