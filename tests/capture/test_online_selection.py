"""Online data selection in the step (ingest.online_selection, gradstore.capture.online): exactness against a step on
the kept examples only (float64, plain loop), the policies, refusals, and the store's decision table."""

from __future__ import annotations

import copy
import gc
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ingest import CaptureConfig, CaptureUsageError, GradientCapture, ProjectionConfig
from ingest.online_selection import (
    DropBelowThreshold,
    ExactRemovalError,
    KeepTopFraction,
    LossBased,
    OnlineSelector,
    RandomSelection,
)


class TokenModel(nn.Module):
    """Embedding + two Linear layers over tokens, one shared Linear used twice (a module with two uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.emb(tokens)))
        h = torch.tanh(self.hidden(h))  # second use of the same weights
        return self.head(h).mean(dim=1)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def example_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def per_example_loss(y: torch.Tensor):
    def loss(outputs, args, kwargs):
        return F.cross_entropy(outputs, y[: outputs.shape[0]], reduction="none")

    return loss


def data(seed: int, n: int, tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (n, 4), generator=g) if tokens else torch.randn(n, 5, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=g)


def selected_steps(model, batches, policy, *, target=None, opt_cls=torch.optim.SGD, renormalize=True, scale=1.0, **kw):
    """Train ``model`` on ``batches`` (a list of steps, each a list of micro-batches) with online selection."""
    opt = opt_cls(model.parameters(), lr=0.1)
    decisions = []
    capture = GradientCapture(
        model,
        lambda batch: None,
        CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4), loss_scale=scale),
        optimizer=opt,
        **kw,
    )
    with capture, OnlineSelector(capture, policy, target, renormalize=renormalize, on_decision=decisions.append):
        for step in batches:
            for x, y in step:
                (F.cross_entropy(model(x), y) * scale).backward()
            opt.step()
            opt.zero_grad()
    return decisions


def reference_steps(model, batches, decisions, *, opt_cls=torch.optim.SGD, renormalize=True):
    """The same steps on the kept examples only (mean over the kept ones, or sum / B without renormalisation)."""
    opt = opt_cls(model.parameters(), lr=0.1)
    for step, decision in zip(batches, decisions):
        x = torch.cat([x for x, _ in step])
        y = torch.cat([y for _, y in step])
        w = decision.weights.to(torch.float64)
        losses = example_losses(model, x, y)
        loss = (w * losses).sum() / (w.sum() if renormalize else len(w))
        loss.backward()
        opt.step()
        opt.zero_grad()


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
def test_selected_steps_equal_steps_on_the_kept_examples(opt_cls):
    torch.manual_seed(0)
    model = mlp().double()
    twin = copy.deepcopy(model)
    batches = [[data(s, 8)] for s in range(3)]
    target = torch.randn(28, dtype=torch.float64)
    decisions = selected_steps(model, batches, KeepTopFraction(0.5), target=target, opt_cls=opt_cls)
    assert [int(d.kept.sum()) for d in decisions] == [4, 4, 4]
    reference_steps(twin, batches, decisions, opt_cls=opt_cls)
    assert_same(model, twin)


class SequenceModel(nn.Module):
    """Linear layers over ``[B, T, d]`` inputs, widening (the input side is narrower) then narrowing."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 9)
        self.down = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))).mean(dim=1)


@pytest.mark.parametrize("fraction", [0.25, 0.625, 1.0])
@pytest.mark.parametrize("sequences", [False, True], ids=["rows", "sequences"])
def test_kept_fractions_below_and_above_half_form_the_same_gradients(fraction, sequences):
    """A mask keeping fewer than half of the examples gathers them; one keeping more weighs every example by 0 or
    its coefficient (the narrower operand scaled): both equal a step on the kept examples, in 2-D and 3-D."""
    torch.manual_seed(1)
    model = (SequenceModel() if sequences else mlp()).double()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        x = torch.randn((8, 4, 5) if sequences else (8, 5), generator=g, dtype=torch.float64)
        batches.append([(x, torch.randint(0, 3, (8,), generator=g))])

    def target(rows: torch.Tensor, losses: torch.Tensor | None) -> torch.Tensor:
        return rows.double() @ torch.linspace(-1, 1, rows.shape[1], dtype=torch.float64)

    decisions = selected_steps(model, batches, KeepTopFraction(fraction), target=target)
    assert [int(d.kept.sum()) for d in decisions] == [round(8 * fraction)] * 2
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)


