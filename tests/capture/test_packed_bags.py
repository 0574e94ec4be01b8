"""Packed bags (ingest.bags): a batch given as nn.EmbeddingBag takes it, flat ids and offsets (PyTorch's text
classification tutorial). The rows' exactness is checked by the model zoo (``packed-bags``, ``packed-bags-last``);
here: which examples a batch holds, their ids and token counts, through the store, and a bag call on other
offsets reported, not split."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradstore
from ingest.bags import bag_modules, packed_bags
from ingest.capture import CaptureConfig, GradientCapture
from ingest.coverage import CoverageWarning
from ingest.ids import content_hashes


class TextClassificationModel(nn.Module):
    """The tutorial's model: ``nn.EmbeddingBag`` (mean) and a linear head, called as ``model(text, offsets)``."""

    def __init__(self, vocab: int = 30, dim: int = 6, classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab, dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, text: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(text, offsets))


def packed(bags: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ids and the offsets where each bag starts."""
    lengths = torch.tensor([len(b) for b in bags])
    return torch.tensor([i for b in bags for i in b]), torch.cumsum(lengths, 0) - lengths


def captured_rows(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list:
    out: list = []
    with GradientCapture(model, out.append, CaptureConfig.from_options(projection=None)):
        for text, offsets, y in batches:
            F.cross_entropy(model(text, offsets), y).backward()
    return out


def test_a_batch_of_packed_bags_is_one_example_per_bag_with_its_own_ids_and_length():
    torch.manual_seed(0)
    model = TextClassificationModel()
    first = [[3, 4, 5], [7], [8, 9, 10, 11], [2, 2]]
    second = [[7], [12, 13], [3, 4, 5]]  # two of the first batch's examples, packed elsewhere
    (t1, o1), (t2, o2) = packed(first), packed(second)
    got = captured_rows(model, [(t1, o1, torch.tensor([0, 1, 2, 3])), (t2, o2, torch.tensor([1, 0, 0]))])
    assert [b.grads.shape[0] for b in got] == [4, 3]
    assert got[0].num_tokens.tolist() == [3, 1, 4, 2]
    assert got[1].num_tokens.tolist() == [1, 2, 3]
    # each bag's hash is that of its ids alone, whatever the batch it came in
    alone = [content_hashes(torch.tensor([bag]), None)[0] for bag in first]
    assert got[0].example_ids == alone
    assert got[1].example_ids[0] == got[0].example_ids[1] and got[1].example_ids[2] == got[0].example_ids[0]
    # the same examples as a padded batch with an attention mask hash the same
    padded = torch.tensor([[3, 4, 5, 0], [7, 0, 0, 0], [8, 9, 10, 11], [2, 2, 0, 0]])
    mask = (torch.arange(4)[None] < torch.tensor([3, 1, 4, 2])[:, None]).long()
    assert content_hashes(padded, mask) == alone


def test_offsets_are_recognised_only_when_valid_and_with_an_embedding_bag():
    model = TextClassificationModel()
    modules = bag_modules(model)
    text = torch.tensor([1, 2, 3, 4, 5])
    assert packed_bags(modules, (text, torch.tensor([0, 2, 4])), {}, text).lengths.tolist() == [2, 2, 1]
    assert packed_bags(modules, (text,), {"offsets": torch.tensor([0, 0, 5])}, text).lengths.tolist() == [0, 5, 0]
    for bad in ([1, 2], [0, 3, 2], [0, 6], [], [[0, 1]]):
        assert packed_bags(modules, (text, torch.tensor(bad, dtype=torch.long)), {}, text) is None, bad
    assert packed_bags([], (text, torch.tensor([0, 2])), {}, text) is None  # no EmbeddingBag in the model
    assert packed_bags(modules, (text, torch.tensor([0.0, 2.0])), {}, text) is None  # not offsets
    last = bag_modules(nn.EmbeddingBag(9, 2, include_last_offset=True))
    assert packed_bags(last, (text, torch.tensor([0, 2, 5])), {}, text).lengths.tolist() == [2, 3]
    assert packed_bags(last, (text, torch.tensor([0, 2, 4])), {}, text) is None  # must end at the ids' count


def test_a_bag_call_on_other_offsets_is_reported_not_split():
    """The forward is given valid offsets but bags the ids otherwise (here: every id alone): those uses are
    not the examples' bags, so the table and the head after it are reported, never split on the wrong bags."""

    class Rebagged(TextClassificationModel):
        def forward(self, text: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            pooled = self.embedding(text, torch.arange(text.shape[0]))  # one bag per id
            return self.fc(pooled).sum(0, keepdim=True).expand(offsets.shape[0], -1)

    torch.manual_seed(1)
    text, offsets = packed([[1, 2], [3, 4], [5, 6]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = captured_rows(Rebagged(), [(text, offsets, torch.tensor([0, 1, 2]))])
    messages = " ".join(str(w.message) for w in caught if issubclass(w.category, CoverageWarning))
    assert "embedding.weight" in messages and "fc" in messages
    assert all(float(b.grads.abs().sum()) == 0.0 for b in got)


def test_the_tutorial_loop_through_the_store_attributes_to_bags(tmp_path):
    torch.manual_seed(2)
    model = TextClassificationModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    store = gradstore.open(tmp_path / "store")
    bags = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [1, 2, 3], [11, 12]]
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    with store.capture(model, run="tutorial", optimizer=opt, k_in=4, k_out=4) as cap:
        for start in (0, 3):
            text, offsets = packed(bags[start : start + 3])
            opt.zero_grad()
            F.cross_entropy(model(text, offsets), labels[start : start + 3]).backward()
            opt.step()
    assert cap.coverage.summary().startswith("100.0%")
    rows = store.sql("select example_id, num_tokens from gradients order by step, grad_id").fetchall()
    assert sorted(n for _, n in rows) == sorted(len(b) for b in bags)
    assert len({e for e, _ in rows}) == 5  # the repeated bag is one example
    with store.capture(model, run="tutorial", split="query") as cap:
        text, offsets = packed([[4, 5]])
        F.cross_entropy(model(text, offsets), torch.tensor([1])).backward()
    found = store.attribute(run="tutorial", k=2, method="grad-dot")
    assert found.num_rows == 2 and set(found.column("example_id").to_pylist()) <= {e for e, _ in rows}


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
