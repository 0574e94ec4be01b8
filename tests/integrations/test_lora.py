"""LoRA / PEFT: a ``PeftModel`` over the tiny GPT-2 (built in code). By default only the trainable adapter layers
(``lora_A``/``lora_B``) are captured and the frozen base layers skipped; ``include_frozen=True`` adds them.
Rows equal ``torch.func`` per-example gradients (float64 model, no projection, float32 storage); attribution on
the adapters' rows equals a numpy reference; the HF Trainer callback captures a PeftModel's adapters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from tiny_models import tiny_gpt2  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import gradstore  # noqa: E402
from gradstore.hf import GradstoreCallback, with_example_ids  # noqa: E402
from ingest.capture import CaptureConfig, GradientCapture  # noqa: E402

N, SEQ = 8, 10


def lora_model(dtype: torch.dtype = torch.float64):
    """The tiny GPT-2 with rank-4 LoRA adapters on ``c_attn`` and ``c_fc``; adapters randomly initialised (not
    ``B = 0``) so every adapter weight has a non-zero gradient."""
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
        init_lora_weights=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return peft.get_peft_model(tiny_gpt2(), config).to(dtype)


def tokens(seed: int = 1, n: int = N) -> torch.Tensor:
    return torch.randint(0, 64, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def capture_exact(model, ids: torch.Tensor, tmp_path, **options) -> tuple[object, dict[str, np.ndarray]]:
    """Rows (computed in float64, no projection; stored as float32) of one backward over ``ids``; the run's spec."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    with store.capture(model, "lora", projection=None, loss_reduction="token_mean", **options) as cap:
        cap.set_ids([f"ex{i}" for i in range(len(ids))])
        model(input_ids=ids, labels=ids).loss.backward()
    block = store.read_gradients("lora")
    return store.core.run_spec("lora"), dict(zip(block.metadata.column("example_id").to_pylist(), block.vectors))


def per_example_grads(model, ids: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """``torch.func`` per-example gradients of each example's own token-mean loss w.r.t. ``names``."""
    params = {n: p.detach() for n, p in model.named_parameters() if n in names}

    def loss(p, i):
        return functional_call(model, p, (i[None],), {"labels": i[None]}).loss

    return vmap(grad(loss), in_dims=(None, 0))(params, ids)


def block(spec, rows: dict[str, np.ndarray], name: str) -> np.ndarray:
    slot = spec.slot(name)
    return np.stack([rows[f"ex{i}"][slot.offset : slot.offset + slot.size] for i in range(len(rows))])


def test_default_captures_only_the_adapters_and_rows_equal_torch_func(tmp_path):
    model = lora_model()
    ids = tokens()
    spec, rows = capture_exact(model, ids, tmp_path)
    names = [slot.name for slot in spec.layers]
    trainable = [n.removesuffix(".weight") for n, p in model.named_parameters() if p.requires_grad]
    assert names == trainable and len(names) == 2 * 2 * 2  # 2 blocks x (c_attn, c_fc) x (lora_A, lora_B)
    assert all(".lora_A.default" in n or ".lora_B.default" in n for n in names)
    for slot in spec.layers:  # exact slots: d_out x d_in; the adapters' rank (4) caps one side
        assert 4 in (slot.d_out, slot.d_in)
    g = per_example_grads(model, ids, [f"{n}.weight" for n in names])
    for name in names:
        want = g[f"{name}.weight"].reshape(N, -1).detach().numpy()
        got = block(spec, rows, name)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), name  # float32 storage


def test_include_frozen_adds_the_base_layers_with_exact_rows(tmp_path):
    model = lora_model()
    ids = tokens()
    spec, rows = capture_exact(model, ids, tmp_path, include_frozen=True)
    names = [slot.name for slot in spec.layers]
    base = "base_model.model.transformer.h.0.attn.c_attn.base_layer"  # frozen, and its input needs no grad
    frozen = [base, "base_model.model.transformer.h.1.mlp.c_proj", "base_model.model.transformer.wte"]
    assert set(frozen) <= set(names) and any("lora_A" in n for n in names)
    g = per_example_grads(model, ids, [f"{n}.weight" for n in frozen[:2]])
    for name in frozen[:2]:  # Conv1D weights are [in, out]; slots are [out, in (+ bias)]
        slot = spec.slot(name)
        got = block(spec, rows, name).reshape(N, slot.d_out, -1)[:, :, : slot.d_in]
        want = g[f"{name}.weight"].transpose(1, 2).detach().numpy()
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), name  # float32 storage