def test_a_layer_output_modified_in_place_keeps_its_own_gradient():
    """The gradient recorded for a layer is that of its output as the layer produced it, also when the forward
    then modifies the output in place (an in-place ReLU, a residual added with ``+=``)."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.a(x), inplace=True)
            g = self.b(h)
            g += h
            return self.head(g)

    torch.manual_seed(2)
    model = InPlace().double()
    twin = copy.deepcopy(model)
    batches = [[data(s, 8)] for s in range(2)]
    decisions = selected_steps(model, batches, RandomSelection(0.625))
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)


def test_scores_are_row_dot_target_and_top_fraction_keeps_the_best():
    torch.manual_seed(1)
    model = mlp().double()
    rows = []
    target = torch.randn(28, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cap = GradientCapture(
        model, rows.append, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4)), optimizer=opt
    )
    x, y = data(3, 10)
    with cap, OnlineSelector(cap, KeepTopFraction(0.3), target) as sel:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        cap.flush()
    decision = sel.last_decision
    expected = rows[0].grads.double() @ target
    torch.testing.assert_close(decision.scores, expected, rtol=1e-5, atol=1e-6)
    assert set(torch.nonzero(decision.kept).flatten().tolist()) == set(torch.topk(expected, 3).indices.tolist())


def test_gradient_accumulation_is_decided_over_the_whole_step():
    torch.manual_seed(2)
    model = mlp().double()
    twin = copy.deepcopy(model)
    batches = [[data(10 + 2 * s, 6), data(11 + 2 * s, 6)] for s in range(2)]
    decisions = selected_steps(model, batches, RandomSelection(0.5), scale=0.5)
    assert [len(d.example_ids) for d in decisions] == [12, 12]
    assert [int(d.kept.sum()) for d in decisions] == [6, 6]
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)


def test_without_renormalisation_dropped_examples_contribute_nothing():
    torch.manual_seed(3)
    model = mlp().double()
    twin = copy.deepcopy(model)
    batches = [[data(20 + s, 8)] for s in range(2)]
    decisions = selected_steps(
        model, batches, DropBelowThreshold(0.0), target=torch.randn(28, dtype=torch.float64), renormalize=False
    )
    assert all(d.renormalization == 1.0 for d in decisions)
    reference_steps(twin, batches, decisions, renormalize=False)
    assert_same(model, twin)


def test_embeddings_and_a_shared_layer_are_removed_exactly():
    torch.manual_seed(4)
    model = TokenModel().double()
    twin = copy.deepcopy(model)
    batches = [[data(30 + s, 8, tokens=True)] for s in range(2)]
    dim = None
    with GradientCapture(model, lambda b: None, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4))) as cap:
        dim = cap.spec.dim
    decisions = selected_steps(model, batches, KeepTopFraction(0.25), target=torch.randn(dim, dtype=torch.float64))
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)


class Checkpointed(nn.Module):
    """An MLP whose first block runs under non-reentrant gradient checkpointing (recomputed in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=False)
        return self.b(h)


def test_deferred_weight_gradients_are_formed_at_the_decision():
    torch.manual_seed(9)
    model = mlp().double()
    twin = copy.deepcopy(model)
    x, y = data(70, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cap = GradientCapture(model, lambda b: None, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4)), opt)
    with cap, OnlineSelector(cap, KeepTopFraction(0.5), torch.randn(28, dtype=torch.float64)) as selector:
        assert all("forward" in m.__dict__ for m in (model[0], model[2]))
        F.cross_entropy(model(x), y).backward()
        assert all(p.grad is None for p in model.parameters())  # left to the decision
        decision = selector.apply()
        full = [p.grad.clone() for p in model.parameters()]
        assert opt.step() is None  # the step pre-hook finds nothing left to decide
        assert selector.steps_decided == 1
        opt.zero_grad()
        with cap.paused():  # a forward the selector does not decide: torch's own weight gradients
            F.cross_entropy(model(x), y).backward()
        paused = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad()
    assert all("forward" not in m.__dict__ for m in (model[0], model[2]))  # the modules' own forwards again
    w = decision.weights.double()
    (w * example_losses(twin, x, y)).sum().div(w.sum()).backward()
    for got, p in zip(full, twin.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-12)
    twin.zero_grad()
    with torch.no_grad():
        for p, q in zip(twin.parameters(), model.parameters()):
            p.copy_(q)
    F.cross_entropy(twin(x), y).backward()
    for got, p in zip(paused, twin.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-12)


