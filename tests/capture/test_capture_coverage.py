"""Coverage: every trainable parameter is captured exactly or recorded as not captured, and the user is told."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import gradstore
from gradstore.answers.report.data import gather
from ingest.capture import CaptureConfig, GradientCapture
from ingest.coverage import CoverageWarning
from ingest.misuse import CaptureUsageError
from ingest.projection import LAYER_KINDS
from ingest.tokens import TokenGradientCapture


class BareDistance(nn.Module):
    """Prototypes compared with each example by ``torch.cdist``: a use no rule splits per example."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cdist(x, self.w))


GAPS = ["w"]


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


def per_example_cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference: ``torch.func`` per-example gradients of each example's cross-entropy, by parameter name."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    return vmap(
        grad(lambda p, xi, yi: nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])),
        in_dims=(None, 0, 0),
    )(params, x, y)


def _capture(model: nn.Module, x: torch.Tensor, **options) -> tuple[GradientCapture, list, list]:
    rows: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, rows.append, CaptureConfig.from_options(projection=None, **options)) as cap:
            model(x).sum().backward()
    return cap, rows, [w for w in caught if issubclass(w.category, CoverageWarning)]


def test_an_unsplittable_use_is_recorded_and_warned_once() -> None:
    torch.manual_seed(0)
    cap, rows, caught = _capture(BareDistance(), torch.randn(5, 4))
    record = {p.name: p for p in cap.coverage.parameters}
    assert not record["w"].captured and "cdist" in record["w"].reason
    assert record["head.weight"].captured and record["head.weight"].how == "hook"
    assert len(caught) == 1 and "w (used by" in str(caught[0].message)
    assert cap.coverage.fraction == pytest.approx(12 / 24)  # head: 9 + 3 of 24 entries
    s = cap.spec.slot("w")
    assert torch.count_nonzero(rows[0].grads[:, s.offset : s.offset + s.size]) == 0  # nothing half-captured


def test_strict_refuses_at_start_and_at_the_use() -> None:
    bitfit = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    bitfit[0].weight.requires_grad_(False)  # a trainable bias of a frozen weight: known before any forward
    with pytest.raises(CaptureUsageError, match=r"0.bias \(its layer 0's weight is frozen"):
        GradientCapture(bitfit, lambda batch: None, CaptureConfig.from_options(coverage="strict"))
    for model, x, name in ((BareDistance(), torch.randn(2, 4), "w"),):
        with (
            pytest.raises(CaptureUsageError, match=f"{name} \\(used by"),
            GradientCapture(model, lambda batch: None, CaptureConfig.from_options(coverage="strict")),
        ):
            model(x).sum().backward()


def test_ignore_records_without_warning_and_norms_are_a_decision() -> None:
    cap, _, caught = _capture(BareDistance(), torch.randn(3, 4), coverage="ignore")
    assert not caught and {p.name for p in cap.coverage.gaps()} == set(GAPS)
    cap, _, caught = _capture(Normed(), torch.randn(3, 4))
    norms = [p for p in cap.coverage.parameters if p.name.startswith("norm.")]
    assert not caught and norms and all(not p.captured and p.decided for p in norms)
    with pytest.raises(CaptureUsageError, match="coverage must be one of"):
        CaptureConfig.from_options(coverage="loud").validate()


