"""What fusing the projections into the layers' GEMMs (``fused=True``) saves, in whole W-capture steps (issue 12).

Capture's hooks project a layer's inputs (forward hook) and output gradients (tensor hook) with skinny GEMMs of
their own, which read every activation and output gradient once more after the layer has (``docs/capture.md``).
``CaptureConfig(fused=True)`` (:mod:`ingest.fused`) appends the projections as extra columns to the layer's own
forward and input-gradient GEMMs instead, so each tensor is read once for both.

Workload: ``bench/capture.py``'s (GPT-2 4 x 256, batch 16 x 128, the 16 Conv1D layers of the blocks at 16 x 16,
``token_mean``). Three model copies step by step on the same batch and dropout masks, the order rotating every
step: ``plain`` (no capture), ``hooks`` (capture as by default) and ``fused`` (``fused=True``); rows go to a
list. Per forward + backward + AdamW step: the CPU time of this thread (``time.thread_time``: other processes'
load changes it far less than wall time; with ``--threads 1`` it holds all of torch's work) and the wall time.
What capture adds is the median over steps of the difference to the plain copy in the same step.

Checked, not timed: the fused rows equal the hooks' rows (relative error), and the three copies' weights are
bit-identical at the end (capture must not change training).

The last line is ``RESULT fused_capture_cost=<CPU time fused capture adds / what the hooks add> target<=0.5
PASS|MISS``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from capture import make_batches, make_model

from ingest.capture import CaptureConfig, GradientCapture

TARGET = 0.5
ARMS = ("plain", "hooks", "fused")


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, seed: int) -> tuple[float, float]:
    """CPU seconds of this thread and wall seconds of one forward + backward + optimizer step."""
    torch.manual_seed(seed)
    cpu, wall = time.thread_time(), time.perf_counter()
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()
    return time.thread_time() - cpu, time.perf_counter() - wall


def added_ms(times: dict[str, list[float]], arm: str) -> float:
    """Median over the steps of ``arm``'s time minus the plain copy's in the same step, in ms."""
    return 1e3 * statistics.median(a - p for a, p in zip(times[arm], times["plain"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per arm (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"plain": make_model(0)}
    models["hooks"], models["fused"] = copy.deepcopy(models["plain"]), copy.deepcopy(models["plain"])
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    batches = make_batches(args.steps + 2, 1)
    rows: dict[str, list] = {"hooks": [], "fused": []}
    captures = {
        name: GradientCapture(
            models[name],
            rows[name].append,
            CaptureConfig.from_options(
                loss_reduction="token_mean", include=r"transformer\.h\.", layer_types=("conv1d",), fused=name == "fused"
            ),
            optimizer=optimizers[name],
        )
        for name in rows
    }
    cpu: dict[str, list[float]] = {name: [] for name in ARMS}
    wall: dict[str, list[float]] = {name: [] for name in ARMS}
    with captures["hooks"], captures["fused"]:
        for i, tokens in enumerate(batches):
            for name in ARMS[i % 3 :] + ARMS[: i % 3]:
                spent = step(models[name], optimizers[name], tokens, seed=i)
                if i >= 2:
                    cpu[name].append(spent[0])
                    wall[name].append(spent[1])
    hooks, fused = (torch.cat([batch.grads for batch in rows[name]]) for name in ("hooks", "fused"))
    error = float((fused - hooks).norm() / hooks.norm())
    same = all(
        torch.equal(p, q) and torch.equal(p, r) for p, q, r in zip(*(model.parameters() for model in models.values()))
    )
    print(f"W-capture, 16 Conv1D layers at 16 x 16, {args.threads} threads, {args.steps} steps per arm (rotating)")
    print("| arm | median CPU ms | CPU ms added | median wall ms | wall ms added |")
    print("|---|---:|---:|---:|---:|")
    for name in ARMS:
        cpu_added = "" if name == "plain" else f"{added_ms(cpu, name):.1f}"
        wall_added = "" if name == "plain" else f"{added_ms(wall, name):.1f}"
        print(
            f"| {name} | {1e3 * statistics.median(cpu[name]):.1f} | {cpu_added} | "
            f"{1e3 * statistics.median(wall[name]):.1f} | {wall_added} |"
        )
    print(f"fused rows vs hooks' rows, relative error {error:.2e}; weights of all three copies bit-identical: {same}")
    if not same or error > 1e-5:
        raise SystemExit("fused capture changed training or its rows")
    cost = added_ms(cpu, "fused") / added_ms(cpu, "hooks")
    print(f"wall time added, fused / hooks: {added_ms(wall, 'fused') / added_ms(wall, 'hooks'):.3f}")
    print(f"RESULT fused_capture_cost={cost:.3f} target<={TARGET} {'PASS' if cost <= TARGET else 'MISS'}")


if __name__ == "__main__":
    main()
