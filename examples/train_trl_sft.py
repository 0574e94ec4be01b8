"""Capture per-example gradients during TRL ``SFTTrainer`` (CPU, tiny GPT-2 and word-level tokenizer in code).

    python examples/train_trl_sft.py [STORE]

TRL's fused LM head bypasses the ``lm_head`` module, so the callback leaves that layer out of the rows.
TRL divides its loss by a token count that it does not pass to the model (the callback takes it from the
Trainer): set ``model.loss_type`` so the Trainer counts shifted label tokens, as the loss does (see
docs/integrations.md). Gradient accumulation and several ranks give exact rows too:

    torchrun --nproc_per_node 2 examples/train_trl_sft.py STORE
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

import gradstore
from gradstore.hf import GradstoreCallback, with_example_ids


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main(store_path: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64))
    model.loss_type = "ForCausalLM"
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(0, 61, (int(n),))) for n in torch.randint(4, 20, (24,))]
    data = datasets.Dataset.from_dict({"text": texts, "example_id": [f"sft-{i}" for i in range(24)]})
    store = gradstore.open(store_path)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun one rank adds them: concurrent upserts can duplicate ids
        store.add_examples(data, id_column="example_id")
    args = SFTConfig(
        output_dir=os.path.join(store_path, "..", "sft-out"),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        learning_rate=1e-3,
        max_length=32,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        remove_unused_columns=False,
        logging_strategy="no",
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tiny_tokenizer(),
        data_collator=with_example_ids(DataCollatorForLanguageModeling(pad_token_id=0)),
        callbacks=[GradstoreCallback(store, run="sft-demo")],
    )
    trainer.train()
    print(
        store.sql(
            "SELECT g.step, g.example_id, g.num_tokens, e.text FROM gradients g JOIN examples e "
            "USING (example_id) ORDER BY g.step, g.example_id LIMIT 8"
        )
        .df()
        .to_string(index=False)
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "store"))