def test_deferred_layers_without_biases_stay_exact():
    """Layers without a bias: the first (its input needs no gradient) runs the custom autograd function, the second
    a GEMM on detached parameters; both steps equal steps on the kept examples."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Tanh(), nn.Linear(7, 3, bias=False)).double()
    twin = copy.deepcopy(model)
    batches = [[data(100 + s, 8)] for s in range(3)]
    decisions = selected_steps(model, batches, RandomSelection(0.5), opt_cls=torch.optim.Adam)
    reference_steps(twin, batches, decisions, opt_cls=torch.optim.Adam)
    assert_same(model, twin)


def test_a_step_that_drops_every_example_steps_on_zero_gradients():
    torch.manual_seed(10)
    model = mlp().double()
    twin = copy.deepcopy(model)
    batches = [[data(80 + s, 6)] for s in range(2)]
    decisions = selected_steps(
        model,
        batches,
        DropBelowThreshold(math.inf),
        target=torch.randn(28, dtype=torch.float64),
        opt_cls=torch.optim.Adam,
        renormalize=False,
    )
    assert all(int(d.kept.sum()) == 0 for d in decisions)
    reference_steps(twin, batches, decisions, opt_cls=torch.optim.Adam, renormalize=False)
    assert_same(model, twin)  # Adam stepped on zero gradients (its moments decay), as a step on no examples


def test_selection_under_gradient_checkpointing_is_exact():
    torch.manual_seed(11)
    model = Checkpointed().double()
    twin = copy.deepcopy(model)
    batches = [[data(90 + s, 8)] for s in range(2)]
    decisions = selected_steps(model, batches, RandomSelection(0.5))
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)


class Reweight:
    """A user policy returning float weights."""

    needs_scores = False
    needs_loss = False

    def decide(self, n, scores, losses, generator):
        return torch.linspace(0.0, 2.0, n, dtype=torch.float64)


def test_a_policy_may_reweight_examples():
    torch.manual_seed(5)
    model = mlp().double()
    twin = copy.deepcopy(model)
    batches = [[data(40, 9)]]
    decisions = selected_steps(model, batches, Reweight())
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "subtracted"])
@pytest.mark.parametrize("policy", [KeepTopFraction(0.5), Reweight()], ids=["drop", "reweight"])
def test_frozen_weights_with_trainable_biases_get_no_gradient(policy, deferred, monkeypatch):
    """BitFit-style: the embedding's and the shared layer's weights frozen, that layer's bias and the head trained:
    the selected steps equal steps on the kept examples and no frozen weight gets a gradient (an optimizer holding
    it would step it)."""
    torch.manual_seed(12)
    model = TokenModel().double()
    for module in (model.emb, model.hidden):
        module.weight.requires_grad_(False)
    if not deferred:  # the backward forms every gradient; the selector subtracts the dropped terms
        monkeypatch.setattr("ingest.online_selection.selector.deferrable", lambda module: False)
    twin = copy.deepcopy(model)
    batches = [[data(130 + s, 8, tokens=True)] for s in range(2)]
    with GradientCapture(model, lambda b: None, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4))) as cap:
        dim = cap.spec.dim
    decisions = selected_steps(model, batches, policy, target=torch.randn(dim, dtype=torch.float64))
    assert model.emb.weight.grad is None and model.hidden.weight.grad is None
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)


def test_loss_based_keeps_the_lowest_losses():
    torch.manual_seed(6)
    model = mlp().double()
    twin = copy.deepcopy(model)
    x, y = data(50, 10)
    decisions = selected_steps(model, [[(x, y)]], LossBased(0.6), per_example_loss=per_example_loss(y))
    losses = example_losses(twin, x, y).detach()
    kept = decisions[0].kept
    assert int(kept.sum()) == 6
    assert losses[kept].max() <= losses[~kept].min()
    reference_steps(twin, [[(x, y)]], decisions)
    assert_same(model, twin)


def test_random_selection_is_seeded():
    model = mlp().double()
    batches = [[data(60, 10)]]
    first = selected_steps(copy.deepcopy(model), batches, RandomSelection(0.5))
    second = selected_steps(copy.deepcopy(model), batches, RandomSelection(0.5))
    assert torch.equal(first[0].weights, second[0].weights)


def test_unsupported_layers_are_refused():
    model = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    cap = GradientCapture(model, lambda b: None)
    with pytest.raises(ExactRemovalError, match=r"1 \(LayerNorm\).*requires_grad_\(False\)"):
        OnlineSelector(cap, RandomSelection(0.5))
    model[1].requires_grad_(False)  # frozen: nothing to remove
    OnlineSelector(cap, RandomSelection(0.5))


class DoubledLinear(nn.Linear):
    """A Linear subclass with a forward of its own: its weight gradient is 2 dy^T x, not dy^T x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_linear_subclass_with_its_own_forward_is_refused():
    model = nn.Sequential(DoubledLinear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    cap = GradientCapture(model, lambda b: None)
    with pytest.raises(ExactRemovalError, match=r"own forward, not a subclass's.*0 \(DoubledLinear\)"):
        OnlineSelector(cap, RandomSelection(0.5))


class LinearReuse(nn.Module):
    """A Linear whose weight the forward also reads outside the module (``F.linear`` on other rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + F.linear(x.flip(1), self.fc.weight)


class BiasReuse(LinearReuse):
    """The Linear's bias added once more outside the module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.fc.bias


class ScaledReuse(LinearReuse):
    """The weight scaled first (a tensor computed from the parameter alone), then used with the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + x.flip(1) @ (2 * self.fc.weight).T


class TiedByLinear(nn.Module):
    """An LM head tied to the embedding by ``F.linear(h, emb.weight)`` instead of a Linear module."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.emb(tokens).mean(dim=1)), self.emb.weight)[:, :3]


class TiedHead(nn.Module):
    """An LM head tied to the embedding through two modules (the same Parameter, each used by its own forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.emb(tokens).mean(dim=1))))[:, :3]


def no_deferral(monkeypatch) -> None:
    """The backward forms every gradient; the selector subtracts the dropped terms (as under DDP or fused=True)."""
    monkeypatch.setattr("ingest.online_selection.selector.deferrable", lambda module: False)


@pytest.mark.filterwarnings("ignore::ingest.coverage.CoverageWarning")  # capture's own report of the other use
@pytest.mark.parametrize("autocast", [False, True], ids=["float64", "autocast"])
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "subtracted"])
@pytest.mark.parametrize(
    ("model_cls", "name"),
    [(LinearReuse, "fc.weight"), (BiasReuse, "fc.bias"), (ScaledReuse, "fc.weight"), (TiedByLinear, "emb.weight")],
)
def test_a_parameter_used_outside_its_module_is_refused(model_cls, name, deferred, autocast, monkeypatch):
    """Exact or loud: the other use's per-example terms cannot be removed, so the first captured forward is refused
    (before any step) instead of a step that differs from one on the kept examples."""
    torch.manual_seed(13)
    if not deferred:
        no_deferral(monkeypatch)
    model = model_cls() if autocast else model_cls().double()
    before = copy.deepcopy(model)
    x, y = data(140, 8, tokens=model_cls is TiedByLinear)
    if autocast and x.is_floating_point():
        x = x.float()
    refused = pytest.raises(ExactRemovalError, match=rf"{name} is also used outside.*requires_grad_\(False\)")
    with refused, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        selected_steps(model, [[(x, y)]], RandomSelection(0.5))
    assert_same(model, before)


def frozen_reuse() -> nn.Module:
    model = nn.Sequential(LinearReuse(), nn.Tanh(), nn.Linear(3, 3)).double()
    model[0].fc.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "subtracted"])
@pytest.mark.parametrize(
    ("make", "tokens"),
    [(frozen_reuse, False), (lambda: TiedHead().double(), True)],
    ids=["frozen-reused-weight", "tied-embedding-head"],
)
def test_frozen_reused_and_tied_weights_are_not_refused_and_stay_exact(make, tokens, deferred, monkeypatch):
    """The refusal's remedy, frozen: the weight's other use gives it no gradient (its bias still trains exactly);
    and a weight tied between an embedding and a head is used through both modules' own forwards."""
    torch.manual_seed(14)
    if not deferred:
        no_deferral(monkeypatch)
    model = make()
    twin = copy.deepcopy(model)
    batches = [[data(150 + s, 8, tokens=tokens)] for s in range(3)]
    decisions = selected_steps(model, batches, RandomSelection(0.5))
    reference_steps(twin, batches, decisions)
    if tokens:
        assert model.head.weight is model.emb.weight
    assert_same(model, twin)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "subtracted"])