def test_sequence_first_linear_with_as_many_positions_as_examples_is_exact() -> None:
    """A ``batch_first=False`` encoder with ``T == B``: shapes cannot tell the examples' dim, the taint does."""
    torch.manual_seed(1)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 1, enable_nested_tensor=False)
    head = nn.Linear(8, 3)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.head = encoder, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x.transpose(0, 1)).mean(0))

    model = Model()
    x, y = torch.randn(4, 4, 8), torch.tensor([0, 1, 2, 0])
    rows: list = []
    with GradientCapture(model, rows.append, CaptureConfig.from_options(projection=None)) as cap:
        nn.functional.cross_entropy(model(x), y).backward()
    per_example = per_example_cross_entropy(model, x, y)
    for name in ("encoder.layers.0.linear1", "encoder.layers.0.self_attn.out_proj"):
        s = cap.spec.slot(name)
        got = rows[0].grads[:, s.offset : s.offset + s.size].reshape(4, s.k_out, s.k_in)
        want = torch.cat([per_example[f"{name}.weight"], per_example[f"{name}.bias"].unsqueeze(-1)], dim=-1)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), name
    s = cap.spec.slot("encoder.layers.0.self_attn.in_proj")
    got = rows[0].grads[:, s.offset : s.offset + s.size].reshape(4, s.k_out, s.k_in)
    prefix = "encoder.layers.0.self_attn."
    want = torch.cat(
        [per_example[prefix + "in_proj_weight"], per_example[prefix + "in_proj_bias"].unsqueeze(-1)], dim=-1
    )
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


class Normed2(nn.Module):
    """torch's LayerNorm and RMSNorm (F.layer_norm, F.rms_norm) and a Hugging Face style RMSNorm (weight * h)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)
        self.hf_norm = HFStyleRMSNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hf_norm(self.rms(self.ln(self.fc(x)))).mean(1))


class HFStyleRMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_norm_scales_and_shifts_are_exact_when_asked_for() -> None:
    torch.manual_seed(3)
    model = Normed2()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[0] in ("ln", "rms", "hf_norm"):
                p.normal_()
    x, y = torch.randn(3, 5, 4), torch.tensor([0, 1, 2])
    rows: list = []
    config = CaptureConfig.from_options(projection=None, layer_types=LAYER_KINDS)
    with GradientCapture(model, rows.append, config) as cap:
        nn.functional.cross_entropy(model(x), y).backward()
    per_example = per_example_cross_entropy(model, x, y)
    norms = [s for s in cap.spec.layers if s.kind == "norm"]
    assert {s.name for s in norms} == {"ln.weight", "ln.bias", "rms.weight", "hf_norm.weight"}
    for s in norms:
        got = rows[0].grads[:, s.offset : s.offset + s.size]
        assert torch.allclose(got, per_example[s.name].reshape(3, -1), atol=1e-6, rtol=1e-5), s.name
    assert cap.coverage.fraction == 1.0


class Positional(nn.Module):
    """A token model with a bare position table (added) and a learned scale (multiplied)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.position = nn.Parameter(torch.randn(8, 6))
        self.gain = nn.Parameter(torch.ones(6))
        self.head = nn.Linear(6, 11)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = (self.embed(input_ids) + self.position[: input_ids.shape[1]]) * self.gain
        return self.head(torch.tanh(h))


def test_per_token_rows_of_bare_parameters_sum_to_the_example_rows() -> None:
    torch.manual_seed(2)
    model = Positional()
    ids = torch.randint(0, 11, (3, 5))

    def step() -> None:
        logits = model(ids)
        nn.functional.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1), reduction="sum").backward()

    config = CaptureConfig.from_options(k_in=4, k_out=4, loss_reduction="sum")
    rows: list = []
    with GradientCapture(model, rows.append, config):
        step()
    tokens = TokenGradientCapture(model, config)
    with tokens:
        step()
    assert torch.allclose(tokens.results[0].rows.sum(dim=1), rows[0].grads, atol=1e-5, rtol=1e-4)
    position = tokens.spec.slot("position")
    share = tokens.results[0].rows[:, :, position.offset : position.offset + position.size]
    assert torch.count_nonzero(share) > 0


