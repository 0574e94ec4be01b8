"""Fitting ``method="fisher"`` with fewer rows than dimensions (issue 39): the ``n x n`` Gram route against the
``dim x dim`` eigendecomposition it replaces, measured in one run on the same rows.

``--rows`` (1,300) rows of ``--dim`` (7,434: the trajectory benchmark's full dimension) float32 gradients; the
reference arm eigendecomposes ``G^T G / n`` at full size (what every fit did before), the new arm is
``FisherPreconditioner.fit``. Both are checked to score a batch of queries alike (relative difference printed).

RESULT ``fisher_fit_small_n_speedup``: reference seconds / new seconds, target >= 10.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from indexers import make_preconditioner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1300)
    parser.add_argument("--dim", type=int, default=7434)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((args.rows, args.dim)) * np.logspace(-2, 0, args.dim)).astype(np.float32)
    queries = torch.from_numpy(rng.standard_normal((16, args.dim)))

    start = time.perf_counter()
    fitted = make_preconditioner("fisher", damping=0.1).fit(g)
    new = time.perf_counter() - start
    got = fitted.apply_query(queries)

    start = time.perf_counter()
    rows = torch.from_numpy(g).to(torch.float64)
    values, vectors = torch.linalg.eigh(rows.T @ rows / args.rows)
    reference = time.perf_counter() - start
    values = values.clamp_min(0.0)
    shift = 0.1 * values.mean()
    want = ((queries @ vectors) / (values + shift)) @ vectors.T
    error = float((got - want).norm() / want.norm())
    print(f"rows={args.rows} dim={args.dim} threads={torch.get_num_threads()}: dim x dim eigh {reference:.1f} s, "
          f"Gram route {new:.2f} s, relative difference of the preconditioned queries {error:.1e}")  # fmt: skip
    speedup = reference / new
    ok = speedup >= 10 and error < 1e-8
    print(f"RESULT fisher_fit_small_n_speedup={speedup:.1f} target>=10 {'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