def test_an_l2_penalty_in_the_loss_is_kept(deferred, renormalize, monkeypatch):
    """A penalty on the weight alone, in the loss outside the model's forward, is no per-example use: it is kept
    (and, renormalised, scaled by the renormalisation like the rest of the step's gradient)."""
    torch.manual_seed(16)
    if not deferred:
        no_deferral(monkeypatch)
    model = mlp().double()
    twin = copy.deepcopy(model)
    batches = [data(170 + s, 8) for s in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    decisions = []
    cap = GradientCapture(model, lambda b: None, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4)), opt)
    with cap, OnlineSelector(cap, RandomSelection(0.5), renormalize=renormalize, on_decision=decisions.append):
        for x, y in batches:
            (F.cross_entropy(model(x), y) + 0.3 * model[0].weight.pow(2).sum()).backward()
            opt.step()
            opt.zero_grad()
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for (x, y), decision in zip(batches, decisions):
        w = decision.weights.to(torch.float64)
        loss = (w * example_losses(twin, x, y)).sum() / (w.sum() if renormalize else len(w))
        (loss + decision.renormalization * 0.3 * twin[0].weight.pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert [d.renormalization for d in decisions] == ([2.0, 2.0] if renormalize else [1.0, 1.0])
    assert_same(model, twin)


def test_a_non_finite_target_or_threshold_is_refused():
    model = mlp()
    cap = GradientCapture(model, lambda b: None, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4)))
    for bad in (math.nan, math.inf):
        target = torch.randn(28)
        target[3] = bad
        with pytest.raises(ValueError, match="pass a finite"):
            OnlineSelector(cap, KeepTopFraction(0.5), target)
    with pytest.raises(ValueError, match="pass a finite threshold"):
        DropBelowThreshold(math.nan)
    with pytest.raises(ValueError, match="pass a finite threshold"):
        DropBelowThreshold(torch.tensor(math.nan))
    with pytest.raises(ValueError, match="must be a number"):
        DropBelowThreshold("0.5")
    scores = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    assert DropBelowThreshold(-math.inf).decide(3, scores, None, torch.Generator()).all()
    assert not DropBelowThreshold(math.inf).decide(3, scores, None, torch.Generator()).any()
    assert DropBelowThreshold(0).decide(3, scores, None, torch.Generator()).tolist() == [False, True, True]