def test_the_store_keeps_each_runs_coverage(tmp_path) -> None:
    store = gradstore.open(tmp_path / "store")
    model = BareDistance()
    with store.capture(model, run="prototypes", coverage="ignore") as cap:
        cap.set_ids(["a", "b"])
        model(torch.randn(2, 4)).sum().backward()
    coverage = store.info()["coverage"]["prototypes"]
    assert coverage["not_captured"] == GAPS
    assert coverage["fraction"] == pytest.approx(12 / (12 + 12))
    table = store.sql("select parameter, captured, how from capture_coverage order by parameter").df()
    assert table.loc[table.parameter == "head.weight", "how"].item() == "hook"
    refused = pytest.raises(gradstore.GradstoreError, match=r"w \(used by cdist")
    with refused, store.capture(model, run="prototypes", coverage="strict") as cap:
        cap.set_ids(["c", "d"])
        model(torch.randn(2, 4)).sum().backward()
    report = gather(store.core)
    assert report.overview["runs"][0]["coverage"]["not_captured"] == coverage["not_captured"]
    printed = subprocess.run(
        [sys.executable, "-m", "gradstore.cli", "info", str(tmp_path / "store")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "coverage   prototypes:" in printed and "not captured: w" in printed


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.conv, self.head, self.reentrant = nn.Conv2d(1, 2, 3), nn.Linear(2, 3), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.relu(self.conv(t)), x, use_reentrant=self.reentrant)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_convolution_is_exact_or_reported(reentrant: bool) -> None:
    """Non-reentrant checkpointing keeps the forward's graph: exact. Reentrant checkpointing recomputes the
    convolution inside backward, unseen: it is reported, and the head after the custom Function is still exact."""
    torch.manual_seed(4)
    model = Checkpointed(reentrant)
    x = torch.randn(3, 1, 6, 6, requires_grad=reentrant)
    rows: list = []
    config = CaptureConfig.from_options(projection=None, loss_reduction="sum")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, rows.append, config) as cap:
            model(x).sum().backward()
    warned = [w for w in caught if issubclass(w.category, CoverageWarning)]
    want = []
    for b in range(3):  # per-example backward: the reference
        model.zero_grad()
        model(x[b : b + 1]).sum().backward()
        want.append(torch.cat([model.head.weight.grad, model.head.bias.grad.unsqueeze(-1)], dim=-1).flatten())
    head = cap.spec.slot("head")
    got = rows[0].grads[:, head.offset : head.offset + head.size]
    assert torch.allclose(got, torch.stack(want), atol=1e-6, rtol=1e-5)
    conv = {p.name: p for p in cap.coverage.parameters}["conv.weight"]
    if reentrant:
        assert not conv.captured and "reentrant" in conv.reason and warned
    else:
        assert conv.captured and not warned


class BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_batch_statistics_that_mix_the_examples_are_recorded_and_warned() -> None:
    """BatchNorm in training mode normalises each example by the batch's statistics: the conv's rows are the
    examples' shares of the batch gradient (they sum to it), not each example's own gradient (rel. error ~3),
    which was said nowhere. Recorded as an entry of no parameters and warned; eval mode mixes nothing."""
    torch.manual_seed(0)
    model, x = BatchNormed(), torch.randn(4, 1, 6, 6)
    cap, rows, caught = _capture(model, x)
    mixing = {p.name: p for p in cap.coverage.parameters if p.name == "bn (mixes examples)"}
    assert mixing and mixing["bn (mixes examples)"].numel == 0 and "BatchNorm" in mixing["bn (mixes examples)"].reason
    assert len(caught) == 1 and "rows mix the examples at bn" in str(caught[0].message)
    assert cap.coverage.fraction == pytest.approx(1 - 6 / cap.coverage.trainable)  # bn's own scale and shift only
    model.bn.eval()
    cap, _, caught = _capture(model, x)
    assert caught == [] and not any(p.name.endswith("(mixes examples)") for p in cap.coverage.parameters)


