"""Fisher damping sweep: one full-Fisher fit, then scoring at 5 dampings from its kept eigendecomposition.

In one process: ``--rows`` anisotropic float32 rows (N(0,1) columns scaled from 0.1 to 1) of ``--dim`` dims are
written to a store on disk (the default float16 unit rows + norms). Then, timed:

- ``fit``: the full Fisher (``blocks="full"``) fitted from the store's rows and saved (``store.fits.get`` with
  ``refit=True``: a pass over the rows accumulating ``G^T G`` in float64, the eigendecomposition, the side files);
- ``sweep``: for each of ``--dampings`` dampings, a single-query and a ``--queries``-query
  ``store.attribute(method="fisher", blocks="full", write=False)`` (top-10 over the rows, which the row cache
  holds after a warm-up grad-dot call), the first call at each damping;
- ``warm lookups``: the median of ``--repeats`` repeat calls at one damping, fisher and grad-dot, single-query and
  ``--queries``-query (the fisher call applies ``P^-1`` to the queries; the search is the same);
- ``dense inverse``: what every call cost before the fit was applied from its eigendecomposition: building the
  dense ``P^-1`` from it (``FisherPreconditioner._matrix``), once.

The saved fit's bytes on disk are printed beside the rows' (the gradient table's Lance files). The last line is
``RESULT fisher_sweep_vs_fit=<sweep seconds / fit seconds> target<=0.1 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import gradstore
from gradstore.methods import resolve_method
from gradstore.preconditioning.fitting import Selection, fit_spec
from ingest.projection import LayerSlot, ProjectionSpec

RUN, CHECKPOINT, K = "bench", "train", 10


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_store(root: Path, rows: int, dim: int, chunk: int = 8192) -> gradstore.GradStore:
    """A store on disk holding ``rows`` anisotropic rows as run ``bench`` (one dense layer of ``dim`` dims)."""
    store = gradstore.open(root, row_files=root / "row-files")
    spec = ProjectionSpec(0, "none", (LayerSlot("w", "linear", 64, 64, None, None, "exact", 0, dim, False),))
    store.create_run(RUN, dim=dim, projection=spec.to_dict())
    store.record_checkpoint(RUN, CHECKPOINT, step=0)
    generator = torch.Generator().manual_seed(0)
    scale = torch.logspace(-1, 0, dim)
    with store.writer(RUN) as writer:
        for start in range(0, rows, chunk):
            end = min(rows, start + chunk)
            x = (torch.randn(end - start, dim, generator=generator) * scale).numpy()
            writer.append(x, [f"e{i}" for i in range(start, end)], checkpoint=CHECKPOINT, split="train")
    return store


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--dampings", type=float, nargs="+", default=[0.001, 0.01, 0.1, 1.0, 10.0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"Fisher damping sweep: {args.rows} float16 store rows x {args.dim}, full Fisher, top-{K}, "
        f"1 and {args.queries} queries, {len(args.dampings)} dampings, CPU, {args.threads} threads"
    )
    queries = torch.randn(args.queries, args.dim, generator=torch.Generator().manual_seed(1)).numpy()
    with tempfile.TemporaryDirectory(prefix="gradstore-fisher-sweep-") as scratch:
        root = Path(scratch) / "store"
        log("writing the store")
        store = write_store(root, args.rows, args.dim)

        def attribute(q: np.ndarray, method: str, damping: float | None = None) -> object:
            options = {"damping": damping, "blocks": "full"} if method == "fisher" else {}
            return store.attribute(q, run=RUN, k=K, method=method, write=False, **options)

        log("warm-up: grad-dot (reads the rows into the row cache)")
        attribute(queries[:1], "grad-dot")
        spec = fit_spec(store.fits.store, Selection(RUN, CHECKPOINT), resolve_method("fisher"), "full")
        log("fit")
        fit = timed(lambda: store.fits.get(spec, refit=True))
        log(f"fit: {fit:.2f} s; sweep")
        per_damping = []
        for damping in args.dampings:
            one = timed(lambda d=damping: attribute(queries[:1], "fisher", d))
            many = timed(lambda d=damping: attribute(queries, "fisher", d))
            per_damping.append((damping, one, many))
        sweep = sum(one + many for _, one, many in per_damping)
        log("warm lookups")
        warm = {}
        for method in ("fisher", "grad-dot"):
            for name, q in (("1 query", queries[:1]), (f"{args.queries} queries", queries)):
                attribute(q, method, 0.1)
                warm[method, name] = statistics.median(
                    timed(lambda m=method, q=q: attribute(q, m, 0.1)) for _ in range(args.repeats)
                )
        fitted = store.fits.get(spec)
        dense = timed(lambda: fitted._matrix(0, 1.0))
        fits = directory_bytes(Path(store.fits.store.files.path("fits")))
        rows = directory_bytes(root / f"{store.fits.store.gradient_table_name(RUN)}.lance")

    print(f"fit (one pass, float64 G^T G, eigh, save): {fit:.2f} s")
    for damping, one, many in per_damping:
        print(
            f"  damping {damping:g}: first call 1 query {one * 1e3:.1f} ms, {args.queries} queries {many * 1e3:.1f} ms"
        )
    print(f"sweep of {len(args.dampings)} dampings (1 + {args.queries} queries each): {sweep:.3f} s")
    for name in ("1 query", f"{args.queries} queries"):
        fisher, dot = warm["fisher", name], warm["grad-dot", name]
        print(
            f"warm lookup, {name}: fisher {fisher * 1e3:.1f} ms, grad-dot {dot * 1e3:.1f} ms, "
            f"fisher / grad-dot {fisher / dot:.2f}"
        )
    print(f"dense P^-1 from the eigendecomposition (what every call built before): {dense:.2f} s")
    print(f"saved fit {fits / 1e6:.1f} MB on disk, rows {rows / 1e6:.1f} MB: fit / rows {fits / rows:.2f}")
    ratio = sweep / fit
    print(f"RESULT fisher_sweep_vs_fit={ratio:.4f} target<=0.1 {'PASS' if ratio <= 0.1 else 'MISS'}")


if __name__ == "__main__":
    main()
