"""Capture never stops training for a data condition (issue 27): a step a GradScaler skips, or one whose loss or
gradients are NaN/Inf, is not written but listed in ``skipped_steps`` (with one warning); ``on_nonfinite="raise"``
stops at the backward that produced it; mixed-precision rows (fp16 + GradScaler, bf16 autocast) equal an fp32
loop's; the Hugging Face callback finds the Trainer's scaler."""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradstore
from gradstore.errors import GradstoreError, InvalidArgumentError, NonFiniteGradientError
from ingest.capture import SkippedStepWarning

BATCHES, BATCH = 6, 4
IDS = [[f"b{i}-{j}" for j in range(BATCH)] for i in range(BATCHES)]
_gen = torch.Generator().manual_seed(0)
X = torch.randn(BATCHES, BATCH, 6, generator=_gen)
Y = torch.randint(0, 3, (BATCHES, BATCH), generator=_gen)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def optimizer_of(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # steps even when the scaler skips


def train(
    store,
    run: str,
    steps: list[list[int]],
    *,
    scaler: torch.amp.GradScaler | None = None,
    autocast: torch.dtype | None = None,
    overflow: tuple[int, ...] = (),
    nan: tuple[int, ...] = (),
    optimizer: str = "sgd",
    reached: list[int] | None = None,
    **options,
) -> None:
    """Train ``mlp()`` on the micro-batches of each step under capture. ``overflow`` batches multiply their loss
    by 1e38 (the scaled loss is inf); ``nan`` batches hold one NaN input. A step whose loss is not finite is not
    applied without a scaler (the common ``if not loss.isfinite(): skip`` guard)."""
    model = mlp()
    opt = optimizer_of(model, optimizer)
    with store.capture(model, run, optimizer=opt, projection=None, grad_scaler=scaler, **options) as cap:
        for step in steps:
            finite = True
            for i in step:
                x = X[i].clone()
                if i in nan:
                    x[1, 0] = float("nan")
                cap.set_ids(IDS[i])
                with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
                    loss = F.cross_entropy(model(x), Y[i])
                if i in overflow:
                    loss = loss * 1e38
                finite &= bool(torch.isfinite(loss))
                (scaler.scale(loss) if scaler is not None else loss).backward()
                if reached is not None:
                    reached.append(i)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            elif finite:
                opt.step()
            opt.zero_grad()


def stored(store, run: str) -> dict[str, tuple[np.ndarray, int]]:
    """``example_id -> (row, step)`` of a run; every stored value finite."""
    block = store.read_gradients(run, columns=("example_id", "step"))
    assert np.isfinite(block.vectors).all()
    meta = block.metadata.to_pydict()
    assert len(set(meta["example_id"])) == len(meta["example_id"])
    return {i: (row, step) for i, row, step in zip(meta["example_id"], block.vectors, meta["step"])}


def skipped(store, run: str) -> list[dict]:
    return (
        store.sql(
            "select step, reason, example_ids, n_rows, n_nonfinite, split, checkpoint, rank from skipped_steps "
            f"where run_id = '{run}' order by created_at"
        )
        .to_arrow_table()
        .to_pylist()
    )


def skip_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, SkippedStepWarning)]


def relative_errors(got: dict, want: dict) -> list[float]:
    return [float(np.linalg.norm(got[i][0] - want[i][0]) / np.linalg.norm(want[i][0])) for i in want]


@pytest.fixture
def store(tmp_path):
    return gradstore.open(tmp_path / "store", storage_dtype="float32")


