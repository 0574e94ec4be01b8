"""The HF Trainer and TRL's SFTTrainer under ``torchrun --nproc_per_node 2`` (gloo, CPU, a tiny GPT-2 built in
code), both ranks writing to one store through GradstoreCallback.

What is compared:

* Trainer (SGD, 2 ranks x batch 2 x accumulation 2 = 8 examples a step): every (example, step) row is present
  exactly once, half from each rank, and equals the row of a single-process run with the same global batch
  (batch 4 x accumulation 2) at the same step, for *every* step: DDP keeps the weights identical on the ranks
  and, with ``average_tokens_across_devices``, the update equals the single-process one, so the weights at each
  step are the single-process weights (up to float rounding).
* SFTTrainer (TRL's fused LM head, SGD, 2 ranks x batch 1 x accumulation 2, the default
  ``average_tokens_across_devices=True``):
  every row present exactly once, half from each rank; the rows of step 0 (initial weights) equal a plain capture
  of the same examples, and the rows of every step equal a single-process run with batch 4 (the token count that
  TRL divides by never reaches the model: the callback takes it from the Trainer's ``compute_loss``).
* SFTTrainer with ``average_tokens_across_devices=False`` on 2 ranks: every row once, step-0 rows equal the
  single-process run's (later steps are not compared: with mixed lengths, DDP's mean of per-rank token means is
  not the single-process token mean, so the weights differ).
* SFTTrainer with gradient accumulation 2 on one process (batch 2): rows of every step equal the batch-4 run's.
* Outside a Trainer (no ``compute_loss`` to take the count from) the fused LM head with accumulation is refused
  with a message that says what to change.

The test file is also the worker: ``torchrun ... tests/integrations/test_trainer_ranks.py OUT``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("LANCE_LOG", "error")

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

sys.path.insert(0, str(Path(__file__).parents[1] / "support"))
from tiny_models import collate, tiny_gpt2, token_dataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import gradstore  # noqa: E402
from gradstore.hf import GradstoreCallback, with_example_ids  # noqa: E402

WORLD, N, SEQ, LR = 2, 16, 12, 0.05
N_SFT = 8
OPTIONS = {"projection": "factorized", "k_in": 8, "k_out": 8}
HANG_GUARD_S = 300


# ---------------------------------------------------------------------------------------------- shared set-up
def train_trainer(out: Path, store, run: str, batch: int, **arguments) -> None:
    args = TrainingArguments(
        output_dir=str(out / run),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=LR,
        optim="sgd",  # Adam's first steps amplify rounding in near-zero gradients
        lr_scheduler_type="linear",
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        remove_unused_columns=False,
        use_cpu=True,
        seed=0,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **arguments,
    )
    model = tiny_gpt2()
    Trainer(
        model=model,
        args=args,
        train_dataset=token_dataset(N, SEQ),
        data_collator=with_example_ids(collate),
        callbacks=[GradstoreCallback(store, run, commit_every=2, **OPTIONS)],
    ).train()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def sft_dataset() -> datasets.Dataset:
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(4, 12, (N_SFT,), generator=gen).tolist()  # padded batches of mixed lengths
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(0, 61, (n,), generator=gen)) for n in lengths]
    return datasets.Dataset.from_dict({"text": texts, "example_id": [f"t{i}" for i in range(N_SFT)]})


def sft_trainer(out: Path, store, run: str, **arguments):
    import trl
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    settings = {
        "per_device_train_batch_size": 2,
        "num_train_epochs": 2,
        **arguments,
    }
    args = trl.SFTConfig(
        output_dir=str(out / run),
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        remove_unused_columns=False,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        max_length=32,
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        bf16=False,  # TRL turns bf16 autocast on by default
        **settings,
    )
    model = tiny_gpt2()
    model.loss_type = "ForCausalLM"  # the Trainer counts shifted label tokens, as the loss does
    return trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=sft_dataset(),
        processing_class=tiny_tokenizer(),
        data_collator=with_example_ids(DataCollatorForLanguageModeling(pad_token_id=0)),
        callbacks=[GradstoreCallback(store, run, **OPTIONS)],
    )


# ------------------------------------------------------------------------------------------------- the worker
def worker(out: Path) -> None:
    """One rank of the torchrun job: the Trainer run, then the SFTTrainer run, into one store."""
    torch.set_num_threads(1)
    store = gradstore.open(out / "store", storage_dtype="float32")
    train_trainer(out, store, "trainer", batch=2, ddp_backend="gloo")
    rank = torch.distributed.get_rank()
    # 2 ranks x 1 example x 2 micro-batches: the token count spans micro-batches and ranks
    trainer = sft_trainer(
        out, store, "sft", ddp_backend="gloo", per_device_train_batch_size=1, gradient_accumulation_steps=2
    )
    trainer.train()
    if rank == 0:
        prepared = {row["example_id"]: row["input_ids"] for row in trainer.train_dataset}
        (out / "sft_prepared.json").write_text(json.dumps(prepared))
    torch.distributed.barrier()
    sft_trainer(out, store, "sft-local", ddp_backend="gloo", average_tokens_across_devices=False).train()
    torch.distributed.destroy_process_group()


# -------------------------------------------------------------------------------------------------- the tests
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One torchrun job with 2 gloo ranks (process start-up and imports dominate on a small CPU)."""
    pytest.importorskip("trl")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    out = tmp_path_factory.mktemp("trainer_ranks")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={WORLD}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        __file__,
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # a session of its own: the hang guard ends torchrun and its ranks together
    job = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = job.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"the torchrun job hung (killed after {HANG_GUARD_S} s): {stderr[-8000:]}")
    assert job.returncode == 0, stdout[-4000:] + stderr[-8000:]
    return out, gradstore.open(out / "store")


