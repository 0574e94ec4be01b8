"""Sequence-first models (``[T, B, ...]`` inputs: PyTorch's word-language-model LSTM, ``nn.Transformer`` with
``batch_first=False``): with ``example_dim=1`` every captured parameter's row equals the example's own gradient
(T != B and T == B alike); without it, capture takes the T positions for examples, and says so (the recurrent
layer and the attention are reported with the remedy, never silently zero or summed over examples)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradstore
from ingest.capture import CaptureConfig, GradientCapture
from ingest.coverage import CoverageWarning
from ingest.misuse import CaptureUsageError
from ingest.online_selection import KeepTopFraction, OnlineSelector

VOCAB = 13


class RecurrentLM(nn.Module):
    """pytorch/examples' word_language_model: ids ``[T, B]`` -> logits ``[T, B, V]``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 6)
        self.rnn = nn.LSTM(6, 5, num_layers=2)
        self.decoder = nn.Linear(5, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.encoder(ids))[0])


class TransformerLM(nn.Module):
    """A ``batch_first=False`` encoder (its attention and feed-forward layers get ``[T, B, E]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note that nested tensors need batch_first
            self.transformer = nn.TransformerEncoder(layer, 2)
        self.decoder = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[0])
        return self.decoder(self.transformer(self.encoder(ids), mask=mask, is_causal=True))


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of a ``[T, B]`` batch (the examples' mean loss: every example has T tokens)."""
    return nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))


def _slot_reference(model: nn.Module, grads: dict[str, torch.Tensor], slot) -> torch.Tensor:
    """A slot's exact layout of one example's gradient: ``[weight | bias]`` (an embedding's ``weight.T``)."""
    if slot.kind == "attention":
        base = slot.name.removesuffix(".in_proj")
        weight, bias = grads[f"{base}.in_proj_weight"], grads[f"{base}.in_proj_bias"]
    elif slot.kind == "recurrent":
        weight, bias = grads[slot.name], grads[slot.name.replace("weight", "bias")]
    elif slot.kind == "embedding":
        return grads[f"{slot.name}.weight"].T.flatten()
    else:
        weight, bias = grads[f"{slot.name}.weight"], grads.get(f"{slot.name}.bias")
    return torch.cat([weight, bias[:, None]], 1).flatten() if bias is not None else weight.flatten()


