"""Optimizer-aware rows (LESS, normalizer="adam_factored"): rows equal D_out G D_in (projected) with the
factored Adam second moment of the optimizer's state at the time of the backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradstore
from ingest.capture import CaptureConfig, GradientCapture
from ingest.normalizers import (
    NORMALIZER_POWERS,
    SQRT_FLOOR,
    adam_factored_scales,
    adam_second_moment,
    factored_scales,
)
from ingest.projection import projection_matrix


def test_factored_scales_invert_a_rank_one_second_moment():
    a, b = torch.rand(4) + 0.1, torch.rand(6) + 0.1
    out_scale, in_scale = factored_scales(torch.outer(a, b))
    torch.testing.assert_close(torch.outer(out_scale, in_scale), torch.outer(a, b).rsqrt(), rtol=1e-5, atol=0)


def test_scales_reduced_from_the_optimizer_state_equal_those_of_the_full_second_moment():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layers = {
        "linear": (nn.Linear(5, 7), True),
        "linear_no_bias": (nn.Linear(5, 7, bias=False), False),
        "conv1d": (Conv1D(7, 5), True),  # weight [in 5, out 7]
        "embedding": (nn.Embedding(9, 4), False),
    }
    opt = torch.optim.AdamW([p for module, _ in layers.values() for p in module.parameters()], lr=1e-2)
    assert adam_factored_scales(opt, layers["linear"][0], "linear", True) is None  # no state yet
    for _ in range(3):
        x = torch.randn(6, 5)
        loss = sum(layers[name][0](x).pow(2).sum() for name in ("linear", "linear_no_bias", "conv1d"))
        loss = loss + layers["embedding"][0](torch.randint(0, 9, (6,))).pow(3).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    for name, (module, has_bias) in layers.items():
        kind = name.split("_")[0]
        got = adam_factored_scales(opt, module, kind, has_bias)
        expected = factored_scales(adam_second_moment(opt, module, kind, has_bias))
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=0)


def test_paused_steps_refresh_nothing_and_the_next_captured_forward_uses_the_latest_moments():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = []
    config = CaptureConfig.from_options(projection=None, normalizer="adam_factored")
    with GradientCapture(model, batches.append, config, optimizer=opt) as cap:
        hook = cap.layer_hooks[0]
        for step in range(4):
            cap.resume() if step in (0, 3) else cap.pause()
            expected = None if step == 0 else factored_scales(adam_second_moment(opt, model, "linear", True))
            out = model(torch.randn(2, 5))
            if step in (1, 2):
                assert hook.scales is None  # paused: the optimizer's steps are not folded in
            elif step == 3:  # the first captured forward after them folds in the latest moments
                for got, want in zip(hook.scales, expected):
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            out.pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        cap.flush()
    assert [b.step for b in batches] == [3]  # step 0 has no optimizer state; steps 1 and 2 were paused


def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def run(projection: str | None, normalizer: str = "adam_factored") -> tuple[list, nn.Module, list]:
    """Three Adam steps under capture; returns the captured batches and the expected rows of steps 1-2
    (``G / V^power`` with the factored ``V``: power 1/2 for ``adam_factored``, 1/4 for ``adam_sqrt``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(3, 6, 5), torch.randn(3, 6, 3)
    batches, expected = [], []
    config = CaptureConfig.from_options(projection=projection, k_in=3, k_out=2, normalizer=normalizer, seed=1)
    with GradientCapture(model, batches.append, config, optimizer=opt) as cap:
        for step in range(3):
            if step > 0:  # the optimizer holds state: what the row should be
                with cap.paused():
                    g = per_example_grads(model, x[step], y[step])
                blocks = []
                for hook in cap.layer_hooks:
                    name = hook.slot.name
                    full = torch.cat([g[f"{name}.weight"], g[f"{name}.bias"].unsqueeze(-1)], dim=-1)
                    v = adam_second_moment(opt, hook.module, "linear", True).double()
                    power = NORMALIZER_POWERS[normalizer]
                    if power == 0.5:
                        out_scale, in_scale = factored_scales(v)
                    else:  # the factors floored at SQRT_FLOOR of their mean
                        out_factor = v.sum(1) / v.sum()
                        in_factor = v.sum(0)
                        out_scale = out_factor.clamp(min=SQRT_FLOOR * out_factor.mean()).rsqrt().float()
                        in_scale = in_factor.clamp(min=SQRT_FLOOR * in_factor.mean()).rsqrt().float()
                    normalized = full * torch.outer(out_scale, in_scale).pow(2 * power)
                    if projection == "factorized":
                        p_in = projection_matrix(1, name, "in", 3, hook.slot.d_in_eff)
                        p_out = projection_matrix(1, name, "out", 2, hook.slot.d_out)
                        normalized = p_out @ normalized @ p_in.T
                    blocks.append(normalized.flatten(1))
                expected.append(torch.cat(blocks, dim=1))
            nn.functional.mse_loss(model(x[step]), y[step]).backward()
            opt.step()
            opt.zero_grad()
        cap.flush()
    return batches, model, expected


@pytest.mark.parametrize("normalizer", ["adam_factored", "adam_sqrt"])
def test_exact_rows_are_adam_normalized_from_the_second_step(normalizer):
    batches, _, expected = run(None, normalizer)
    assert [b.step for b in batches] == [1, 2]  # no state before the first step: not captured
    for batch, rows in zip(batches, expected):
        torch.testing.assert_close(batch.grads, rows, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("normalizer", ["adam_factored", "adam_sqrt"])
def test_factorized_rows_fold_the_normalizer_into_the_projection(normalizer):
    batches, _, expected = run("factorized", normalizer)
    assert [b.step for b in batches] == [1, 2]
    for batch, rows in zip(batches, expected):
        torch.testing.assert_close(batch.grads, rows, rtol=1e-4, atol=1e-6)


def test_the_run_config_says_which_form_the_rows_hold(tmp_path):
    store = gradstore.open(tmp_path / "store")
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    with store.capture(model, "less", optimizer=opt, normalizer="adam_factored", k_in=2, k_out=2):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert store.core.run_config("less")["capture"]["normalizer"] == "adam_factored"
    assert store.count() == 3  # the second batch only
