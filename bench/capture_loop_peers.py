"""W-capture in a plain PyTorch loop: gradstore's capture against dattri-llm's ``HookManager``, in one sitting.

The workload and method of ``bench/capture.py`` (GPT-2 4 x 256, batches of 16 x 128 random tokens, AdamW lr 1e-4;
one step = forward + backward + optimizer step + zero_grad): three model copies with identical initial weights,
each with its own AdamW, step on the same batch back to back, the order rotating from batch to batch and the RNG
reseeded per batch so every copy draws the same dropout masks:

- ``plain``: no hooks;
- ``gradstore``: ``store.capture`` of the 16 Conv1D layers of the blocks at 16 x 16 (4,096 float16 dims per
  example) into a real store, as ``bench/capture.py`` captures;
- ``dattri-llm``: dattri-llm 0.1.0's ``HookManager`` on the same 16 layers, LoGra projection (``style="logra"``,
  ``proj_dim=16`` per side, dattri's normal CPU projector), per-example gradients materialised to 16 x 16 in the
  backward hook (``capture_style="materialized"``), written by its ``OffloadCallback`` (every 16 steps, on a
  background writer: ``async_write=True``) into its on-disk store.

After ``--warmup`` batches, ``--steps`` are timed; a repeat's figure for each capturing copy is the median of its
per-batch ratios to the plain step. The script makes ``--repeats`` (3) such runs (fresh copies, stores and
hooks) and reports the median of the medians. Both capturing copies must end with the plain copy's weights
(capture must not change training) and must have written a row per example (checked).

The last line is ``RESULT capture_loop_vs_dattri=<gradstore ratio / dattri-llm ratio> target<=1.0 PASS|MISS``.

dattri-llm is not a dependency of gradstore; install it beside gradstore in a separate environment, e.g.
``pip install -e '.[hf]' && pip install --no-deps dattri-llm==0.1.0 dattri==0.3.0 && pip install scipy pyyaml``.

    python bench/capture_loop_peers.py [--steps 20] [--warmup 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import gradstore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture import BATCH, EXPECTED_DIM, EXPECTED_LAYERS, K, block_capture, make_batches, make_model, train_step
from peers import report_against_peer

try:
    from dattri_llm import GradientStorageManager, HookManager, HookManagerConfig, OffloadCallback
except ImportError as error:  # the peer is optional: say how to get it
    raise SystemExit(f"bench/capture_loop_peers.py needs dattri-llm 0.1.0 ({error}); see its docstring") from None

BLOCK_LAYERS = r"transformer\.h\.\d+\.(attn|mlp)\.(c_attn|c_proj|c_fc)$"


def dattri_manager(model: torch.nn.Module, root: Path) -> tuple[HookManager, GradientStorageManager]:
    """dattri-llm's hooks on ``model``'s 16 block layers, LoGra 16 x 16, offloaded to ``root`` every 16 steps."""
    config = HookManagerConfig(
        linear_io=[BLOCK_LAYERS],
        capture_style="materialized",
        projection_kwargs={"__default__": {"style": "logra", "proj_dim": K, "proj_max_batch_size": BATCH}},
    )
    files = GradientStorageManager(str(root))
    offload = OffloadCallback(offload_interval=16, file_manager=files, async_write=True)
    return HookManager(model, config=config, callbacks=[offload]), files


def measure(steps: int, warmup: int, seed: int) -> tuple[dict[str, list[float]], dict[str, int], bool]:
    """One paired run: each arm's per-batch step times, the rows each capture stored, whether weights agree."""
    plain = make_model(seed)
    copies = {"plain": plain, "gradstore": copy.deepcopy(plain), "dattri-llm": copy.deepcopy(plain)}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in copies.items()}
    for model in copies.values():
        model.train()
    batches = make_batches(warmup + steps, seed + 1)
    root = Path(tempfile.mkdtemp(prefix="gradstore-bench-peers-"))
    try:
        store = gradstore.open(root / "store")
        capture = block_capture(store, copies["gradstore"], optimizers["gradstore"])
        manager, files = dattri_manager(copies["dattri-llm"], root / "dattri")
        times: dict[str, list[float]] = {name: [] for name in copies}
        with capture, manager.collect():
            for i, tokens in enumerate(batches):
                names = list(copies)
                for name in names[i % len(names) :] + names[: i % len(names)]:  # the order rotates
                    elapsed = train_step(copies[name], optimizers[name], tokens, seed * 1_000_003 + i)
                    if i >= warmup:
                        times[name].append(elapsed)
        manager.remove()
        rows = {"gradstore": store.count(), "dattri-llm": dattri_rows(files)}
        same = all(
            torch.equal(p, q)
            for other in ("gradstore", "dattri-llm")
            for p, q in zip(plain.parameters(), copies[other].parameters())
        )
        return times, rows, same
    finally:
        shutil.rmtree(root, ignore_errors=True)


def dattri_rows(files: GradientStorageManager) -> int:
    """Examples dattri-llm stored, after checking that every record holds the 16 block layers at 16 x 16."""
    examples = 0
    for file, by_step in files.iter_steps(files.available_steps()):
        records = files.load_records(file)
        for record in (records[i] for idxs in by_step.values() for i in idxs):
            gradient = record.gradient
            per_example = gradient.materialized_nbytes // (gradient.batch_size * gradient.dtype.itemsize)
            if len(gradient.layer_names) != EXPECTED_LAYERS or per_example != EXPECTED_DIM:
                raise SystemExit(
                    f"dattri-llm stored {len(gradient.layer_names)} layers, {per_example} values an example: "
                    f"not W-capture's {EXPECTED_LAYERS} / {EXPECTED_DIM}"
                )
            examples += gradient.batch_size
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured batches per repeat (WORKLOADS: >= 20)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed batches before measuring, per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="paired runs; the result is the median of their medians")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    torch.set_num_threads(2)
    medians: dict[str, list[float]] = {"gradstore": [], "dattri-llm": []}
    complete = True
    for repeat in range(opts.repeats):
        times, rows, same = measure(opts.steps, opts.warmup, opts.seed + repeat)
        expected = (opts.warmup + opts.steps) * BATCH
        complete = complete and same and all(count == expected for count in rows.values())
        for name in medians:
            ratios = [c / p for c, p in zip(times[name], times["plain"])]
            medians[name].append(statistics.median(ratios))
            steps_ms = {arm: statistics.median(times[arm]) * 1e3 for arm in ("plain", name)}
            print(
                f"repeat {repeat} {name}: median ratio {medians[name][-1]:.3f}; rows {rows[name]} (expected "
                f"{expected}); weights equal to plain: {same}; median step plain {steps_ms['plain']:.0f} ms, "
                f"captured {steps_ms[name]:.0f} ms",
                flush=True,
            )
    report_against_peer(medians, "gradstore", "dattri-llm", "capture_loop_vs_dattri", complete)


if __name__ == "__main__":
    main()
