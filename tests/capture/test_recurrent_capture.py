"""Recurrent layers captured at their fused ops (:mod:`ingest.uses.recurrent`): exact where the layer can be
recomputed step by step (the model zoo's ``recurrent`` and ``recurrent-cells`` cases check the rows), reported
where it cannot (dropout between stacked layers in training), never silently wrong; a learned initial state meets
the batch at the op; packed sequences are followed through their sorting (the zoo's ``recurrent-packed``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradstore
from ingest.capture import CaptureConfig, GradientCapture
from ingest.coverage import CoverageWarning

LSTM_WEIGHTS = {f"lstm.{w}_l{k}" for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh") for k in (0, 1)}


class Tagger(nn.Module):
    def __init__(self, dropout: float = 0.0, learned_state: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(4, 2)
        self.h0 = nn.Parameter(torch.randn(*learned_state)) if learned_state else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        if self.h0 is not None:  # [layers, H] or, as often stored, [layers, 1, H]
            h0 = self.h0 if self.h0.dim() == 3 else self.h0[:, None]
            h0 = h0.expand(-1, x.shape[0], -1).contiguous()
            state = (h0, torch.zeros_like(h0))
        return self.head(self.lstm(x, state)[0][:, -1])


def _per_example(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's own gradient (the example alone through an ordinary backward)."""
    names = [n for n, _ in model.named_parameters()]
    per = []
    for i in range(x.shape[0]):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        per.append(torch.autograd.grad(loss, list(model.parameters())))
    return {n: torch.stack([g[j] for g in per]) for j, n in enumerate(names)}


def _capture(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[GradientCapture, torch.Tensor | None, list]:
    rows: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, rows.append, CaptureConfig.from_options(projection=None)) as cap:
            nn.functional.cross_entropy(model(x), y).backward()
    return cap, rows[0].grads if rows else None, [w for w in caught if issubclass(w.category, CoverageWarning)]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 6, 3), torch.tensor([0, 1, 1, 0])


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"dropout": 0.5}, "with dropout between its layers"),
    ],
    ids=["dropout-between-layers"],
)
def test_a_recurrent_layer_it_cannot_recompute_is_reported_and_left_zero(options, why) -> None:
    x, y = _batch()
    cap, rows, caught = _capture(Tagger(**options).train(), x, y)
    gaps = {p.name: str(p.reason) for p in cap.coverage.gaps()}
    assert set(gaps) >= LSTM_WEIGHTS and all(gaps[n].startswith(f"used by lstm {why}") for n in LSTM_WEIGHTS), gaps
    assert caught and all("lstm.weight_ih_l0" in str(w.message) for w in caught)
    for name in ("lstm.weight_ih_l0", "lstm.weight_hh_l1"):
        s = cap.spec.slot(name)
        assert torch.count_nonzero(rows[:, s.offset : s.offset + s.size]) == 0  # nothing half-captured
    head = cap.spec.slot("head")
    assert torch.count_nonzero(rows[:, head.offset : head.offset + head.size]) > 0


def test_dropout_between_layers_in_eval_mode_is_exact() -> None:
    """The inter-layer dropout only runs in training mode: in eval mode the layer is recomputed exactly."""
    x, y = _batch()
    model = Tagger(dropout=0.5).eval()
    reference = _per_example(model, x, y)
    cap, rows, caught = _capture(model, x, y)
    assert not caught and cap.coverage.fraction == 1.0
    for k in (0, 1):
        for side in ("ih", "hh"):
            s = cap.spec.slot(f"lstm.weight_{side}_l{k}")
            block = rows[:, s.offset : s.offset + s.size].reshape(4, s.d_out, s.d_in + 1)
            expected = torch.cat([reference[s.name], reference[f"lstm.bias_{side}_l{k}"][..., None]], dim=-1)
            torch.testing.assert_close(block, expected, rtol=1e-4, atol=1e-6)


def test_an_lstm_run_is_stored_and_attributed(tmp_path) -> None:
    """Through the store with the default (factorized) projection: every row stored, a training example is its
    own best match."""
    x, y = _batch()
    model = Tagger().train()
    store = gradstore.open(tmp_path / "store")
    with store.capture(model, run="lstm") as cap:
        cap.set_ids([f"ex{i}" for i in range(4)])
        nn.functional.cross_entropy(model(x), y).backward()
    with store.capture(model, run="lstm", split="query") as queries:
        queries.set_ids([f"q{i}" for i in range(4)])
        nn.functional.cross_entropy(model(x), y).backward()
    assert cap.coverage.fraction == 1.0
    assert store.info()["coverage"]["lstm"]["not_captured"] == []
    top = store.attribute(["q2"], run="lstm", k=1, method="grad-dot").to_pandas()
    assert top.example_id.tolist() == ["ex2"]
    with pytest.raises(gradstore.GradstoreError, match=r"pass a list, queries=\['q2'\]"):
        store.attribute("q2", run="lstm", k=1, method="grad-dot")