def test_misuse_is_refused_with_what_to_do():
    model = mlp()
    cap = GradientCapture(model, lambda b: None)
    with pytest.raises(ValueError, match="pass target="):
        OnlineSelector(cap, KeepTopFraction(0.5))
    with pytest.raises(ValueError, match="per_example_loss"):
        OnlineSelector(cap, LossBased(0.5))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        KeepTopFraction(1.5)
    with pytest.raises(ValueError, match=r"\[dim\]"):
        OnlineSelector(cap, KeepTopFraction(0.5), torch.zeros(3))
    for keywords, message in (  # a value that was taken as its truth value, or a ValueError from int()
        ({"renormalize": "no"}, "renormalize must be True or False, got 'no'"),
        ({"renormalize": 0}, "renormalize must be True or False, got 0"),
        ({"collective": "yes"}, "collective must be True, False or None"),
        ({"seed": "x"}, r"seed must be a whole number in \[0, 2\*\*64\) \(it seeds .*, got 'x'"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"seed": -1}, "seed must be a whole number"),
    ):
        with pytest.raises(CaptureUsageError, match=message):
            OnlineSelector(cap, RandomSelection(0.5), **keywords)
    seeded = OnlineSelector(cap, RandomSelection(0.5), seed=np.int64(3))
    assert torch.equal(seeded.generator.get_state(), torch.Generator().manual_seed(3).get_state())


# ---------------------------------------------------------------- the store side (gradstore.capture.online)


def test_store_selection_scores_against_query_rows_and_records_every_decision(tmp_path):
    import gradstore
    from gradstore.capture.online import KeepTopFraction as StoreKeepTop
    from gradstore.capture.online import query_target, select_online

    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    assert store.sql("select count(*) from online_selection").fetchall() == [(0,)]
    torch.manual_seed(7)
    model = mlp().double()
    twin = copy.deepcopy(model)
    qx, qy = data(70, 5)
    with store.capture(model, "run", split="query", k_in=4, k_out=4) as cap:
        cap.set_ids([f"q{i}" for i in range(5)])
        F.cross_entropy(model(qx), qy).backward()
    model.zero_grad()
    target = query_target(store, "run")
    assert target.shape == (28,) and target.dtype == torch.float64
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [[data(71 + s, 8)] for s in range(3)]
    with store.capture(model, "run", optimizer=opt) as cap, select_online(cap, StoreKeepTop(0.5), target) as sel:
        for s, step in enumerate(batches):
            for x, y in step:
                cap.set_ids([f"s{s}e{i}" for i in range(8)])
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert (sel.examples_seen, sel.examples_kept) == (24, 12)
    table = store.sql(
        "select step, example_id, kept, weight, score, policy from online_selection order by step, example_id"
    )
    rows = table.fetchall()
    assert len(rows) == 24
    assert store.sql("select step, sum(kept::int) from online_selection group by step order by step").fetchall() == [
        (0, 4),
        (1, 4),
        (2, 4),
    ]
    assert rows[0][5] == 'KeepTopFraction({"fraction": 0.5})'
    # the recorded decisions reproduce the parameters: a step on the kept examples only
    kept = {(r[0], r[1]) for r in rows if r[2]}
    decisions = []
    for s in range(3):
        ids = [f"s{s}e{i}" for i in range(8)]
        decisions.append(type("D", (), {"weights": torch.tensor([float((s, i) in kept) for i in ids])})())
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)
    # the report shows what was kept, per run
    from gradstore.answers.report.data import gather
    from gradstore.answers.report.html import render

    shown = gather(store.core).online_selection
    row = dict(zip(shown["columns"], shown["rows"][0]))
    assert (row["run_id"], row["steps"], row["examples"], row["kept"]) == ("run", 3, 24, 12)
    assert row["score_kept"] > row["score_dropped"]
    assert "online_selection" in render(gather(store.core))
    # scores are row . target of the stored training rows
    stored = store.core.read_gradients("run", split="train", columns=("example_id", "step"))
    by_id = dict(
        zip(stored.metadata.column("example_id").to_pylist(), stored.vectors.astype("float64") @ target.numpy())
    )
    for _, example_id, _, _, score, _ in rows:
        assert score == pytest.approx(by_id[example_id], rel=1e-5, abs=1e-9)


