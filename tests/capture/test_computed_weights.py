"""Weights computed from parameters before each forward (``weight_norm``, ``spectral_norm``, ``orthogonal``, as
parametrizations and as the legacy hooks: wav2vec2/HuBERT's positional convolution, GAN discriminators, TTS
vocoders): each parameter they are computed from, and the module's bias, is captured exactly (compared with
``torch.func`` per-example gradients), and no slot holds the gradient of the computed weight, which is no
parameter. Uses whose copies cannot be split stay reported."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from ingest.capture import CaptureConfig, GradientCapture
from ingest.coverage import CoverageWarning
from ingest.tokens import TokenGradientCapture

parametrizations = nn.utils.parametrizations


def _legacy(wrap, module: nn.Module, **options) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return wrap(module, **options)


class Computed(nn.Module):
    """Sequence layers whose weights are computed: ``[B, T, 8]`` in, three classes out."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        if how == "conv":  # wav2vec2's positional convolution: weight_norm over the kernel's dim, grouped
            self.a = parametrizations.weight_norm(nn.Conv1d(8, 8, 3, padding=1, groups=2), dim=2)
            self.b = _legacy(nn.utils.weight_norm, nn.Conv1d(8, 8, 3, padding=1), dim=2)
        elif how == "vocoder":  # HiFi-GAN's upsampling: weight_norm on a strided transposed convolution
            self.a = parametrizations.weight_norm(nn.ConvTranspose1d(8, 8, 4, stride=2, padding=1, groups=2))
            self.b = _legacy(nn.utils.weight_norm, nn.ConvTranspose1d(8, 8, 3, padding=1, output_padding=0))
        elif how == "linear":
            self.a = parametrizations.weight_norm(nn.Linear(8, 8))
            self.b = _legacy(nn.utils.weight_norm, nn.Linear(8, 8))
        else:  # spectral norm and an orthogonal map (in eval mode: the power iteration's state fixed)
            self.a = _legacy(nn.utils.spectral_norm, nn.Linear(8, 8))
            self.b = parametrizations.orthogonal(nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how in ("conv", "vocoder"):
            return self.head(F.gelu(self.b(F.gelu(self.a(x.transpose(1, 2))))).mean(-1))
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))).mean(1))


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def _slot_reference(name: str, ref: dict[str, torch.Tensor]) -> torch.Tensor:
    """A slot's reference: a bare parameter's (or one entry of a stacked one's), or a layer's weight and bias."""
    if name in ref:
        return ref[name]
    stacked, _, entry = name.rpartition(".")
    if stacked in ref and entry.isdigit():
        return ref[stacked][:, int(entry)]
    return torch.cat([ref[f"{name}.weight"], ref[f"{name}.bias"][..., None]], -1)  # [B, d_out, d_in + 1]


@pytest.mark.parametrize("how", ["conv", "vocoder", "linear", "spectral-orthogonal"])
def test_parameters_behind_a_computed_weight_are_captured_exactly(how) -> None:
    torch.manual_seed(0)
    model = Computed(how)
    if how == "spectral-orthogonal":
        model.eval()
    x, y = torch.randn(4, 5, 8), torch.randint(0, 3, (4,))
    rows: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, rows.append, CaptureConfig.from_options(projection=None)) as cap:
            F.cross_entropy(model(x), y).backward()
    assert not [w for w in caught if issubclass(w.category, CoverageWarning)]
    assert cap.coverage.gaps() == [] and cap.coverage.fraction == 1.0
    names = [s.name for s in cap.spec.layers]
    assert "a" not in names and "b" not in names  # no slot for a weight that is no parameter
    assert {"a.bias", "b.bias"} <= set(names)
    ref = _reference(model, x, y)
    covered = set()
    for s in cap.spec.layers:
        got = rows[0].grads[:, s.offset : s.offset + s.size]
        expected = _slot_reference(s.name, ref).reshape(got.shape)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=s.name)
        covered.add(s.name if s.name in ref else s.name.rpartition(".")[0])
    assert {n for n in ref if not n.startswith("head.")} <= covered


def test_a_weight_norm_layer_under_a_per_token_capture_is_reported() -> None:
    """A per-token capture keeps each position's share, which a weight's per-example copy does not have: the
    parameters behind the computed weight are recorded as not captured and warned (the head's tokens exact)."""
    torch.manual_seed(0)
    model = Computed("linear")
    tokens = TokenGradientCapture(model, CaptureConfig.from_options(k_in=2, k_out=2))
    with warnings.catch_warnings(record=True) as caught, tokens:
        warnings.simplefilter("always")
        F.cross_entropy(model(torch.randn(2, 5, 8)), torch.tensor([0, 2])).backward()
    gaps = {p.name for p in tokens.coverage.gaps()}
    assert "a.parametrizations.weight.original0" in gaps and "b.weight_v" in gaps
    assert any(issubclass(w.category, CoverageWarning) for w in caught)


def test_an_einsum_that_sums_over_the_examples_stays_reported() -> None:
    """``einsum("btd,de->e", x, W)`` sums over the examples: no per-example copy can split it, so the weight is
    recorded as not captured (and the sum, added to every example, as mixing)."""

    class Summed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 3))
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x.mean(1)) + torch.einsum("btd,de->e", x, self.w)

    torch.manual_seed(0)
    model = Summed()
    with warnings.catch_warnings(record=True), GradientCapture(model, lambda b: None, CaptureConfig()) as cap:
        warnings.simplefilter("always")
        F.cross_entropy(model(torch.randn(3, 5, 8)), torch.tensor([0, 1, 2])).backward()
    gaps = {p.name: str(p.reason) for p in cap.coverage.gaps()}
    assert "einsum" in gaps["w"] and any(name.endswith("(mixes examples)") for name in gaps)