def rows(store, run: str) -> dict[tuple[str, int], np.ndarray]:
    block = store.read_gradients(run, columns=("example_id", "step"))
    meta = block.metadata.to_pydict()
    keys = list(zip(meta["example_id"], meta["step"]))
    assert len(set(keys)) == len(keys), "duplicated rows"
    return dict(zip(keys, block.vectors))


def close(a: np.ndarray, b: np.ndarray, rtol: float = 1e-5) -> bool:
    return float(np.linalg.norm(a - b)) <= rtol * float(np.linalg.norm(b))


def test_trainer_ranks_write_every_row_once_equal_to_a_single_process_run(job, tmp_path):
    out, store = job
    got = rows(store, "trainer")
    steps = 2 * N // 8  # 2 epochs, 8 examples an optimizer step
    assert len(got) == 2 * N and {s for _, s in got} == set(range(steps))
    for epoch in range(2):  # every example exactly once per epoch
        seen = sorted(i for i, s in got if s // (N // 8) == epoch)
        assert seen == sorted(f"ex{i}" for i in range(N))
    per_rank = store.sql(
        "SELECT rank, count(*) FROM gradients WHERE run_id = 'trainer' GROUP BY rank ORDER BY rank"
    ).fetchall()
    assert per_rank == [(0, N), (1, N)]
    assert sorted(store.checkpoints("trainer").to_pydict()["checkpoint"]) == ["checkpoint-2", "checkpoint-4", "train"]

    single = gradstore.open(tmp_path / "single", storage_dtype="float32")
    train_trainer(tmp_path, single, "single", batch=WORLD * 2)  # the same global batch on one process
    reference = rows(single, "single")
    assert set(got) == set(reference)  # the same examples at the same steps
    for key, vector in reference.items():  # at every step: the weights are the single-process weights
        assert close(got[key], vector, 1e-4), key


@pytest.fixture(scope="module")
def sft_single(tmp_path_factory):
    """A single-process SFTTrainer run with batch 4: the global batch of 2 ranks x 2, or of 2 micro-batches x 2."""
    pytest.importorskip("trl")
    tmp_path = tmp_path_factory.mktemp("sft_single")
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    sft_trainer(tmp_path, store, "single", per_device_train_batch_size=4).train()
    return rows(store, "single")


def test_sft_trainer_ranks_write_every_row_once_equal_to_a_single_process_run(job, sft_single, tmp_path):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    out, store = job
    got = rows(store, "sft")
    assert sorted(i for i, _ in got) == sorted(f"t{i}" for i in range(N_SFT) for _ in range(2))  # once per epoch
    assert {s for _, s in got} == {0, 1, 2, 3}
    per_rank = store.sql("SELECT rank, count(*) FROM gradients WHERE run_id = 'sft' GROUP BY rank").fetchall()
    assert sorted(per_rank) == [(0, N_SFT), (1, N_SFT)]
    assert "lm_head" not in [slot.name for slot in store.core.run_spec("sft").layers]

    # step 0: a plain capture of the same tokenized, padded examples with the initial weights
    prepared = json.loads((out / "sft_prepared.json").read_text())
    step0 = sorted(i for i, s in got if s == 0)
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    batch = dict(collator([{"input_ids": prepared[i]} for i in step0]))
    reference_store = gradstore.open(tmp_path / "reference", storage_dtype="float32")
    model = tiny_gpt2()
    with reference_store.capture(model, "ref", loss_reduction="token_mean", exclude="^lm_head$", **OPTIONS) as cap:
        cap.set_ids(step0)
        model(**batch).loss.backward()
    block = reference_store.read_gradients("ref")
    reference = dict(zip(block.metadata.column("example_id").to_pylist(), block.vectors))
    for example_id in step0:
        assert close(got[(example_id, 0)], reference[example_id]), example_id

    # every step: the single-process run with the same global batch
    assert set(got) == set(sft_single)
    for key, vector in sft_single.items():
        assert close(got[key], vector, 1e-4), key


def test_sft_trainer_ranks_without_token_averaging(job, sft_single):
    _, store = job
    got = rows(store, "sft-local")
    assert sorted(i for i, _ in got) == sorted(f"t{i}" for i in range(N_SFT) for _ in range(2))
    assert set(got) == set(sft_single)
    for key, vector in sft_single.items():
        if key[1] == 0:  # the initial weights; later steps train on a mean of per-rank token means
            assert close(got[key], vector), key


def test_sft_trainer_gradient_accumulation_rows_equal_one_large_batch(sft_single, tmp_path):
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    trainer = sft_trainer(tmp_path, store, "accumulated", gradient_accumulation_steps=2)
    trainer.train()
    assert "compute_loss" not in trainer.__dict__  # the callback's wrapper is gone after training
    got = rows(store, "accumulated")
    assert set(got) == set(sft_single)
    for key, vector in sft_single.items():
        assert close(got[key], vector, 1e-4), key


def test_fused_lm_head_with_accumulation_outside_a_trainer_is_refused_with_what_to_change(tmp_path):
    from transformers import TrainerControl, TrainerState

    model = tiny_gpt2()
    original = model.forward

    def fused_forward(*args, fused_lm_head: bool = False, **kwargs):  # the signature TRL patches in
        return original(*args, **kwargs)

    model.forward = fused_forward
    args = TrainingArguments(str(tmp_path / "out"), gradient_accumulation_steps=2, use_cpu=True, report_to=[])
    callback = GradstoreCallback(gradstore.open(tmp_path / "store"), "refused", **OPTIONS)
    with pytest.raises(gradstore.GradstoreError, match="gradient_accumulation_steps=1"):
        callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert callback.capture is None


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