def test_store_selection_errors_are_gradstore_errors(tmp_path):
    import gradstore
    from gradstore.capture.online import ExactRemovalError as StoreExactRemovalError
    from gradstore.capture.online import query_target, select_online
    from gradstore.errors import GradstoreError, InvalidArgumentError

    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    with store.capture(model, "run") as cap:
        with pytest.raises(StoreExactRemovalError, match="LayerNorm") as info:
            select_online(cap, RandomSelection(0.5))
        assert isinstance(info.value, GradstoreError)
        with pytest.raises(InvalidArgumentError, match="target="):
            select_online(cap, KeepTopFraction(0.5))
        with pytest.raises(InvalidArgumentError, match="commit_every"):
            select_online(cap, RandomSelection(0.5), commit_every=0)
        for keywords, message in (({"seed": "x"}, "seed must be a whole number"), ({"renormalize": "no"}, "True or")):
            with pytest.raises(InvalidArgumentError, match=message):  # were a ValueError, and accepted as True
                select_online(cap, RandomSelection(0.5), **keywords)
        model(torch.randn(2, 5)).sum().backward()
    with pytest.raises(InvalidArgumentError, match="split='query'"):
        query_target(store, "run")
    with pytest.raises(GradstoreError, match="no run"):
        query_target(store, "nope")


def test_store_policies_and_select_online_refuse_with_gradstore_errors(tmp_path):
    """The policies and ``select_online`` of ``gradstore.capture.online``: a refused argument is a GradstoreError
    (they were ingest's ``CaptureUsageError``, a ``TypeError`` for an unknown keyword, and ``renormalize="no"``
    was taken as true); ``query_target`` says when its filter matched none of the rows."""
    import gradstore
    from gradstore.capture.online import (
        DropBelowThreshold,
        KeepTopFraction,
        LossBased,
        RandomSelection,
        query_target,
        select_online,
    )
    from gradstore.errors import CaptureUsageError as StoreCaptureUsageError
    from gradstore.errors import InvalidArgumentError

    refused = [
        (lambda: KeepTopFraction(1.5), r"KeepTopFraction.fraction must be a number in \(0, 1\], got 1.5"),
        (lambda: RandomSelection(0), "RandomSelection.fraction must be a number"),
        (lambda: DropBelowThreshold(math.nan), "pass a finite threshold"),
        (lambda: LossBased(0.5, keep="mid"), "LossBased.keep must be 'low' or 'high', got 'mid'"),
    ]
    for make, message in refused:
        with pytest.raises(StoreCaptureUsageError, match=message):
            make()
    assert KeepTopFraction(0.5).decide(4, torch.arange(4.0), None, torch.Generator()).tolist() == [
        False,
        False,
        True,
        True,
    ]
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = mlp().double()
    with store.capture(model, "run", split="query", k_in=4, k_out=4) as cap:
        cap.set_ids([f"q{i}" for i in range(3)])
        F.cross_entropy(model(data(1, 3)[0]), data(1, 3)[1]).backward()
    with pytest.raises(InvalidArgumentError, match="where='step = 999' matched none of run 'run''s 3 rows of split"):
        query_target(store, "run", where="step = 999")
    with store.capture(model, "run", k_in=4, k_out=4) as cap:
        for keywords, message in (
            ({"bogus": 1}, "select_online\\(\\) takes no argument bogus="),
            ({"renormalize": "no"}, "renormalize= takes True or False, got 'no'"),
            ({"collective": 1}, "collective= takes True, False or None"),
            ({"seed": "x"}, "seed must be a whole number"),
        ):
            with pytest.raises(InvalidArgumentError, match=message):
                select_online(cap, RandomSelection(0.5), **keywords)
        model(data(2, 2)[0]).sum().backward()


