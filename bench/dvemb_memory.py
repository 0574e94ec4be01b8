"""Peak memory of ``dvemb`` at full dimension (issue 38 item 3): bounded, whatever the number of recorded steps.

Protocol (CPU, nothing downloaded): an MLP ``64 -> --hidden -> 10`` (default 99 hidden units: 7,435 parameters,
the issue's ~7,434 dimensions) trained by AdamW (weight decay 0.01) on ``--examples`` synthetic 64-feature examples
(random Gaussian inputs, labels of a random linear teacher) in mini-batches of 64, every step captured unprojected
(``projection=None``: one row of every parameter per example, float32 storage); with ``--true-fisher`` each step
also gets one true-Fisher row per batch example (a label sampled from the model: the step's curvature rows) before
its training rows. After ``--steps`` steps, a final checkpoint pass stores 16 query rows. A fresh process then
runs ``store.attribute(method="dvemb")`` (building the derived run: the recursion over every recorded step, Adam's
joint parameter/momentum product per layer block) and its peak RSS (``ru_maxrss``) is reported.

The default ``--steps 48`` takes a few minutes on 2 cores; the issue's run is ``--steps 1280`` (81,920 rows,
2.4 GB of float32 rows): see docs/benchmarks.md. Ends with
``RESULT dvemb_peak_rss_gb=<v> target<2 PASS|MISS``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gradstore
from gradstore.methods import TRUE_FISHER_SPLIT

RUN = "mlp"
IN_LOOP = "train"
CLASSES = 10
BATCH = 64
TARGET_GB = 2.0


def build(path: Path, steps: int, hidden: int, examples: int, true_fisher: bool) -> int:
    """Train under capture into a new store at ``path``; returns the run's dimension."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(examples, 64, generator=generator)
    y = (x @ torch.randn(64, CLASSES, generator=generator)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = [f"x{i}" for i in range(examples)]
    store = gradstore.open(path, storage_dtype="float32")
    with store.capture(model, RUN, optimizer=optimizer, checkpoint=IN_LOOP, projection=None) as cap:
        for _ in range(steps):
            batch = torch.randint(0, examples, (BATCH,), generator=generator)
            names = [ids[i] for i in batch.tolist()]
            if true_fisher:  # one label drawn from the model per example: rows whose mean outer product is a GGN
                cap.set_split(TRUE_FISHER_SPLIT)
                cap.set_ids(names)
                logits = model(x[batch])
                sampled = torch.multinomial(torch.softmax(logits.detach(), 1), 1, generator=generator)[:, 0]
                F.cross_entropy(logits, sampled).backward()
                optimizer.zero_grad()
                cap.set_split("train")
            cap.set_ids(names)
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
            optimizer.zero_grad()
    with store.capture(model, RUN, checkpoint="final", learning_rate=1e-3, projection=None) as cap:
        cap.set_step(steps)
        cap.set_split("query")
        cap.set_ids([f"q{i}" for i in range(16)])
        F.cross_entropy(model(x[:16]), y[:16]).backward()
        model.zero_grad()
    return store.core.run_dim(RUN)


def attribute(path: Path) -> None:
    """The measured arm (a fresh process): dvemb's top-10 of every stored query, building the derived run."""
    torch.set_num_threads(2)
    store = gradstore.open(path)
    start = time.perf_counter()
    table = store.attribute(run=RUN, method="dvemb", checkpoint=IN_LOOP, k=10, write=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"dvemb: {table.num_rows} results in {time.perf_counter() - start:.1f} s; peak RSS {peak:.3f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=99)
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--true-fisher", action="store_true", help="true-Fisher rows in every step")
    parser.add_argument("--store", type=Path, default=None, help="build here (default: a temporary directory)")
    parser.add_argument("--attribute", type=Path, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.attribute is not None:
        attribute(args.attribute)
        return
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        path = args.store or Path(scratch) / "store"
        start = time.perf_counter()
        dim = build(path, args.steps, args.hidden, args.examples, args.true_fisher)
        rows = args.steps * BATCH * (2 if args.true_fisher else 1)
        print(
            f"store: {args.steps} steps x {BATCH} rows{' (+ as many true-Fisher rows)' if args.true_fisher else ''}"
            f" at {dim:,} dims: {rows * dim * 4 / 1e9:.2f} GB of float32 rows, built in "
            f"{time.perf_counter() - start:.1f} s"
        )
        subprocess.run([sys.executable, __file__, "--attribute", str(path)], check=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6  # the attribution process
    verdict = "PASS" if peak < TARGET_GB else "MISS"
    print(f"RESULT dvemb_peak_rss_gb={peak:.3f} target<{TARGET_GB:g} {verdict}")


if __name__ == "__main__":
    main()
