"""LoRA fine-tuning (PEFT) under ``store.capture``: only the trainable adapters are captured, then attribution.

What it shows:
1. a ``peft`` LoRA model (rank-4 adapters on a tiny GPT-2 built in code, no downloads) trained by a plain PyTorch
   loop under ``store.capture``: the frozen base layers are skipped by default (``include_frozen=True`` would add
   them), so each row holds the projected per-example gradients of the ``lora_A``/``lora_B`` weights only;
2. a checkpoint pass after training (training rows and query rows at checkpoint ``"final"``) and
   ``store.attribute(method="cosine")``: a query that repeats a training document finds that document as its
   top proponent.

Run (CPU, a few seconds):

    python examples/train_lora.py --store /tmp/lora [--quick]

The store directory must be new or empty.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _toy
import peft
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gradstore


def main(store_path: str, *, n_train: int, epochs: int, n_queries: int = 3) -> None:
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64))
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    model = peft.get_peft_model(base, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable parameters: {trainable} of {sum(p.numel() for p in model.parameters())}")

    docs = torch.randint(0, 64, (n_train, 16), generator=torch.Generator().manual_seed(1))
    ids = [f"doc-{i}" for i in range(n_train)]
    store = gradstore.open(store_path)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    options = {"projection": "factorized", "k_in": 4, "k_out": 4, "loss_reduction": "token_mean"}
    with store.capture(model, "lora", optimizer=opt, **options) as cap:
        for epoch in range(epochs):
            cap.set_epoch(epoch)
            for start in range(0, n_train, 8):
                cap.set_ids(ids[start : start + 8])
                batch = docs[start : start + 8]
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad()
    layers = [slot.name for slot in store.core.run_spec("lora").layers]
    print(f"captured layers: {len(layers)}, all LoRA adapters: {all('.lora_' in n for n in layers)}")

    # checkpoint pass with the trained adapters: training rows and query rows at checkpoint "final"
    queries = docs[:n_queries]  # each query repeats a training document
    with store.capture(model, "lora", checkpoint="final") as cap:
        for start in range(0, n_train, 8):
            cap.set_ids(ids[start : start + 8])
            batch = docs[start : start + 8]
            model(input_ids=batch, labels=batch).loss.backward()
            model.zero_grad()
    with store.capture(model, "lora", checkpoint="final", split="query") as cap:
        cap.set_ids([f"query-{i}" for i in range(n_queries)])
        model(input_ids=queries, labels=queries).loss.backward()
        model.zero_grad()
    table = store.attribute(run="lora", checkpoint="final", k=3, method="cosine").to_pandas()
    found = 0
    for i in range(n_queries):
        top = table[table.query_id == f"query-{i}"].sort_values("rank").example_id.tolist()
        print(f"query-{i} (repeats doc-{i}): top proponents {top}")
        found += top[0] == f"doc-{i}"
    print(f"top-1 proponent is the repeated training document: {found} of {n_queries}")


if __name__ == "__main__":
    _toy.run_example(__doc__, main, quick=dict(n_train=32, epochs=2), full=dict(n_train=128, epochs=4))