def test_parameters_that_start_training_later_are_recorded_and_warned() -> None:
    """Gradual unfreezing and adapters added mid-run: the layer selection is made when the capture starts, so a
    layer unfrozen later, or a parameter added to the model later, trained with no slot and no record (coverage
    said 100%). Each is now recorded as not captured, with when, and warned about."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    model[2].requires_grad_(False)
    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, lambda rows: None, CaptureConfig.from_options(projection=None)) as cap:
            model(x).sum().backward()
            assert cap.coverage.fraction == 1.0
            model[2].requires_grad_(True)  # unfrozen after a warm-up
            model.register_parameter("gate", nn.Parameter(torch.ones(3)))  # added mid-run
            (model(x) * model.gate).sum().backward()
    record = {p.name: p for p in cap.coverage.parameters}
    for name in ("2.weight", "2.bias", "gate"):
        assert not record[name].captured and "captured forward 2" in record[name].reason, name
    told = [str(w.message) for w in caught if issubclass(w.category, CoverageWarning)]
    assert told and "2.weight" in told[-1]


def test_a_layer_unfrozen_between_probes_is_recorded_when_the_capture_ends() -> None:
    """The check runs on probing forwards (1, 2, 4, ...) and when the capture ends, before its coverage is
    written: a layer unfrozen before forward 3 is recorded by the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    model[2].requires_grad_(False)
    x = torch.randn(5, 4)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with GradientCapture(model, lambda rows: None, CaptureConfig.from_options(projection=None)) as cap:
            for step in range(3):
                if step == 2:
                    model[2].requires_grad_(True)
                model(x).sum().backward()
            assert cap.coverage.fraction == 1.0  # forward 3 is no probe
    record = {p.name: p for p in cap.coverage.parameters}
    assert not record["2.weight"].captured and "captured forward 3" in record["2.weight"].reason


class Reordered(nn.Module):
    """Two Linear layers with the batch reordered or mixed between them (and put back after)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(3, 4), nn.Linear(4, 2), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, perm = torch.tanh(self.a(x)), torch.tensor([2, 0, 3, 1])
        inverse = torch.argsort(perm)
        mixed = {
            "index_select": lambda: h.index_select(0, perm),
            "gather": lambda: torch.gather(h, 0, perm[:, None].expand(-1, 4)),
            "flip": lambda: h.flip(0),
            "roll": lambda: h.roll(1, 0),
            "sort": lambda: torch.sort(h, dim=0).values,
            "cumsum": lambda: h.cumsum(0),
            "softmax": lambda: h.softmax(0),
            "softmax-keyword-input": lambda: torch.softmax(input=h, dim=0),
        }[self.how]()
        out = self.b(mixed)
        return out[inverse] if self.how in ("index_select", "gather") else out


@pytest.mark.parametrize(
    "how", ["index_select", "gather", "flip", "roll", "sort", "cumsum", "softmax", "softmax-keyword-input"]
)
def test_a_layer_after_the_batch_is_reordered_or_mixed_is_reported_not_silently_wrong(how) -> None:
    """Rows along the examples' dim moved or combined (index_select, gather, flip, roll, sort, cumsum, softmax over
    the batch) no longer count as the examples in order: the next layer's use is a gap (its rows were another
    example's, with coverage 100%); the layer before keeps its exact rows."""
    torch.manual_seed(0)
    cap, rows, caught = _capture(Reordered(how), torch.randn(4, 3))
    gaps = {p.name for p in cap.coverage.gaps()}
    assert gaps == {"b.weight", "b.bias"} and len(caught) == 1
    s = cap.spec.slot("b")
    assert torch.count_nonzero(rows[0].grads[:, s.offset : s.offset + s.size]) == 0
    assert torch.count_nonzero(rows[0].grads[:, : s.offset]) > 0


