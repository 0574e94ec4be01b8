"""W-capture through the Hugging Face Trainer: step time with GradstoreCallback / without it.

The workload of WORKLOADS.md (GPT-2 4 x 256, batches of 16 x 128 random tokens, AdamW lr 1e-4), trained by
``transformers.Trainer``; the callback captures the 16 Linear/Conv1D layers of the blocks at 16 x 16 into a
real store (float16 rows, default writer). Pairing arms step by step inside one Trainer is impractical (the
callback owns the capture for the whole ``train()``), so whole Trainer runs alternate: plain, captured,
plain, captured... on the same batches. Each run's step times (``on_step_begin`` -> ``on_step_end``: forward,
backward, optimizer step, zero_grad) after its warm-up steps give a median; the ratio of each captured run
to the plain run just before it is one paired ratio; the result is their median.

    python bench/capture_hf.py [--rounds 4] [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Run as a script, this folder comes first on sys.path, where bench/ingest.py would shadow the ingest package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

import gradstore  # noqa: E402
from gradstore.hf import GradstoreCallback, with_example_ids  # noqa: E402

BATCH, SEQ, VOCAB = 16, 128, 512


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.times.append(time.perf_counter() - self._start)


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=VOCAB))


def dataset(steps: int) -> datasets.Dataset:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (steps * BATCH, SEQ), generator=gen).tolist()
    return datasets.Dataset.from_dict({"input_ids": tokens, "example_id": [f"ex{i}" for i in range(len(tokens))]})


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": ids}


def run(data: datasets.Dataset, steps: int, out: str, store=None, name: str = "") -> list[float]:
    timer = StepTimer()
    callbacks = [timer] if store is None else [GradstoreCallback(store, name, include=r"^transformer\.h\.",
                                                                 layer_types=("conv1d", "linear")), timer]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=1e-4,
                             optim="adamw_torch", lr_scheduler_type="constant", weight_decay=0.0,
                             save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    Trainer(model=model(), args=args, train_dataset=data, data_collator=with_example_ids(collate),
            callbacks=callbacks).train()
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per Trainer run")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each run left out of its median")
    opts = parser.parse_args()
    torch.set_num_threads(2)
    data = dataset(opts.steps)
    with tempfile.TemporaryDirectory() as tmp:
        store = gradstore.open(os.path.join(tmp, "store"))
        ratios, plain_all, captured_all = [], [], []
        for r in range(opts.rounds):
            plain = run(data, opts.steps, os.path.join(tmp, "out"))[opts.warmup:]
            captured = run(data, opts.steps, os.path.join(tmp, "out"), store, f"bench-{r}")[opts.warmup:]
            plain_all += plain
            captured_all += captured
            ratios.append(statistics.median(captured) / statistics.median(plain))
            print(f"round {r}: plain {statistics.median(plain) * 1e3:.0f} ms/step, "
                  f"captured {statistics.median(captured) * 1e3:.0f} ms/step, ratio {ratios[-1]:.3f}", flush=True)
        rows = store.count()
        dim = store.dim
    expected = opts.rounds * opts.steps * BATCH
    print(f"rows written {rows} (expected {expected}), dim {dim}, measured steps per arm {len(plain_all)}")
    print(f"median step: plain {statistics.median(plain_all) * 1e3:.0f} ms, captured "
          f"{statistics.median(captured_all) * 1e3:.0f} ms; paired run ratios {[round(x, 3) for x in ratios]}")
    ratio = statistics.median(ratios)
    ok = ratio <= 1.05 and rows == expected
    print(f"RESULT capture_hf_overhead={ratio:.3f} target<=1.05 {'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