def test_attribution_on_a_peft_model_equals_numpy(tmp_path):
    model = lora_model(torch.float32)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    train, queries = tokens(1), tokens(1, 3)  # the queries are the first 3 training examples
    options = {"projection": "factorized", "k_in": 4, "k_out": 4, "loss_reduction": "token_mean"}
    with store.capture(model, "lora", checkpoint="c0", **options) as cap:
        cap.set_ids([f"ex{i}" for i in range(N)])
        model(input_ids=train, labels=train).loss.backward()
    model.zero_grad()
    with store.capture(model, "lora", checkpoint="c0", split="query") as cap:
        cap.set_ids([f"q{i}" for i in range(3)])
        model(input_ids=queries, labels=queries).loss.backward()
    g = store.read_gradients("lora", split="train")
    q = store.read_gradients("lora", split="query")
    g_ids, q_ids = g.metadata.column("example_id").to_pylist(), q.metadata.column("example_id").to_pylist()
    table = store.attribute(run="lora", k=3, method="grad-dot", write=False).to_pandas()
    for qid, vector in zip(q_ids, q.vectors):
        scores = g.vectors @ vector
        order = np.argsort(-scores)[:3]
        got = table[table.query_id == qid].sort_values("rank")
        assert got.example_id.tolist() == [g_ids[i] for i in order]
        np.testing.assert_allclose(got.score.to_numpy(), scores[order], rtol=1e-4)
        assert got.example_id.iloc[0] == "ex" + qid[1:]  # an example is its own top proponent here


def test_trainer_callback_captures_a_peft_models_adapters(tmp_path):
    ids = tokens(2, N).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids, "example_id": [f"ex{i}" for i in range(N)]})

    def collate(features):
        return {k: torch.tensor([f[k] for f in features]) for k in ("input_ids", "labels")}

    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = lora_model(torch.float32)
    callback = GradstoreCallback(store, "sft-lora", projection="factorized", k_in=4, k_out=4)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=with_example_ids(collate))
    trainer.add_callback(callback)
    trainer.train()
    names = [slot.name for slot in store.core.run_spec("sft-lora").layers]
    assert names and all(".lora_A.default" in n or ".lora_B.default" in n for n in names)
    block_ = store.read_gradients("sft-lora", columns=("example_id", "step"))
    assert sorted(block_.metadata.column("example_id").to_pylist()) == sorted(f"ex{i}" for i in range(N))
    assert sorted(set(block_.metadata.column("step").to_pylist())) == [0, 1]
    assert np.isfinite(block_.vectors).all() and (np.abs(block_.vectors).sum(axis=1) > 0).all()


def _summed_token_loss(model, ids: torch.Tensor, virtual: int = 0) -> torch.Tensor:
    """Each example's summed next-token cross-entropy (the logits of ``virtual`` prompt tokens left out)."""
    logits = model(input_ids=ids).logits[:, virtual:-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1), reduction="sum")


@pytest.mark.parametrize("kind", ["prompt-tuning", "dora", "lora-embedding"])
def test_prompt_tuning_dora_and_embedding_lora_rows_equal_per_example_backwards(kind):
    """Prompt tuning runs its prompt embedding on one row and repeats the output over the batch; DoRA runs its
    adapters on an identity matrix for the weight norm; LoRA on an embedding looks up ``lora_embedding_A.T``. The
    capture expanded the one-row output over the batch (prompt tuning's training step then failed: 9 rows for 3
    examples) and reported the embedding's ``lora_embedding_A`` not captured. Every forward's rows equal a
    per-example backward (three forwards: the first probes, the next ones run as capture decided)."""
    torch.manual_seed(0)
    if kind == "prompt-tuning":
        config, virtual = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3), 3
    elif kind == "lora-embedding":
        config, virtual = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["wte"], init_lora_weights=False), 0
    else:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], use_dora=True, fan_in_fan_out=True)
        virtual = 0
    model = peft.get_peft_model(tiny_gpt2(), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ids = tokens(n=3)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    reference = []
    for i in range(3):
        model.zero_grad()
        _summed_token_loss(model, ids[i : i + 1], virtual).backward()
        reference.append({n: p.grad.clone() for n, p in trainable.items()})
    out: list = []
    with GradientCapture(model, out.append, CaptureConfig.from_options(projection=None, loss_reduction="sum")) as cap:
        for _ in range(3):
            model.zero_grad()
            _summed_token_loss(model, ids, virtual).backward()
    assert cap.coverage.fraction == 1.0 and len(out) == 3
    for batch in out:
        for slot in cap.spec.layers:
            name = slot.name if slot.name in trainable else f"{slot.name}.weight"
            want = torch.stack([r[name] for r in reference])
            want = want.transpose(1, 2) if slot.kind == "embedding" else want.reshape(3, slot.d_out, -1)
            got = batch.grads[:, slot.offset : slot.offset + slot.size].reshape(want.shape)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item(), msg=slot.name)