# ---------------------------------------------------------------- the Hugging Face Trainer (gradstore.hf_online)


def test_trainer_callback_step_equals_a_step_on_the_kept_examples(tmp_path):
    pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from tiny_models import tiny_gpt2
    from transformers import Trainer, TrainingArguments

    import gradstore
    from gradstore.errors import InvalidArgumentError
    from gradstore.hf import with_example_ids
    from gradstore.hf_online import OnlineSelectionCallback

    n, seq = 8, 12
    tokens = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(0)).tolist()
    dataset = datasets.Dataset.from_dict(
        {"input_ids": tokens, "labels": tokens, "example_id": [f"e{i}" for i in range(n)]}
    )

    def collate(features):
        return {k: torch.tensor([f[k] for f in features]) for k in ("input_ids", "labels")}

    def model_with_frozen_norms():
        model = tiny_gpt2()
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.requires_grad_(False)
        return model

    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    common = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": n, "max_steps": 1,
              "learning_rate": 0.5, "optim": "sgd", "lr_scheduler_type": "constant", "report_to": [],
              "remove_unused_columns": False, "use_cpu": True, "save_strategy": "no", "logging_strategy": "no",
              "disable_tqdm": True}  # fmt: skip
    callback = OnlineSelectionCallback(store, "run", RandomSelection(0.5), k_in=4, k_out=4)
    with pytest.raises(InvalidArgumentError, match="max_grad_norm=0"):
        Trainer(model=model_with_frozen_norms(), args=TrainingArguments(**common), train_dataset=dataset,
                data_collator=with_example_ids(collate), callbacks=[callback]).train()  # fmt: skip
    model = model_with_frozen_norms()
    reference = copy.deepcopy(model)
    trainer = Trainer(model=model, args=TrainingArguments(**common, max_grad_norm=0), train_dataset=dataset,
                      data_collator=with_example_ids(collate), callbacks=[callback])  # fmt: skip
    trainer.train()
    assert callback.selection is None and callback.capture is None
    rows = store.sql("select example_id, kept from online_selection").fetchall()
    assert len(rows) == n and sum(k for _, k in rows) == n // 2
    kept = sorted(int(e[1:]) for e, k in rows if k)
    batch = torch.tensor(tokens)[kept]
    # the Trainer's loss of a batch of the kept examples: their shifted label tokens' loss summed, divided by the
    # Trainer's num_items_in_batch (every label of the batch, seq per example)
    reference(input_ids=batch, labels=batch, num_items_in_batch=torch.tensor(len(kept) * seq)).loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------- DDP: a collective decision (2 gloo ranks, CPU)

DDP_STEPS, DDP_LOCAL = 2, 6


def _ddp_data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    x, y = data(100 + step, 2 * DDP_LOCAL)
    lo, hi = rank * DDP_LOCAL, (rank + 1) * DDP_LOCAL
    return x[lo:hi], y[lo:hi], [f"s{step}e{i}" for i in range(lo, hi)]


