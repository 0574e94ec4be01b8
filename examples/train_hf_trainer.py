"""Capture per-example gradients during a Hugging Face ``Trainer`` run (CPU, tiny GPT-2 built in code).

python examples/train_hf_trainer.py [STORE]
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gradstore
from gradstore.hf import GradstoreCallback, with_example_ids


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": ids}


def main(store_path: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64))
    tokens = torch.randint(0, 64, (32, 16)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": tokens, "example_id": [f"doc-{i}" for i in range(32)]})
    store = gradstore.open(store_path)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun one rank adds them: concurrent upserts can duplicate ids
        store.add_examples(data.remove_columns("input_ids"), id_column="example_id")
    args = TrainingArguments(
        output_dir=os.path.join(store_path, "..", "trainer-out"),
        per_device_train_batch_size=8,
        num_train_epochs=2,
        learning_rate=1e-3,
        save_strategy="epoch",
        report_to=[],
        use_cpu=True,
        remove_unused_columns=False,  # keep the example_id column
        logging_strategy="no",
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=with_example_ids(collate),
        callbacks=[GradstoreCallback(store, run="hf-demo")],
    )
    trainer.train()
    print(
        store.sql(
            "SELECT step, epoch, round(learning_rate, 6) AS lr, count(*) AS rows FROM gradients "
            "GROUP BY ALL ORDER BY step"
        )
        .df()
        .to_string(index=False)
    )
    print(store.sql("SELECT checkpoint, step, epoch FROM checkpoints ORDER BY step").df().to_string(index=False))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "store"))