def test_a_recomputation_that_fails_never_stops_the_training(monkeypatch) -> None:
    """Whatever goes wrong recomputing the layer in the backward (a dtype, a device), the step finishes with the
    ordinary gradients and the layer's slots are reported as missing it."""
    import ingest.uses.recurrent as recurrent

    def broken(call):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(recurrent, "recompute", broken)
    x, y = _batch()
    model = Tagger().train()
    expected = _per_example(model, x, y)
    cap, rows, caught = _capture(model, x, y)
    gaps = {p.name: str(p.reason) for p in cap.coverage.gaps()}
    assert set(gaps) >= LSTM_WEIGHTS and "recomputed for its rows failed" in gaps["lstm.weight_ih_l0"]
    assert caught and torch.count_nonzero(rows[:, : cap.spec.slot("head").offset]) == 0
    torch.testing.assert_close(model.lstm.weight_hh_l1.grad, expected["lstm.weight_hh_l1"].mean(0))


@pytest.mark.parametrize("shape", [(2, 4), (2, 1, 4)], ids=["layers-by-hidden", "layers-by-1-by-hidden"])
def test_a_learned_initial_state_is_captured_with_the_weights(shape) -> None:
    """``h0`` a parameter expanded over the batch: it meets the batch at the recurrent op, and each example's
    gradient of it is that example's initial-state gradient (from the op's own backward); the weights are exact.
    A ``[layers, 1, H]`` state is one parameter, not a stack of ``[1, H]`` matrices (which knocked the layer out)."""
    x, y = _batch()
    model = Tagger(learned_state=shape).train()
    reference = _per_example(model, x, y)
    cap, rows, caught = _capture(model, x, y)
    assert not caught and cap.coverage.fraction == 1.0
    h0 = cap.spec.slot("h0")
    torch.testing.assert_close(
        rows[:, h0.offset : h0.offset + h0.size], reference["h0"].reshape(4, -1), rtol=1e-4, atol=1e-6
    )
    s = cap.spec.slot("lstm.weight_hh_l0")
    block = rows[:, s.offset : s.offset + s.size].reshape(4, s.d_out, s.d_in + 1)
    torch.testing.assert_close(block[..., :-1], reference["lstm.weight_hh_l0"], rtol=1e-4, atol=1e-6)


class PackedOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, packed: nn.utils.rnn.PackedSequence) -> torch.Tensor:
        return self.head(self.lstm(packed)[1][0][-1])


def test_a_sequence_packed_before_the_captured_forward_is_reported() -> None:
    """Packed outside the model, the packed rows' examples cannot be told: the LSTM's weights are a recorded gap, and
    the step, which brings no captured layer a gradient of its examples, is recorded as one without rows."""
    x, y = _batch()
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 5, 3, 2]), batch_first=True)
    model = PackedOutside()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, lambda batch: None, CaptureConfig.from_options(projection=None)) as cap:
            cap.set_ids(["a", "b", "c", "d"])
            nn.functional.cross_entropy(model(packed), y).backward()
    gaps = {p.name: str(p.reason) for p in cap.coverage.gaps()}
    assert "packed before the captured forward" in gaps["lstm.weight_ih_l0"]
    assert any(issubclass(w.category, CoverageWarning) for w in caught)
    # nothing of the step reached a captured layer as the batch's: the step's missing rows are recorded too
    assert "no captured layer got a gradient" in gaps["(steps without rows)"]


class InPlaceAfter(nn.Module):
    """A sequence-first GRU (its input ``embed(ids.T)``: the ``.T`` property) whose output and final state the model
    changes in place (``ReLU(inplace=True)``, ``mul_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.gru = nn.GRU(3, 4)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, h = self.gru(self.embed(ids.T))
        h.mul_(0.5)
        return self.head(self.act(out).mean(0) + h[-1])


def test_in_place_ops_on_the_outputs_and_a_transposed_input_keep_the_rows_exact() -> None:
    """In-place ops on a recurrent layer's outputs changed the gradient its capture saw (rows zero or 26-98% off at
    coverage 100%), and ``ids.T`` with as many positions as examples was taken as batch-first: both exact now."""
    torch.manual_seed(0)
    ids, y = torch.randint(0, 10, (4, 4)), torch.tensor([0, 1, 1, 0])
    model = InPlaceAfter()
    reference = _per_example(model, ids, y)
    cap, rows, caught = _capture(model, ids, y)
    assert not caught and cap.coverage.fraction == 1.0
    for name, bias in (("gru.weight_ih_l0", "gru.bias_ih_l0"), ("gru.weight_hh_l0", "gru.bias_hh_l0")):
        s = cap.spec.slot(name)
        block = rows[:, s.offset : s.offset + s.size].reshape(4, s.d_out, s.d_in + 1)
        expected = torch.cat([reference[name], reference[bias][..., None]], dim=-1)
        torch.testing.assert_close(block, expected, rtol=1e-4, atol=1e-6)
    s = cap.spec.slot("embed")
    embedded = reference["embed.weight"].transpose(1, 2).flatten(1)
    torch.testing.assert_close(rows[:, s.offset : s.offset + s.size], embedded, rtol=1e-4, atol=1e-6)
