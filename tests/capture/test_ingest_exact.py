"""Exact per-example gradients (projection=None) against torch.func per-sample gradients."""

from __future__ import annotations

import pytest
import torch
from exact_grads import Blocks, gpt2_reference, linear_reference, padded_batch, rel_err, slot_matrix
from tiny_models import tiny_gpt2
from torch import nn
from torch.func import functional_call, grad, vmap

from ingest.capture import CaptureConfig, GradientCapture
from ingest.hooks import RecomputationError

transformers = pytest.importorskip("transformers")


def capture_rows(model, run, config):
    out = []
    with GradientCapture(model, out.append, config) as cap:
        run()
    return cap.spec, out


def test_mlp_matches_torch_func():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    spec, out = capture_rows(
        model, lambda: nn.functional.cross_entropy(model(x), y).backward(), CaptureConfig.from_options(projection=None)
    )
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for name in ("0", "2", "4"):
        assert rel_err(slot_matrix(spec, out[0].grads, name), linear_reference(g, name)) < 1e-5


def test_gpt2_with_padding_matches_torch_func():
    model = tiny_gpt2(attention="eager")
    ids, mask, labels = padded_batch()
    spec, out = capture_rows(
        model,
        lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward(),
        CaptureConfig.from_options(projection=None, loss_reduction="token_mean"),
    )
    g = gpt2_reference(model, ids, mask, labels)
    rows = out[0].grads
    kinds = {s.kind for s in spec.layers}
    assert kinds == {"linear", "conv1d", "embedding"}
    for s in spec.layers:
        got = slot_matrix(spec, rows, s.name)
        if s.name in ("lm_head", "transformer.wte"):
            continue  # tied weights, checked below
        ref = linear_reference(g, s.name, transpose=s.kind in ("conv1d", "embedding"))
        assert rel_err(got, ref) < 1e-5, s.name
    # lm_head shares wte's weight: the parameter gradient is the sum of the two slots.
    tied = slot_matrix(spec, rows, "lm_head") + slot_matrix(spec, rows, "transformer.wte").transpose(1, 2)
    assert rel_err(tied, g["transformer.wte.weight"]) < 1e-5
    assert out[0].num_tokens.tolist() == mask.sum(1).tolist()


def test_module_used_twice_sums_its_uses():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    x = torch.randn(3, 4)
    spec, out = capture_rows(
        model,
        lambda: model(x).pow(2).sum().backward(),
        CaptureConfig.from_options(projection=None, loss_reduction="sum"),
    )
    assert [s.name for s in spec.layers] == ["0"]  # one module, one slot
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(grad(lambda p, xi: functional_call(model, p, (xi[None],)).pow(2).sum()), in_dims=(None, 0))(params, x)
    assert rel_err(slot_matrix(spec, out[0].grads, "0"), linear_reference(g, "0")) < 1e-5


def test_non_reentrant_checkpointing_gives_the_same_rows():
    torch.manual_seed(0)
    model, x = Blocks(reentrant=False), torch.randn(3, 4, requires_grad=True)
    cfg = CaptureConfig.from_options(projection=None)
    _, with_ckpt = capture_rows(model, lambda: model(x).sum().backward(), cfg)
    ref_model = nn.Sequential(model.a, nn.Tanh(), model.b)
    _, ref = capture_rows(ref_model, lambda: ref_model(x).sum().backward(), cfg)
    assert torch.allclose(with_ckpt[0].grads, ref[0].grads, rtol=1e-6, atol=1e-7)


def test_reentrant_checkpointing_is_refused():
    torch.manual_seed(0)
    model, x = Blocks(reentrant=True), torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RecomputationError, match="use_reentrant=False"):
        capture_rows(model, lambda: model(x).sum().backward(), CaptureConfig.from_options(projection=None))


def test_hf_gradient_checkpointing_gives_the_same_rows():
    model = tiny_gpt2(attention="eager")
    model.train()
    ids, mask, labels = padded_batch()
    cfg = CaptureConfig.from_options(projection=None, loss_reduction="token_mean")

    def run():
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    _, plain = capture_rows(model, run, cfg)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, ckpt = capture_rows(model, run, cfg)
    assert torch.allclose(ckpt[0].grads, plain[0].grads, rtol=1e-5, atol=1e-7)