class ChosenRows(nn.Module):
    """Rows chosen along the examples by an index: a task's examples through their own head (multi-task learning,
    a boolean mask), the batch permuted through a layer and put back, or permuted and returned so."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.heads, self.how = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)]), how
        self.scale, self.mix = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.how == "task-heads":
            out = torch.zeros(x.shape[0], 2)
            for t, head in enumerate(self.heads):
                out[task == t] = head(h[task == t])
            return out
        perm = torch.tensor([2, 0, 3, 1])
        chosen = h[perm] * self.scale if self.how == "permuted-scaled-and-back" else h[perm]
        chosen = chosen @ self.mix if self.how == "permuted-product-and-back" else chosen
        out = self.heads[0](chosen)
        return out if self.how == "permuted" else out[torch.argsort(perm)]


@pytest.mark.parametrize("how", ["task-heads", "permuted-and-back", "permuted-scaled-and-back"])
def test_rows_chosen_along_the_examples_are_each_examples_own(how) -> None:
    """A layer on rows chosen by an index along the examples (a task's examples by a boolean mask; a permutation
    put back after the layer) gets each row's example from the index: its rows equal per-example autograd (they
    were reported: every head's parameters a gap); so does a parameter the permuted rows meet (``h[perm] * s``:
    each row's gradient of ``s`` went to the example at its position, silently another's)."""
    torch.manual_seed(0)
    model, x, task = ChosenRows(how), torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    y = torch.tensor([0, 1, 1, 0])
    rows: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, rows.append, CaptureConfig.from_options(projection=None)) as cap:
            torch.nn.functional.cross_entropy(model(x, task), y).backward()
    assert cap.coverage.gaps() == [] and caught == []
    for i in range(4):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x, task)[i : i + 1], y[i : i + 1]).backward()
        s = cap.spec.slot("scale")
        expected = model.scale.grad if model.scale.grad is not None else torch.zeros(4)
        torch.testing.assert_close(rows[0].grads[i, s.offset : s.offset + s.size], expected, rtol=1e-5, atol=1e-6)
        for name in ("a", "heads.0", "heads.1"):
            s, module = cap.spec.slot(name), model.get_submodule(name)
            weight, bias = (p.grad if p.grad is not None else torch.zeros_like(p) for p in (module.weight, module.bias))
            expected = torch.cat([weight, bias[:, None]], 1).flatten()
            torch.testing.assert_close(rows[0].grads[i, s.offset : s.offset + s.size], expected, rtol=1e-5, atol=1e-6)


def _capture_chosen(how: str) -> tuple[GradientCapture, list]:
    """One capture of :class:`ChosenRows` ``how`` on a summed output, and the warnings it raised."""
    torch.manual_seed(0)
    model = ChosenRows(how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, lambda batch: None, CaptureConfig.from_options(projection=None)) as cap:
            model(torch.randn(4, 3), torch.zeros(4)).sum().backward()
    return cap, caught


def test_a_product_with_rows_in_another_order_is_reported() -> None:
    """``h[perm] @ W``: the product rule takes its rows as the examples in order, which these are not; reported
    (it silently gave each row's gradient to the example at its position) while the layers around stay exact."""
    cap, caught = _capture_chosen("permuted-product-and-back")
    gaps = {p.name: str(p.reason) for p in cap.coverage.gaps()}
    assert list(gaps) == ["mix"] and "rows of mixed examples" in gaps["mix"] and len(caught) == 1


def test_rows_returned_in_another_order_are_recorded_as_mixing() -> None:
    """The forward returns rows chosen by a permutation without putting them back (``head(h[perm])``): each row's
    loss is another example's; recorded as mixing at the model's output (it was recorded as the head's gap)."""
    cap, caught = _capture_chosen("permuted")
    mixed = [p.name for p in cap.coverage.gaps() if p.name.endswith("(mixes examples)")]
    assert mixed == ["the model's output (mixes examples)"] and len(caught) == 1


class AcrossExamples(nn.Module):
    """Two Linear layers with the examples combined between them: a hand-written batch norm, ``h @ h.T`` (as an
    einsum too: the same tensor twice), each example plus the batch reversed."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.how = nn.Linear(3, 5), nn.Linear(5, 2), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mixed = {
            "batch-norm": lambda: (h - h.mean(0, keepdim=True)) / (h.std(0) + 1e-5),
            "gram": lambda: h @ h.T,
            "einsum-gram": lambda: torch.einsum("bi,ci->bc", h, h),
            "stack-reversed": lambda: torch.stack([h, h.flip(0)], 1).sum(1),
            "times-gram": lambda: h @ (h.T @ h),
            "median-centred": lambda: h - h.median(0).values,
            "quantile-scaled": lambda: h / torch.quantile(h, 0.9, dim=0),
            "functional-batch-norm": lambda: F.batch_norm(h, None, None, training=True),
            "layer-norm-over-batch": lambda: F.layer_norm(h.T, (h.shape[0],)).T,
            "manifold-mixup": lambda: 0.7 * h + 0.3 * h[torch.tensor([4, 3, 2, 1, 0])],
            "list-index-times": lambda: h[[1, 2, 3, 4, 0]] * h,
            "stacked-with-mixup": lambda: torch.stack([h, h[torch.tensor([4, 3, 2, 1, 0])]], 1).sum(1),
            "loop-with-neighbours": lambda: torch.stack([h[i] + h[(i + 1) % 5] for i in range(5)]),
            "pairwise-differences": lambda: (h[:, None] - h[None]).pow(2).sum(1),
            "bmm-gram": lambda: torch.bmm(h[None], h.T[None])[0],
            "flattened-mean": lambda: h - h.reshape(-1).mean(),
            "token-rows-std": lambda: h / h.unsqueeze(1).expand(5, 2, 5).reshape(10, 5).std(0),
        }[self.how]()
        return self.b(mixed)


ACROSS_EXAMPLES = ["batch-norm", "gram", "einsum-gram", "stack-reversed", "times-gram", "median-centred"]
ACROSS_EXAMPLES += ["quantile-scaled", "functional-batch-norm", "layer-norm-over-batch", "manifold-mixup"]
ACROSS_EXAMPLES += ["flattened-mean", "token-rows-std", "stacked-with-mixup", "loop-with-neighbours"]
ACROSS_EXAMPLES += ["pairwise-differences", "bmm-gram"]


@pytest.mark.parametrize("how", [*ACROSS_EXAMPLES, "list-index-times"])
def test_ops_across_the_examples_are_recorded_and_warned(how) -> None:
    """Each example combined with the others (the batch's own mean and deviation, a hand-written BatchNorm; a
    product of examples with each other; a median or quantile over the batch, a functional batch norm, a layer
    norm over the batch's dim, another example's row added: manifold mixup; a mean or deviation over the batch
    flattened, or over its rows of tokens) couples them, as BatchNorm in
    training mode does: recorded as an entry "(mixes examples)" and warned (each was silent, the first layer's
    rows another example's share)."""
    torch.manual_seed(0)
    cap, rows, caught = _capture(AcrossExamples(how), torch.randn(5, 3))
    mixed = [p for p in cap.coverage.gaps() if p.name.endswith("(mixes examples)")]
    assert len(mixed) == 1 and "ops across the examples" in mixed[0].name and len(caught) == 1
    assert all(p.captured for p in cap.coverage.parameters if p.numel)  # every parameter still has its rows


def test_a_model_output_computed_across_the_examples_is_recorded_and_warned() -> None:
    """The forward's last op normalises over the batch (``log_softmax(logits, dim=0)``): no layer comes after it
    to report, yet each example's loss depends on the others'. Recorded as mixing at the model's output (was
    silent, every row another example's share); the same op over the classes is not."""

    class Scored(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.a, self.b, self.dim = nn.Linear(3, 5), nn.Linear(5, 4), dim

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 3.0 * torch.log_softmax(self.b(torch.tanh(self.a(x))), dim=self.dim)  # followed to the output

    torch.manual_seed(0)
    cap, _, caught = _capture(Scored(0), torch.randn(4, 3))
    mixed = [p.name for p in cap.coverage.gaps() if p.name.endswith("(mixes examples)")]
    assert mixed == ["the model's output (mixes examples)"] and len(caught) == 1
    cap, _, caught = _capture(Scored(1), torch.randn(4, 3))
    assert cap.coverage.gaps() == [] and caught == []


def test_a_trainable_bias_of_a_frozen_weight_is_a_warned_gap_not_a_decision() -> None:
    """BitFit-style training (a layer's weight frozen, its bias trainable): the bias was recorded "left out by
    include=/exclude=" (a decision, never warned) though neither was given; a model where only biases train is
    refused with what to pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    cap, _, caught = _capture(model, torch.randn(2, 3))
    gaps = {p.name: str(p.reason) for p in cap.coverage.gaps()}
    assert "include_frozen=True" in gaps["0.bias"] and len(caught) == 1
    model[2].weight.requires_grad_(False)
    with pytest.raises(CaptureUsageError, match="include_frozen=True"):
        GradientCapture(model, lambda batch: None, CaptureConfig.from_options(projection=None))


def test_a_position_map_of_three_non_trivial_dims_meets_the_batch_exactly() -> None:
    """A ``[1, C, H, W]`` learned map added to a convolution's output (was refused as a "parameter of 4 or more
    non-trivial dims"): a bare parameter slot, split where it meets the batch."""

    class Mapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 3, padding=1)
            self.pos = nn.Parameter(torch.randn(1, 3, 4, 4))
            self.head = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head((self.conv(x) + self.pos).relu().mean((2, 3)))

    torch.manual_seed(0)
    model, x = Mapped(), torch.randn(3, 2, 4, 4)
    cap, rows, caught = _capture(model, x, coverage="strict", loss_reduction="sum")  # the loss: the outputs' sum
    s = cap.spec.slot("pos")
    for i in range(3):
        expected = torch.autograd.grad(model(x[i : i + 1]).sum(), [model.pos])[0]
        torch.testing.assert_close(rows[0].grads[i, s.offset : s.offset + s.size], expected.reshape(-1))
    assert not caught


def _channel_normed(kind: str) -> tuple[nn.Module, torch.Tensor]:
    if kind == "batch1d-eval":
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4).eval(), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 3)
    norm = {
        "group": lambda: nn.GroupNorm(2, 4),
        "batch-eval": lambda: nn.BatchNorm2d(4).eval(),
        "instance": lambda: nn.InstanceNorm2d(4, affine=True),
        "instance-running-stats": lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True).eval(),
    }[kind]()
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm, nn.ReLU(), nn.Flatten(), nn.Linear(100, 2))
    return model, torch.randn(3, 3, 5, 5)


