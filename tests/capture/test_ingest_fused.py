"""Projections fused into the layers' GEMMs (``fused=True``): the same rows and curvature as the hooks' route,
training bit-identical, checkpointing, shared modules, fallbacks, and the module given its forward back."""

from __future__ import annotations

import copy

import pytest
import torch
from exact_grads import SEQS, Blocks, lm_batch, padded_batch, rel_err
from tiny_models import tiny_gpt2
from torch import nn

from ingest.capture import CaptureConfig, GradientCapture
from ingest.fused import FusedGemm, _widened, widening_is_exact

transformers = pytest.importorskip("transformers")


def captured(model: nn.Module, run, fused: bool, **options) -> tuple[GradientCapture, list]:
    """Rows of ``run()`` captured from ``model`` with or without fusion (factorized 16 x 16 by default)."""
    out: list = []
    config = CaptureConfig.from_options(fused=fused, **options)
    with GradientCapture(model, out.append, config) as cap:
        run()
    return cap, out


def fused_calls(monkeypatch) -> list:
    """Record every call of the fused GEMM."""
    calls: list = []
    original = FusedGemm.forward

    def counting(ctx, *args):
        calls.append(args[3])  # transposed: nn.Linear's layout
        return original(ctx, *args)

    monkeypatch.setattr(FusedGemm, "forward", staticmethod(counting))
    return calls