def _per_example(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each example's own gradient (its column of the batch alone), times B: the mean loss's rows are the
    examples' own losses' gradients."""
    names = [n for n, _ in model.named_parameters()]
    out = []
    for b in range(ids.shape[1]):
        loss = _loss(model, ids[:, b : b + 1], targets[:, b : b + 1])
        out.append(dict(zip(names, torch.autograd.grad(loss, list(model.parameters())))))
    return out


@pytest.mark.parametrize("model_class", [RecurrentLM, TransformerLM], ids=["lstm", "transformer"])
@pytest.mark.parametrize("steps", [7, 3], ids=["T!=B", "T==B"])
def test_sequence_first_rows_are_each_examples_gradient(model_class, steps) -> None:
    torch.manual_seed(0)
    model = model_class()
    ids, targets = torch.randint(0, VOCAB, (steps, 3)), torch.randint(0, VOCAB, (steps, 3))
    rows = []
    config = CaptureConfig.from_options(projection=None, example_dim=1, coverage="strict")
    with GradientCapture(model, rows.append, config) as cap:
        _loss(model, ids, targets).backward()
    grads = rows[0].grads
    assert grads.shape[0] == 3 and rows[0].num_tokens.tolist() == [steps] * 3
    reference = _per_example(model, ids, targets)
    captured = {s.name for s in cap.spec.layers}
    assert any(s.kind in ("recurrent", "attention") for s in cap.spec.layers), captured
    for slot in cap.spec.layers:
        expected = torch.stack([_slot_reference(model, g, slot) for g in reference])
        got = grads[:, slot.offset : slot.offset + slot.size]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=slot.name)
    # the hashes identify the examples (columns), not the time steps
    again = []
    with GradientCapture(model, again.append, config):
        _loss(model, ids[:, [2, 0, 1]], targets[:, [2, 0, 1]]).backward()
    assert again[0].example_hash == [rows[0].example_hash[i] for i in (2, 0, 1)]


@pytest.mark.parametrize(
    ("model_class", "reported"),
    [
        (RecurrentLM, "rnn.weight_ih_l0"),
        (TransformerLM, "transformer.layers.0.self_attn.in_proj_weight"),
    ],
    ids=["lstm", "transformer"],
)
def test_a_sequence_first_input_read_batch_first_is_reported_with_the_remedy(model_class, reported) -> None:
    torch.manual_seed(0)
    model = model_class()
    ids, targets = torch.randint(0, VOCAB, (7, 3)), torch.randint(0, VOCAB, (7, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientCapture(model, lambda batch: None, CaptureConfig.from_options(projection=None)) as cap:
            _loss(model, ids, targets).backward()
    gaps = {p.name: str(p.reason) for p in cap.coverage.gaps()}
    assert reported in gaps, gaps
    messages = [str(w.message) for w in caught if issubclass(w.category, CoverageWarning)]
    assert messages and "example_dim=1" in messages[-1]


def test_example_dim_through_the_store_writes_one_row_per_example(tmp_path) -> None:
    torch.manual_seed(0)
    model = RecurrentLM()
    store = gradstore.open(tmp_path / "store")
    ids, targets = torch.randint(0, VOCAB, (9, 4)), torch.randint(0, VOCAB, (9, 4))
    with store.capture(model, "lm", projection=None, example_dim=1, coverage="strict") as cap:
        cap.set_ids(["a", "b", "c", "d"])
        _loss(model, ids, targets).backward()
    table = store.sql("select example_id, num_tokens from gradients order by example_id").df()
    assert table["example_id"].tolist() == ["a", "b", "c", "d"] and table["num_tokens"].tolist() == [9] * 4


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"example_dim": -1}, "example_dim must be a non-negative int"),
        ({"example_dim": True}, "example_dim must be a non-negative int"),
        ({"example_dim": 1, "fused": True}, "leave fused=False"),
    ],
    ids=["negative", "bool", "fused"],
)
def test_bad_example_dims_are_refused(options, match) -> None:
    with pytest.raises(CaptureUsageError, match=match):
        GradientCapture(RecurrentLM(), lambda batch: None, CaptureConfig.from_options(**options))


def test_an_input_without_the_example_dim_is_refused() -> None:
    model = nn.Linear(4, 2)
    config = CaptureConfig.from_options(example_dim=1)
    refused = pytest.raises(CaptureUsageError, match="example_dim=1 but the model's input has shape")
    with GradientCapture(model, lambda batch: None, config), refused:
        model(torch.randn(4))


def test_online_selection_refuses_a_sequence_first_capture() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    cap = GradientCapture(model, lambda batch: None, CaptureConfig.from_options(example_dim=1))
    with pytest.raises(CaptureUsageError, match="select offline, or feed the model batch-first"):
        OnlineSelector(cap, KeepTopFraction(0.5), torch.zeros(cap.spec.dim))


def test_the_store_refuses_a_bad_example_dim_with_its_own_error(tmp_path) -> None:
    store = gradstore.open(tmp_path / "store")
    with pytest.raises(gradstore.GradstoreError, match="example_dim must be a non-negative int"):
        store.capture(RecurrentLM(), "lm", example_dim="time")


class CaptionDecoder(nn.Module):
    """Sequence-first token ids ``[T, B]`` cross-attending to a batch-first side input ``feats [B, N, C]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.proj = nn.Linear(5, 4)
        self.attend = nn.MultiheadAttention(4, 1)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        memory = self.proj(feats).transpose(0, 1)  # [N, B, 4]
        h = self.embed(ids)
        return self.head(h + self.attend(h, memory, memory, need_weights=False)[0])


def _caption_case(regions: int) -> tuple[nn.Module, GradientCapture, torch.Tensor, list, list]:
    torch.manual_seed(0)
    model = CaptionDecoder()
    ids, targets, feats = torch.randint(0, VOCAB, (4, 3)), torch.randint(0, VOCAB, (4, 3)), torch.randn(3, regions, 5)
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = CaptureConfig.from_options(projection=None, example_dim=1)
        with GradientCapture(model, rows.append, config) as cap:
            nn.functional.cross_entropy(model(ids, feats).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    names = [n for n, _ in model.named_parameters()]
    reference = []
    for b in range(3):
        loss = nn.functional.cross_entropy(model(ids[:, [b]], feats[[b]]).reshape(-1, VOCAB), targets[:, b])
        reference.append(dict(zip(names, torch.autograd.grad(loss, list(model.parameters())))))
    return model, cap, rows[0].grads, reference, [w for w in caught if issubclass(w.category, CoverageWarning)]


def test_a_batch_first_side_input_of_a_sequence_first_model_is_exact() -> None:
    """``feats [B, N, C]`` (N != B) has the batch's size along dim 0 only: its examples are there."""
    model, cap, grads, reference, caught = _caption_case(regions=5)
    assert not caught and not cap.coverage.gaps()
    for slot in cap.spec.layers:
        expected = torch.stack([_slot_reference(model, g, slot) for g in reference])
        torch.testing.assert_close(grads[:, slot.offset : slot.offset + slot.size], expected, rtol=1e-4, atol=1e-6)


def test_a_side_input_with_the_batch_size_along_both_dims_is_reported_not_guessed() -> None:
    """``feats [B, B, C]``: dim 0 or dim 1 could index the examples; reading it along ``example_dim`` gave `proj`
    another example's rows silently, now its uses are reported with the ambiguity named."""
    _, cap, _, _, caught = _caption_case(regions=3)
    gaps = {p.name for p in cap.coverage.gaps()}
    assert {"proj.weight", "proj.bias"} <= gaps, gaps
    assert any("along dim 0 and dim 1" in str(w.message) for w in caught)


def test_one_example_with_a_position_lookup_of_the_whole_sequence_is_exact() -> None:
    """B == 1 with ``pos(arange(T))`` (a ``[T]`` input of a hooked Embedding, no batch dim): it meets the batch at
    the add, as for B > 1 (it raised "got a batch of T for a forward of 1 examples", stopping the training)."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(VOCAB, 4), nn.Embedding(8, 4), nn.Linear(4, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))

    torch.manual_seed(0)
    model, ids = Positions(), torch.randint(0, VOCAB, (1, 5))
    rows = []
    with GradientCapture(model, rows.append, CaptureConfig.from_options(projection=None, coverage="strict")) as cap:
        nn.functional.cross_entropy(model(ids)[0], ids[0]).backward()
    grads = dict(model.named_parameters())
    expected = torch.autograd.grad(nn.functional.cross_entropy(model(ids)[0], ids[0]), [grads["pos.weight"]])[0]
    s = cap.spec.slot("pos")
    torch.testing.assert_close(rows[0].grads[0, s.offset : s.offset + s.size], expected.T.flatten())