@pytest.mark.parametrize("kind", ["group", "batch-eval", "instance", "instance-running-stats", "batch1d-eval"])
def test_channel_norms_scales_and_shifts_are_exact_when_opted_in(kind: str) -> None:
    """``layer_types`` with ``"norm"``: GroupNorm, InstanceNorm and BatchNorm in eval mode normalise each example
    by its own (or fixed) statistics, so their scale and shift rows are the examples' own gradients (they were
    reported "used by group_norm in a way capture cannot split"); running statistics are left as they were."""
    torch.manual_seed(0)
    model, x = _channel_normed(kind)
    norm = model[1]
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
        if getattr(norm, "running_mean", None) is not None:
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cap, rows, caught = _capture(
        model, x, loss_reduction="sum", layer_types=("linear", "conv", "norm"), coverage="strict"
    )
    assert not caught
    for name in ("1.weight", "1.bias"):
        s, param = cap.spec.slot(name), dict(model.named_parameters())[name]
        for i in range(len(x)):
            expected = torch.autograd.grad(model(x[i : i + 1]).sum(), [param])[0]
            torch.testing.assert_close(rows[0].grads[i, s.offset : s.offset + s.size], expected, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if "running" in k)


def test_batch_norm_in_training_mode_stays_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(100, 2))
    cap, _, caught = _capture(model, torch.randn(3, 3, 5, 5), layer_types=("linear", "conv", "norm"))
    assert {"1.weight", "1.bias", "1 (mixes examples)"} <= {p.name for p in cap.coverage.gaps()} and caught