def test_fused_rows_and_curvature_equal_the_hooks(monkeypatch) -> None:
    """GPT-2: Conv1D layers (with bias) and the tied lm_head (nn.Linear, no bias, 3-D input) run fused, the
    embeddings through their hooks; rows and Kronecker statistics equal the hooks' route."""
    ids, mask, labels = padded_batch()
    results = {}
    calls = fused_calls(monkeypatch)
    for fused in (False, True):
        model = tiny_gpt2(attention="eager")
        cap, out = captured(
            model,
            lambda model=model: model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward(),
            fused,
            loss_reduction="token_mean",
            curvature=True,
            seed=5,
        )
        results[fused] = (out[0], cap.curvature())
    assert sorted(set(calls)) == [False, True] and len(calls) == 9  # 8 Conv1D + lm_head
    (rows, curvature), (fused_rows, fused_curvature) = results[False], results[True]
    assert fused_rows.example_ids == rows.example_ids
    assert rel_err(fused_rows.grads, rows.grads) < 1e-6
    for layer, (a, s, n) in curvature.items():
        fa, fs, fn = fused_curvature[layer]
        assert fn == n
        torch.testing.assert_close(torch.from_numpy(fa), torch.from_numpy(a), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(torch.from_numpy(fs), torch.from_numpy(s), rtol=1e-9, atol=1e-12)


def train(model: nn.Module, fused: bool | None, steps: int = 3) -> list:
    """AdamW steps of two micro-batches each with dropout; captured (fused or not) unless ``fused`` is None."""
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: list = []

    def loop() -> None:
        for _ in range(steps):
            for half in (SEQS[:2], SEQS[2:]):
                model(**lm_batch(half)).loss.backward()
            opt.step()
            opt.zero_grad()

    if fused is None:
        loop()
    else:
        config = CaptureConfig.from_options(loss_reduction="token_mean", fused=fused)
        with GradientCapture(model, out.append, config, optimizer=opt):
            loop()
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_capture_does_not_change_training(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain, fused = tiny_gpt2(dropout=0.1), tiny_gpt2(dropout=0.1)
        train(plain, None)
        out = train(fused, True)
    finally:
        torch.set_num_threads(before)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(p, q), name
    assert [b.step for b in out] == [0, 0, 1, 1, 2, 2]


def test_linear_layers_with_bias_on_2d_3d_and_strided_inputs() -> None:
    """nn.Linear with bias fused on 2-D and contiguous 3-D inputs; a strided 3-D input falls back to the hooks;
    rows, parameter gradients and input gradients equal the unfused capture's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6))
    inputs = {
        "2-D": torch.randn(5, 12),
        "3-D": torch.randn(5, 7, 12),
        "strided 3-D": torch.randn(5, 12, 7).transpose(1, 2),
    }
    for name, x in inputs.items():
        grads = {}
        for fused in (False, True):
            model, xin = copy.deepcopy(base), x.clone().requires_grad_()
            _, out = captured(model, lambda m=model, xin=xin: m(xin).pow(2).sum().backward(), fused, k_in=4, k_out=3)
            grads[fused] = (out[0].grads, [p.grad for p in model.parameters()], xin.grad)
        (rows, params, dx), (fused_rows, fused_params, fused_dx) = grads[False], grads[True]
        assert rel_err(fused_rows, rows) < 1e-6, name
        assert all(torch.equal(p, q) for p, q in zip(params, fused_params)), name
        assert torch.equal(dx, fused_dx), name


def test_a_module_used_twice_sums_its_uses_fused(monkeypatch) -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    x = torch.randn(3, 4)
    calls = fused_calls(monkeypatch)
    rows = {
        fused: captured(model, lambda: model(x).pow(2).sum().backward(), fused, loss_reduction="sum", route="project")[
            1
        ][0].grads
        for fused in (False, True)
    }
    assert len(calls) == 2
    assert rel_err(rows[True], rows[False]) < 1e-6


def test_non_reentrant_checkpointing_with_fused_layers() -> None:
    """The recomputation runs the same fused GEMMs (without capturing), so checkpointing saves what it expects;
    the rows equal the hooks' (which equal those without checkpointing: tests/capture/test_ingest_exact.py) and so do
    the parameter gradients, bit for bit."""
    torch.manual_seed(0)
    base, x = Blocks(reentrant=False), torch.randn(3, 4)
    results = {}
    for fused in (False, True):
        model, xin = copy.deepcopy(base), x.clone().requires_grad_()
        _, out = captured(model, lambda m=model, xin=xin: m(xin).sum().backward(), fused, route="project", k_in=3)
        results[fused] = (out[0].grads, [p.grad for p in model.parameters()])
    assert rel_err(results[True][0], results[False][0]) < 1e-6
    assert all(torch.equal(p, q) for p, q in zip(results[False][1], results[True][1]))


def test_autocast_and_paused_forwards_fall_back_and_exit_restores_forward(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    own_forward = lambda x: nn.Linear.forward(model[2], x)  # noqa: E731 (an instance-level forward someone set)
    model[2].forward = own_forward
    x = torch.randn(4, 6)
    calls = fused_calls(monkeypatch)
    out: list = []
    with GradientCapture(model, out.append, CaptureConfig.from_options(fused=True, route="project")) as cap:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
        cap.flush()
        assert not calls and len(out) == 1  # autocast: the hooks' route captured it
        with cap.paused():
            model(x).sum().backward()
        cap.flush()
        assert len(calls) == 2 and len(out) == 1  # fused GEMMs ran, nothing captured
    assert "forward" not in model[0].__dict__ and model[2].forward is own_forward


@pytest.mark.parametrize("transposed", [True, False])
def test_a_widening_found_exact_is_exact_on_other_data(transposed: bool) -> None:
    """Where :func:`widening_is_exact` lets a shape run widened, the widened GEMM gives the layer's own columns bit
    for bit on any data (random draws here), small shapes (which often sum in another order) included."""
    generator = torch.Generator().manual_seed(3)
    for rows, d_in, d_out in ((4, 5, 6), (5, 20, 6), (4, 6, 3), (5, 12, 20), (64, 32, 96), (256, 64, 64)):
        shape = (d_out, d_in) if transposed else (d_in, d_out)
        extra_shape = (4, d_in) if transposed else (d_in, 4)
        weight, extra = torch.randn(shape, generator=generator), torch.randn(extra_shape, generator=generator)
        exact = widening_is_exact(torch.empty(rows, d_in), weight, extra, transposed, with_bias=True)
        for _ in range(20):
            x, bias = torch.randn(rows, d_in, generator=generator), torch.randn(d_out, generator=generator)
            own = torch.addmm(bias, x, weight.t() if transposed else weight)
            wide = torch.addmm(
                torch.cat([bias, torch.randn(4, generator=generator)]), x, _widened(weight, extra, transposed)
            )
            assert not exact or torch.equal(wide[:, :d_out], own), (rows, d_in, d_out)


def test_gradients_nobody_needs_are_not_computed_fused() -> None:
    """A first layer on raw inputs (no input gradient) and a frozen weight: the fused backward skips what torch's
    own backward skips (no widened ``dy W`` GEMM, no weight gradient), with the same rows and gradients as the
    hooks."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 6))
    x = torch.randn(5, 7, 12)
    results = {}

    def frozen_then_run(model: nn.Module) -> None:
        model[2].weight.requires_grad_(False)  # frozen after the capture chose its layers
        model(x).pow(2).sum().backward()

    for fused in (False, True):
        model = copy.deepcopy(base)
        cap, out = captured(model, lambda m=model: frozen_then_run(m), fused, k_in=4, k_out=3)
        results[fused] = (out[0].grads, [p.grad for p in model.parameters()])
        if fused:  # an input-gradient pass (and its check) for the second layer only
            passes = [sorted(key[0] for key in hook.fusion_checks) for hook in cap.layer_hooks]
            assert passes == [["forward"], ["backward", "forward"]]
    (rows, grads), (fused_rows, fused_grads) = results[False], results[True]
    assert rel_err(fused_rows, rows) < 1e-6
    assert fused_grads[2] is None and grads[2] is None  # the frozen weight
    assert all((g is None and h is None) or torch.equal(g, h) for g, h in zip(grads, fused_grads))
