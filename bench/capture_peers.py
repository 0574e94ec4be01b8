"""W-capture through the Hugging Face Trainer: gradstore's callback against bergson's, in one sitting.

The workload of WORKLOADS.md (GPT-2 4 x 256, batches of 16 x 128 random tokens, AdamW lr 1e-4, the 16
Conv1D layers of the blocks at 16 x 16 = 4,096 float16 dims per example), trained by ``transformers.Trainer``
in three arms: no capture (plain), bergson's ``GradientCollectorCallback`` (raw rows, ``use_optimizer_state=
False``, written to its memory-mapped index) and gradstore's ``GradstoreCallback`` (raw rows, written to a real
store). ``--adam`` adds both tools' Adam-normalised arms (bergson ``use_optimizer_state=True``, gradstore
``normalizer="adam_factored"``).

Each tool is measured as ``bench/capture_hf.py`` measures gradstore: paired per step inside one Trainer run,
after the warm-up steps alternate plain / captured (``PairedSteps``). A plain step runs with the capture off:
gradstore's callback paused, bergson's collector exited (its hooks removed; re-entered before a captured
step). A step's time runs from the first callback's ``on_step_begin`` to the last one's ``on_step_end``
(forward, backward, optimizer step, zero_grad and the callback's own step work: bergson writes its rows into
its memory map there; gradstore's captured steps end when their rows have reached its writer). A run's
figure is the median of its per-pair ratios captured / plain. Each of ``--repeats`` cycles makes one run
per arm, arm after arm; a cycle's comparison is gradstore's ratio over bergson's, and the script reports
the median over cycles and checks that each run wrote a row per example of its captured steps.

The last line is ``RESULT capture_hf_vs_bergson=<gradstore ratio / bergson ratio> target<=1.0 PASS|MISS``:
below 1 means gradstore's capture costs the step less than bergson's.

bergson is not a dependency of gradstore; install it beside gradstore in a separate environment, e.g.
``pip install -e '.[hf]' && pip install --no-deps bergson==2.5.1 && pip install jaxtyping ml_dtypes natsort
'peft>=0.17' petname simple-parsing torchopt scipy`` (its Trainer callback imports nothing else).

    python bench/capture_peers.py [--pairs 20] [--warmup 2] [--repeats 3] [--adam]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

import gradstore
from gradstore.hf import with_example_ids

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_hf import BATCH, PairedSteps, collate, paired_gradstore, workload_trainer
from peers import report_against_peer

try:
    from bergson.huggingface import GradientCollectorCallback, prepare_for_gradient_collection
except ImportError as error:  # the peer is optional: say how to get it
    raise SystemExit(f"bench/capture_peers.py needs bergson 2.5.1 ({error}); see its docstring") from None

DIM = 4096  # 16 layers x 16 x 16


class BergsonSwitch:
    """Turns bergson's gradient collector off and on between steps (its hooks removed and re-registered)."""

    def __init__(self, callback: GradientCollectorCallback) -> None:
        self.callback = callback
        self.on = True  # on_train_begin enters the collector

    def pause(self) -> None:
        if self.on:
            self.callback.collector.__exit__(None, None, None)
            self.on = False

    def resume(self) -> None:
        if not self.on:
            self.callback.collector.__enter__()
            self.on = True


def bergson_rows(capture: GradientCollectorCallback, examples: int) -> int:
    """Rows of bergson's index that hold a gradient (non-zero), after checking its width."""
    rows = np.asarray(capture.train_grad_buffer[:examples]).reshape(examples, -1)
    if rows.shape[1] != DIM:
        raise SystemExit(f"bergson captured {rows.shape[1]} dims per example, not {DIM}: not the same workload")
    return int(np.count_nonzero((rows != 0).any(axis=1)))


def run(arm: str, pairs: int, warmup: int) -> tuple[PairedSteps, int]:
    """One Trainer run of ``arm`` with paired plain / captured steps; returns the timer and the rows captured."""
    steps = warmup + 2 * pairs
    adam = arm.endswith("adam")
    with tempfile.TemporaryDirectory() as tmp:
        if arm.startswith("gradstore"):
            store = gradstore.open(os.path.join(tmp, "store"))
            capture, timer = paired_gradstore(store, warmup, "adam_factored" if adam else None)
            collator = with_example_ids(collate)
        else:
            capture = GradientCollectorCallback(Path(tmp) / "bergson", use_optimizer_state=adam)
            switch = BergsonSwitch(capture)
            timer = PairedSteps(warmup, pause=switch.pause, resume=switch.resume)
            collator = collate
        trainer = workload_trainer(tmp, steps, capture, timer, collator)
        if arm.startswith("bergson"):
            prepare_for_gradient_collection(trainer)
        trainer.train()
        if arm.startswith("gradstore"):
            if store.dim != DIM:
                raise SystemExit(f"gradstore captured {store.dim} dims per example, not {DIM}")
            return timer, store.count()
        return timer, bergson_rows(capture, steps * BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20, help="measured pairs per run (WORKLOADS: >= 20)")
    parser.add_argument("--warmup", type=int, default=2, help="captured steps before the measured pairs")
    parser.add_argument("--repeats", type=int, default=3, help="cycles of one run per arm; result = their median")
    parser.add_argument("--adam", action="store_true", help="add both tools' Adam-normalised arms")
    opts = parser.parse_args()
    torch.set_num_threads(2)
    arms = ["bergson", "gradstore"] + (["bergson_adam", "gradstore_adam"] if opts.adam else [])
    medians: dict[str, list[float]] = {arm: [] for arm in arms}
    rows_ok = True
    for cycle in range(opts.repeats):
        for arm in arms:
            timer, rows = run(arm, opts.pairs, opts.warmup)
            ratios = timer.ratios()
            medians[arm].append(statistics.median(ratios))
            # gradstore's Adam-normalised rows start once the optimizer holds second moments: step 1 has none.
            expected = (opts.warmup + opts.pairs - (arm == "gradstore_adam")) * BATCH
            rows_ok = rows_ok and rows == expected
            print(
                f"cycle {cycle} {arm}: median ratio {medians[arm][-1]:.3f}; rows {rows} (expected {expected}); "
                f"median step plain {statistics.median(timer.plain) * 1e3:.0f} ms, captured "
                f"{statistics.median(timer.captured) * 1e3:.0f} ms; pair ratios {[round(x, 3) for x in ratios]}",
                flush=True,
            )
    if opts.adam:
        adam = [g / b for g, b in zip(medians["gradstore_adam"], medians["bergson_adam"])]
        per_cycle = [round(x, 3) for x in adam]
        print(f"capture_hf_adam_vs_bergson_adam={statistics.median(adam):.3f} (per cycle {per_cycle})")
    report_against_peer(medians, "gradstore", "bergson", "capture_hf_vs_bergson", rows_ok)


if __name__ == "__main__":
    main()