def test_a_failure_forming_rows_in_backward_never_stops_training(monkeypatch) -> None:
    """An error inside a capture hook during ``backward()`` (a rule that does not fit a model's layout) turns that
    slot "not captured" and warns; the training step's gradients are the plain ones (the error raised out of the
    user's ``backward()``, stopping training)."""
    from ingest.hooks import LayerHook

    real = LayerHook._block

    def failing(self, route, saved, dy):
        if self.slot.name == "0":
            raise RuntimeError("a layout this rule does not fit")
        return real(self, route, saved, dy)

    monkeypatch.setattr(LayerHook, "_block", failing)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(5, 3)
    expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    model.zero_grad()
    cap, rows, caught = _capture(model, x)
    record = {p.name: p for p in cap.coverage.parameters}
    assert not record["0.weight"].captured and "a layout this rule does not fit" in record["0.weight"].reason
    assert record["2.weight"].captured and len(rows) == 1 and len(caught) == 1
    for param, plain in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad, plain)


@pytest.mark.parametrize("shifted", [False, True], ids=["within-rows", "across-rows"])
def test_a_strided_view_is_followed_only_within_each_row(shifted) -> None:
    """``as_strided`` keeping each row's entries in its row (Longformer's overlapping chunks) keeps the examples'
    dim: the layer after it is exact; with rows 4 entries apart, each row reads the next example's entries too:
    that layer is recorded as not captured, never taken as the examples'."""

    class Strided(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 9), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))  # [B, 9]; chunks of 4 entries 4 apart, each row's from its own row or not
            chunks = h.as_strided((h.shape[0], 2, 4), (4 if shifted else 9, 4, 1), h.storage_offset())
            return self.b(chunks).sum(1)

    torch.manual_seed(0)
    model, x = Strided(), torch.randn(4, 3)
    cap, rows, caught = _capture(model, x, loss_reduction="sum")
    gaps = {p.name for p in cap.coverage.gaps()}
    if shifted:
        assert {"b.weight", "b.bias"} <= gaps and len(caught) == 1
        return
    assert gaps == set() and not caught
    s = cap.spec.slot("b")
    for i in range(4):
        model.zero_grad()
        model(x[i : i + 1]).sum().backward()
        expected = torch.cat([model.b.weight.grad, model.b.bias.grad[:, None]], 1).flatten()
        torch.testing.assert_close(rows[0].grads[i, s.offset : s.offset + s.size], expected, rtol=1e-5, atol=1e-6)


def test_a_product_after_the_examples_are_lost_is_not_called_a_mix() -> None:
    """A product with an operand whose examples' dim is not followed (after ``rot90``, an op the tracking does
    not follow) may or may not combine the examples: recorded as "ops not followed", with what is known, not as
    ops across the examples (SAM's and Longformer's exact rows were called mixed that way)."""

    class Lost(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))  # [B, 4, 4]
            turned = torch.rot90(h, 1, (1, 2))
            return self.b(h + turned @ turned.transpose(1, 2)).sum(1)

    torch.manual_seed(0)
    cap, _, caught = _capture(Lost(), torch.randn(3, 4, 4))
    mixed = [p for p in cap.coverage.gaps() if p.name.endswith("(mixes examples)")]
    assert [p.name for p in mixed] == ["ops not followed (mixes examples)"] and len(caught) == 1
    assert "not followed through an op before" in str(mixed[0].reason)