@pytest.mark.parametrize("optimizer", ["sgd", "fused_adamw"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_grad_scaler_overflow_step_is_skipped_recorded_and_the_finite_rows_equal_fp32(store, optimizer, accumulation):
    """An overflow step (the scaled loss is inf) is skipped by the scaler: none of its micro-batches' rows are
    stored (also a finite micro-batch of the same accumulated step), it is listed in skipped_steps, and the rows
    of every other step equal an fp32 loop's that leaves that step out."""
    steps = [list(range(s, s + accumulation)) for s in range(0, BATCHES, accumulation)]
    bad_step = steps[1]
    overflow = (bad_step[-1],)  # with accumulation, the step's first micro-batch is finite
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        train(store, "amp", steps, scaler=scaler, overflow=overflow, optimizer=optimizer)
    assert scaler.get_scale() == 2.0**9  # the scaler did back off once
    train(store, "fp32", [s for s in steps if s != bad_step], optimizer=optimizer)
    got, want = stored(store, "amp"), stored(store, "fp32")
    assert set(got) == set(want) == {i for s in steps if s != bad_step for b in s for i in IDS[b]}
    for example_id in want:
        np.testing.assert_allclose(got[example_id][0], want[example_id][0], rtol=1e-5, atol=1e-7)
        if optimizer == "sgd":  # a fused optimizer's step() also runs (and counts) on the skipped step
            assert got[example_id][1] == want[example_id][1]
    records = skipped(store, "amp")
    assert [r["example_ids"] for r in records] == [IDS[b] for b in bad_step]
    assert all(r["reason"] == "grad_scaler_overflow" and r["n_rows"] == BATCH for r in records)
    assert all(r["step"] == 1 and r["split"] == "train" and r["checkpoint"] == "train" for r in records)
    assert records[-1]["n_nonfinite"] == BATCH and (accumulation == 1 or records[0]["n_nonfinite"] == 0)
    assert skipped(store, "fp32") == []
    assert len(skip_warnings(caught)) == 1 and "skipped_steps" in skip_warnings(caught)[0]


def test_a_float16_autocast_with_a_grad_scaler_matches_fp32_within_float16_precision(store):
    """Real mixed precision on the CPU (float16 autocast + GradScaler): unscaled rows of the finite steps."""
    steps = [[i] for i in range(BATCHES)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedStepWarning)
        train(store, "fp16", steps, scaler=torch.amp.GradScaler("cpu"), autocast=torch.float16, overflow=(3,))
    train(store, "fp32", [s for s in steps if s != [3]])
    got, want = stored(store, "fp16"), stored(store, "fp32")
    assert set(got) == set(want) and not set(IDS[3]) & set(got)
    assert max(relative_errors(got, want)) < 1e-2
    assert [r["reason"] for r in skipped(store, "fp16")] == ["grad_scaler_overflow"]


def test_b_a_nan_loss_step_without_a_scaler_is_skipped_with_one_warning(store):
    """Two batches with a NaN input: the loop finishes, neither batch is written (also their finite rows), both
    are listed, one warning is given; the other rows equal a loop without those batches."""
    steps = [[i] for i in range(BATCHES)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(store, "nan", steps, nan=(2, 4))
    messages = skip_warnings(caught)
    assert len(messages) == 1 and "step 2" in messages[0] and "NaN" in messages[0]
    train(store, "clean", [s for s in steps if s not in ([2], [4])])
    got, want = stored(store, "nan"), stored(store, "clean")
    assert set(got) == set(want) == {i for b in (0, 1, 3, 5) for i in IDS[b]}
    for example_id in want:
        np.testing.assert_allclose(got[example_id][0], want[example_id][0], rtol=1e-6, atol=1e-8)
        assert got[example_id][1] == want[example_id][1]
    records = skipped(store, "nan")
    assert [(r["step"], r["reason"], r["n_rows"], r["n_nonfinite"]) for r in records] == [
        (2, "nonfinite_gradient", BATCH, 1),
        (3, "nonfinite_gradient", BATCH, 1),
    ]
    assert [r["example_ids"] for r in records] == [IDS[2], IDS[4]]


def test_c_on_nonfinite_raise_stops_at_the_backward_that_produced_it(store):
    reached: list[int] = []
    with pytest.raises(GradstoreError) as info:
        train(store, "strict", [[i] for i in range(BATCHES)], nan=(2,), reached=reached, on_nonfinite="raise")
    assert isinstance(info.value, NonFiniteGradientError)
    assert "on_nonfinite='skip'" in str(info.value) and "b2-1" in str(info.value)
    assert reached == [0, 1]  # batch 2's backward raised
    assert set(stored(store, "strict")) == {i for b in (0, 1) for i in IDS[b]}  # what came before is kept
    assert skipped(store, "strict") == []


def test_c_an_unknown_on_nonfinite_is_refused(store):
    with pytest.raises(InvalidArgumentError, match="on_nonfinite must be one of"):
        store.capture(mlp(), "bad", on_nonfinite="drop")


def test_errors_not_about_the_data_still_stop_capture(store, monkeypatch):
    """Recording a skipped step on a full disk is not swallowed: the loop stops with the disk's error."""

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.core.results, "append_table", full)
    with pytest.raises(OSError, match="No space left"), warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedStepWarning)
        train(store, "full", [[i] for i in range(BATCHES)], nan=(2,))


def test_d_bfloat16_autocast_rows_match_fp32_within_bfloat16_precision(store):
    steps = [[i] for i in range(3)]
    train(store, "bf16", steps, autocast=torch.bfloat16)
    train(store, "fp32", steps)
    got, want = stored(store, "bf16"), stored(store, "fp32")
    assert set(got) == set(want) and len(got) == 3 * BATCH
    errors = relative_errors(got, want)
    assert max(errors) < 3e-2 and max(errors) > 0  # bf16 has 8 significant bits; it did run in bf16
    assert store.sql("select count(*) from skipped_steps").fetchall() == [(0,)]  # an empty view before any skip


# ---------------------------------------------------------------------------------------------- Hugging Face


def test_e_the_callback_takes_the_scaler_the_prepared_optimizer_holds():
    pytest.importorskip("transformers")
    from gradstore.hf import trainer_grad_scaler

    scaler = torch.amp.GradScaler("cpu")
    assert trainer_grad_scaler(SimpleNamespace(scaler=scaler, optimizer=object())) is scaler
    assert trainer_grad_scaler(SimpleNamespace(scaler=None)) is None  # fp32 / bf16: Accelerate makes none
    assert trainer_grad_scaler(torch.optim.SGD(mlp().parameters(), lr=0.1)) is None


N, SEQ = 8, 12


def hf_train(tmp_path, store, run: str, *, init_scale: float | None, epochs: int = 2) -> dict[int, bool]:
    """A tiny GPT-2 under a real Trainer (2 micro-batches of 2 per step, 2 steps per epoch). With ``init_scale`` it
    trains with ``fp16=True`` and a ``GradScaler`` where Accelerate keeps it (``accelerator.scaler``: Accelerate
    makes none on the CPU). Returns ``step -> whether the scaler skipped it`` (the scale dropped)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from tiny_models import tiny_gpt2

    from gradstore.hf import GradstoreCallback, with_example_ids

    tokens = torch.randint(0, 64, (N, SEQ), generator=torch.Generator().manual_seed(1)).tolist()
    dataset = datasets.Dataset.from_dict(
        {"input_ids": tokens, "labels": tokens, "example_id": [f"ex{i}" for i in range(N)]}
    )

    def collate(features):
        return {k: torch.tensor([f[k] for f in features]) for k in ("input_ids", "labels")}

    try:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / run),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_train_epochs=epochs,
            learning_rate=1e-3,
            save_strategy="no",
            report_to=[],
            remove_unused_columns=False,
            use_cpu=True,
            seed=0,
            logging_strategy="no",
            disable_tqdm=True,
            fp16=init_scale is not None,
        )
    except ValueError as error:  # a transformers that refuses fp16 on the CPU
        pytest.skip(f"this transformers has no fp16 training on the CPU: {error}")
    scales: dict[int, list[float]] = {}

    class Scales(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            scales[state.global_step] = [trainer.accelerator.scaler.get_scale()] if init_scale else [1.0]

        def on_step_end(self, args, state, control, **kwargs):
            scales[state.global_step - 1].append(trainer.accelerator.scaler.get_scale() if init_scale else 1.0)

    trainer = transformers.Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=dataset,
        data_collator=with_example_ids(collate),
        callbacks=[GradstoreCallback(store, run, projection="factorized", k_in=8, k_out=8), Scales()],
    )
    if init_scale is not None:
        if trainer.accelerator.scaler is None:
            trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        else:
            trainer.accelerator.scaler._init_scale = init_scale
    trainer.train()
    return {step: after < before for step, (before, after) in scales.items()}


def by_step(store, run: str) -> dict[tuple[str, int], np.ndarray]:
    block = store.read_gradients(run, columns=("example_id", "step"))
    assert np.isfinite(block.vectors).all()
    meta = block.metadata.to_pydict()
    return {(i, s): row for i, s, row in zip(meta["example_id"], meta["step"], block.vectors)}


@pytest.fixture(scope="module")
def hf_fp32(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hf_fp32")
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    hf_train(tmp_path, store, "fp32", init_scale=None)
    return by_step(store, "fp32")


def test_e_trainer_fp16_rows_are_unscaled_by_the_trainers_scaler(tmp_path, hf_fp32):
    """With fp16 the callback divides the Trainer's loss scale (1024) out: rows equal the fp32 Trainer's."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    skipped_by_scaler = hf_train(tmp_path, store, "fp16", init_scale=2.0**10)
    assert not any(skipped_by_scaler.values())
    got = by_step(store, "fp16")
    assert set(got) == set(hf_fp32) and len(got) == 2 * N
    for (example_id, step), row in hf_fp32.items():
        if step == 0:  # the same weights: the same rows
            np.testing.assert_allclose(got[example_id, step], row, rtol=1e-5, atol=1e-7)
        else:  # the Trainer's fp16 updates differ from its fp32 ones in the last bits; a loss scale would be 1024x
            assert np.linalg.norm(got[example_id, step] - row) < 1e-2 * np.linalg.norm(row)
    assert skipped(store, "fp16") == []


def test_e_trainer_steps_the_scaler_skips_are_listed_not_written(tmp_path):
    """A loss scale of 2**127 overflows: the scaler skips the first steps (backing off until the scaled
    gradients fit); exactly those steps' rows are missing and listed, every other step's rows are stored."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped_by_scaler = hf_train(tmp_path, store, "overflow", init_scale=2.0**127, epochs=3)
    assert skipped_by_scaler[0] and not skipped_by_scaler[5]
    got = by_step(store, "overflow")
    records = skipped(store, "overflow")
    assert all(r["reason"] == "grad_scaler_overflow" for r in records)
    listed = {r["step"] for r in records}
    assert listed == {step for step, skip in skipped_by_scaler.items() if skip}
    for step, skip in skipped_by_scaler.items():
        rows = sum(1 for _, s in got if s == step)
        assert rows == (0 if skip else 4)
        assert sum(r["n_rows"] for r in records if r["step"] == step) == (4 if skip else 0)
    assert len(skip_warnings(caught)) == 1