def _ddp_store_worker(rank: int, port: int, store_path: str) -> None:
    """The same through the store: distributed_capture (the capture holds the unwrapped module) + select_online."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LANCE_LOG="error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        _ddp_store_job(rank, store_path)
        _ddp_plain(rank, f"{store_path}.plain")
        # Every DDP module (which holds the process group) is gone before the group is: gloo's worker threads
        # must not outlive it into interpreter shutdown, where they abort the process.
        dist.barrier()
        gc.collect()
    finally:
        dist.destroy_process_group()


def _ddp_store_job(rank: int, store_path: str) -> None:
    """Rank ``rank``'s training through the store (its modules freed on return)."""
    from torch.nn.parallel import DistributedDataParallel

    import gradstore
    from gradstore.capture.online import select_online
    from gradstore.distributed import distributed_capture

    torch.manual_seed(0)
    model = DistributedDataParallel(mlp().double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = gradstore.open(store_path, storage_dtype="float32")
    target = torch.randn(28, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    capture = distributed_capture(store, model, "ddp", optimizer=opt, k_in=4, k_out=4)
    with capture as cap, select_online(cap, KeepTopFraction(0.4), target) as sel:
        assert sel.selector.collective
        for step in range(DDP_STEPS):
            x, y, ids = _ddp_data(step, rank)
            cap.set_ids(ids)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    torch.save(model.module.state_dict(), f"{store_path}.params.{rank}")


def _ddp_plain(rank: int, out: str) -> None:
    """A plain GradientCapture of the DDP module itself (no store)."""
    import json

    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(mlp().double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cap = GradientCapture(model, lambda b: None, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4)), opt)
    target = torch.randn(28, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    kept: list[str] = []
    with cap, OnlineSelector(cap, KeepTopFraction(0.4), target) as sel:
        assert sel.collective
        for step in range(DDP_STEPS):
            x, y, ids = _ddp_data(step, rank)
            cap.set_ids(ids)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            kept += [i for i, k in zip(sel.last_decision.example_ids, sel.last_decision.kept.tolist()) if k]
    params = [p.detach().tolist() for p in model.module.parameters()]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"kept": kept, "params": params}, f)


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    """One 2-rank job for both DDP tests (process start-up dominates on a small CPU)."""
    import socket

    import torch.multiprocessing as mp

    tmp_path = tmp_path_factory.mktemp("online_ddp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_store_worker, args=(port, str(tmp_path / "store")), nprocs=2, join=True)
    return tmp_path / "store"


def test_ddp_ranks_decide_together_and_step_as_on_the_kept_examples(ddp_job):
    import json

    results = [json.loads(Path(f"{ddp_job}.plain.{r}").read_text()) for r in range(2)]
    kept = set(results[0]["kept"]) | set(results[1]["kept"])
    assert len(kept) == DDP_STEPS * round(0.4 * 2 * DDP_LOCAL)  # the global top 40% of each step
    torch.manual_seed(0)
    reference = mlp().double()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        parts = [_ddp_data(step, r) for r in range(2)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        mask = torch.tensor([i in kept for p in parts for i in p[2]])
        F.cross_entropy(reference(x[mask]), y[mask]).backward()  # one process, the kept examples of both ranks
        opt.step()
        opt.zero_grad()
    for result in results:
        for p, q in zip(reference.parameters(), result["params"]):
            torch.testing.assert_close(p.detach(), torch.tensor(q, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_a_refreshed_target_follows_training_without_touching_the_step():
    from ingest.online_selection import RefreshedTarget

    torch.manual_seed(8)
    model = mlp().double()
    twin, initial = copy.deepcopy(model), copy.deepcopy(model)
    batches = [[data(110 + s, 8)] for s in range(3)]
    val = [data(120, 6)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cap = GradientCapture(model, lambda b: None, CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4)), opt)
    target = RefreshedTarget(cap, val, lambda m, b: F.cross_entropy(m(b[0]), b[1]), every=2)
    decisions, targets = [], []
    with cap, OnlineSelector(cap, KeepTopFraction(0.5), target, on_decision=decisions.append):
        for step in batches:
            for x, y in step:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            targets.append(target.vector.clone())
            opt.zero_grad()
    assert target.refreshes == 2  # at the first and the third decision
    assert torch.equal(targets[0], targets[1]) and not torch.equal(targets[1], targets[2])
    reference_steps(twin, batches, decisions)
    assert_same(model, twin)  # the refresh pass left .grad alone
    # the first target is the mean captured row of the validation batch under the initial parameters
    rows = []
    config = CaptureConfig(projection=ProjectionConfig(k_in=4, k_out=4))
    with GradientCapture(initial, lambda b: rows.append(b.grads), config):
        F.cross_entropy(initial(val[0][0]), val[0][1]).backward()
    torch.testing.assert_close(targets[0], rows[0].mean(0))
    with pytest.raises(ValueError, match="every"):
        RefreshedTarget(cap, val, lambda m, b: None, every=0)


def test_ddp_through_the_store_records_one_global_decision(ddp_job):
    import gradstore

    store_path = ddp_job
    store = gradstore.open(store_path)
    rows = store.sql("select step, rank, example_id, kept from online_selection").fetchall()
    assert len(rows) == DDP_STEPS * 2 * DDP_LOCAL and {r[1] for r in rows} == {0, 1}
    kept = {r[2] for r in rows if r[3]}
    assert len(kept) == DDP_STEPS * round(0.4 * 2 * DDP_LOCAL)
    torch.manual_seed(0)
    reference = mlp().double()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        parts = [_ddp_data(step, r) for r in range(2)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        mask = torch.tensor([i in kept for p in parts for i in p[2]])
        F.cross_entropy(reference(x[mask]), y[mask]).backward()
        opt.step()
        opt.zero_grad()
    for rank in range(2):
        state = torch.load(f"{store_path}.params.{rank}")
        for name, p in reference.state_dict().items():
            torch.testing.assert_close(state[name], p, rtol=1e-12, atol=1e-12)
