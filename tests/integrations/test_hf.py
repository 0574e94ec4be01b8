"""Hugging Face Trainer and TRL SFTTrainer capture through GradstoreCallback, on a tiny GPT-2 built in code:
row counts, steps, epochs, learning rates, ids, exactness against a plain capture, gradient checkpointing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from tiny_models import collate, tiny_gpt2, token_dataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import gradstore  # noqa: E402
from gradstore.hf import GradstoreCallback, with_example_ids  # noqa: E402

N, SEQ, LR = 12, 16, 1e-3
OPTIONS = {"projection": "factorized", "k_in": 8, "k_out": 8}


def train_with_callback(tmp_path, store, run: str, **arguments) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / run),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        remove_unused_columns=False,
        use_cpu=True,
        seed=0,
        logging_strategy="no",
        disable_tqdm=True,
        **arguments,
    )
    callback = GradstoreCallback(store, run, **OPTIONS)
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=token_dataset(N, SEQ),
        data_collator=with_example_ids(collate),
        callbacks=[callback],
    )
    trainer.train()
    assert callback.capture is None  # closed at on_train_end
    return trainer


def rows(store, run: str) -> dict[tuple[str, int], tuple[np.ndarray, int, float]]:
    block = store.read_gradients(run, columns=("example_id", "step", "epoch", "learning_rate"))
    meta = block.metadata.to_pydict()
    keys = list(zip(meta["example_id"], meta["step"]))
    assert len(set(keys)) == len(keys), "duplicated rows"
    return {k: (v, e, lr) for k, v, e, lr in zip(keys, block.vectors, meta["epoch"], meta["learning_rate"])}


def reference_rows(batch: dict[str, torch.Tensor], ids: list[str], tmp_path, **options) -> dict[str, np.ndarray]:
    """Per-example rows of the initial model on one batch, from a plain capture loop."""
    store = gradstore.open(tmp_path / "reference", storage_dtype="float32")
    model = tiny_gpt2()
    with store.capture(model, "ref", loss_reduction="token_mean", **OPTIONS, **options) as cap:
        cap.set_ids(ids)
        model(**batch).loss.backward()
    block = store.read_gradients("ref")
    return dict(zip(block.metadata.column("example_id").to_pylist(), block.vectors))


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hf")
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    train_with_callback(tmp_path, store, "plain")
    return tmp_path, store, rows(store, "plain")


def test_trainer_rows_have_the_trainers_steps_epochs_and_learning_rates(plain_run):
    _, store, got = plain_run
    steps_per_epoch, total = N // 4, 2 * N // 4  # batch 2 x accumulation 2
    assert len(got) == 2 * N
    per_step = {}
    for (example_id, step), (_, epoch, lr) in got.items():
        per_step.setdefault(step, []).append(example_id)
        assert epoch == step // steps_per_epoch
        assert lr == pytest.approx(LR * (total - step) / total, rel=1e-6)  # linear schedule, no warm-up
    assert sorted(per_step) == list(range(total)) and all(len(ids) == 4 for ids in per_step.values())
    for epoch in range(2):  # every example exactly once per epoch
        seen = [i for s in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch) for i in per_step[s]]
        assert sorted(seen) == sorted(f"ex{i}" for i in range(N))
    checkpoints = store.checkpoints("plain").to_pydict()
    assert sorted(checkpoints["checkpoint"]) == ["checkpoint-3", "checkpoint-6", "train"]


def test_trainer_rows_equal_a_plain_capture_of_the_same_examples(plain_run):
    tmp_path, _, got = plain_run
    step0 = sorted(example_id for example_id, step in got if step == 0)
    data = token_dataset(N, SEQ).to_dict()
    index = [data["example_id"].index(i) for i in step0]
    batch = collate([{"input_ids": data["input_ids"][j], "labels": data["labels"][j]} for j in index])
    reference = reference_rows(batch, step0, tmp_path)
    for example_id in step0:  # accumulated micro-batches and token-mean scaling undone
        vector = got[(example_id, 0)][0]
        assert np.linalg.norm(vector - reference[example_id]) <= 1e-5 * np.linalg.norm(reference[example_id])


def test_gradient_checkpointing_gives_the_same_rows(plain_run):
    tmp_path, store, plain = plain_run
    train_with_callback(tmp_path, store, "checkpointed", activation_checkpointing=True)
    checkpointed = rows(store, "checkpointed")
    assert set(checkpointed) == set(plain)
    for key, (vector, _, _) in plain.items():
        assert np.linalg.norm(checkpointed[key][0] - vector) <= 1e-5 * np.linalg.norm(vector), key


def test_ids_need_remove_unused_columns_false(tmp_path):
    with pytest.raises(KeyError, match="remove_unused_columns=False"):
        with_example_ids(collate)([{"input_ids": [1, 2], "labels": [1, 2]}])


def test_trl_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(4, 12, (8,), generator=gen).tolist()  # padded batches of mixed lengths
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(0, 61, (n,), generator=gen)) for n in lengths]
    dataset = datasets.Dataset.from_dict({"text": texts, "example_id": [f"t{i}" for i in range(8)]})
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        remove_unused_columns=False,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        max_length=32,
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        bf16=False,
    )  # TRL turns bf16 autocast on by default
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    model = tiny_gpt2()
    # TRL divides its loss by the Trainer's token count without passing it to the model, so capture recounts
    # per micro-batch: the Trainer must count the shifted label tokens, as the loss does (see docs/integrations.md)
    model.loss_type = "ForCausalLM"
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        data_collator=with_example_ids(collator),
        callbacks=[GradstoreCallback(store, "sft", **OPTIONS)],
    )
    trainer.train()
    assert "lm_head" not in [slot.name for slot in store.core.run_spec("sft").layers]
    got = rows(store, "sft")
    assert len(got) == 16
    assert sorted(i for i, _ in got) == sorted(f"t{i}" for i in range(8) for _ in range(2))  # once per epoch
    assert {s for _, s in got} == {0, 1, 2, 3}
    assert all(epoch == step // 2 and lr == pytest.approx(LR) for (_, step), (_, epoch, lr) in got.items())
    # step-0 rows equal a plain capture of the same tokenized, padded examples with the initial weights
    step0 = sorted(i for i, s in got if s == 0)
    prepared = {row["example_id"]: row for row in trainer.train_dataset}
    batch = collator([{k: prepared[i][k] for k in ("input_ids", "labels")} for i in step0])
    # TRL's fused LM head bypasses the lm_head module: the callback leaves it out of the rows
    reference = reference_rows(dict(batch), step0, tmp_path, exclude="^lm_head$")
    for example_id in step0:
        vector = got[(example_id, 0)][0]
        assert np.linalg.norm(vector - reference[example_id]) <= 1e-5 * np.linalg.norm(reference[example_id])


def test_token_mean_counts_a_masked_lms_labels_unshifted():
    """``loss_reduction="token_mean"`` counted every model's labels shifted by one (a causal LM's): a masked LM's
    rows (its loss averages over unshifted label tokens) were off by each example's count ratio (3-5%, silent)."""
    import transformers

    from ingest.capture import CaptureConfig, GradientCapture
    from ingest.scaling import shifts_labels

    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=20, pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.RobertaForMaskedLM(config).train()
    mask = (torch.arange(8)[None] < torch.tensor([[8], [5], [7]])).long()
    ids = torch.randint(3, 64, (3, 8)).masked_fill(mask == 0, 1)
    labels = torch.randint(3, 64, (3, 8)).masked_fill(mask == 0, -100)
    labels[0, 0] = -100  # the first label counts unshifted; make the counts differ from the shifted ones
    dense = model.lm_head.dense
    want = []
    for i in range(3):
        model.zero_grad()
        model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1], labels=labels[i : i + 1]).loss.backward()
        want.append(torch.cat([dense.weight.grad, dense.bias.grad[:, None]], 1).flatten())
    out: list = []
    config = CaptureConfig.from_options(projection=None, loss_reduction="token_mean", include="lm_head.dense")
    with GradientCapture(model, out.append, config):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    torch.testing.assert_close(out[0].grads, torch.stack(want), rtol=1e-4, atol=1e-7)
    t5 = transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    assert not shifts_labels(model) and not shifts_labels(transformers.T5ForConditionalGeneration(t5))
    assert shifts_labels(tiny_gpt2()) and shifts_labels(torch.nn.Linear(2, 2))
