"""Per-token attribution: token scores sum to the example's score on both sides, and equal a brute-force
per-token computation (torch.func gradients with respect to per-position copies of every captured weight,
projected with the run's matrices) on a tiny GPT-2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_gpt2

import gradstore
from gradstore.methods.queries import QueryBatch
from ingest.projection import projection_matrix

pytest.importorskip("transformers")

LENGTH, N_TRAIN, N_QUERY, K = 8, 12, 2, 3
RUN = "lm"


def _texts():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 64, (N_TRAIN + N_QUERY, LENGTH), generator=generator)
    lengths = torch.randint(5, LENGTH + 1, (N_TRAIN + N_QUERY,), generator=generator)
    return [ids[i, : lengths[i]].tolist() for i in range(len(ids))]


def _batch(sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded ids (pad 0), attention mask and labels (-100 on padding)."""
    ids = torch.zeros(len(sequences), LENGTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.fixture(scope="module")
def lm_store(tmp_path_factory):
    """A tiny GPT-2's training rows (token-mean loss, factorized 4 x 4, float32, Kronecker curvature)."""
    model = tiny_gpt2().eval()
    sequences = _texts()
    train = {f"t{i}": sequences[i] for i in range(N_TRAIN)}
    store = gradstore.open(tmp_path_factory.mktemp("tokens") / "store", storage_dtype="float32")
    with store.capture(
        model, RUN, checkpoint="final", k_in=4, k_out=4, loss_reduction="token_mean", curvature=True
    ) as cap:
        for start in range(0, N_TRAIN, 4):
            ids = list(train)[start : start + 4]
            cap.set_ids(ids)
            model(**_batch([train[i] for i in ids])).loss.backward()
            model.zero_grad()
    queries = QueryBatch(
        model,
        _batch(sequences[N_TRAIN:]),
        ids=[f"q{i}" for i in range(N_QUERY)],
        options={"loss_reduction": "token_mean"},
    )
    return store, model, train, queries


def _examples(train):
    return lambda ids: _batch([train[i] for i in ids])


def _brute_force_token_rows(store, model, sequence: list[int]) -> torch.Tensor:
    """``[T, dim]``: token t's projected share of the example's row, from torch.func gradients with respect to
    zero per-position weight offsets (position t's offset only acts on position t)."""
    slots = store.core.run_spec(RUN).layers
    modules = {slot.name: model.get_submodule(slot.name) for slot in slots}
    batch = _batch([sequence])
    length = LENGTH

    def offsets_of(slot):
        if slot.kind == "embedding":
            return {"w": torch.zeros(length, slot.d_in, slot.d_out)}
        offsets = {"w": torch.zeros(length, slot.d_out, slot.d_in)}
        if slot.has_bias:
            offsets["b"] = torch.zeros(length, slot.d_out)
        return offsets

    def loss(offsets):
        def hook(slot, module, args, output):
            x, o = args[0], offsets[slot.name]
            if slot.kind == "embedding":
                return output + o["w"][torch.arange(length), x[0]]
            extra = torch.einsum("bti,toi->bto", x, o["w"])
            return output + extra + o.get("b", 0)

        handles = [modules[s.name].register_forward_hook(lambda m, a, out, s=s: hook(s, m, a, out)) for s in slots]
        try:
            return model(**batch).loss
        finally:
            for handle in handles:
                handle.remove()

    grads = torch.func.grad(loss)({s.name: offsets_of(s) for s in slots})
    rows = torch.zeros(length, store.run(RUN)["dim"], dtype=torch.float64)
    for slot in slots:
        g = grads[slot.name]
        per_token = g["w"].transpose(1, 2) if slot.kind == "embedding" else g["w"]  # [T, d_out, d_in]
        if slot.has_bias:
            per_token = torch.cat([per_token, g["b"][:, :, None]], dim=2)
        p_in = projection_matrix(0, slot.name, "in", slot.k_in, slot.d_in_eff).double()
        p_out = projection_matrix(0, slot.name, "out", slot.k_out, slot.d_out).double()
        rows[:, slot.offset : slot.offset + slot.size] = (p_out @ per_token.double() @ p_in.T).flatten(1)
    return rows[: len(sequence)].detach()


def test_grad_dot_token_scores_equal_brute_force_torch_func(lm_store):
    store, model, train, queries = lm_store
    table = store.token_scores(queries, _examples(train), run=RUN, k=K, method="grad-dot", write=False).to_pandas()
    sequences = _texts()
    query_rows = {f"q{i}": _brute_force_token_rows(store, model, sequences[N_TRAIN + i]) for i in range(N_QUERY)}
    assert set(table.query_id) == set(query_rows)
    for (query_id, example_id), group in table.groupby(["query_id", "example_id"]):
        example = _brute_force_token_rows(store, model, train[example_id])
        q = query_rows[query_id]
        for side, want in (("train", example @ q.sum(0)), ("query", q @ example.sum(0))):
            rows = group[group.side == side].sort_values("position")
            assert rows.position.tolist() == list(range(len(want)))  # every token, no padding
            assert rows.token_id.tolist() == (
                train[example_id] if side == "train" else sequences[N_TRAIN + int(query_id[1:])]
            )
            np.testing.assert_allclose(rows.score.to_numpy(), want.numpy(), rtol=1e-4, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("method", ["grad-dot", "fisher", "kfac"])
def test_token_scores_sum_to_the_example_score_on_both_sides(lm_store, method):
    store, _, train, queries = lm_store
    table = store.token_scores(queries, _examples(train), run=RUN, k=K, method=method, write=False).to_pandas()
    stored = store.attribute(queries, run=RUN, k=K, method=method, write=False).to_pandas()
    assert sorted(zip(stored.query_id, stored.example_id, stored["rank"])) == sorted(
        set(zip(table.query_id, table.example_id, table["rank"]))
    )  # the store's top-k, re-ranked per token
    sums = table.groupby(["query_id", "example_id", "side"]).score.sum().unstack("side")
    np.testing.assert_allclose(sums["train"], sums["query"], rtol=1e-4)  # P^-1 applied in float32 either side
    expected = stored.set_index(["query_id", "example_id"]).score.loc[sums.index]
    np.testing.assert_allclose(sums["train"].to_numpy(), expected.to_numpy(), rtol=2e-3)


def test_token_scores_table_and_top_tokens_macro(lm_store):
    store, _, train, queries = lm_store
    table = store.token_scores(
        queries, _examples(train), run=RUN, k=K, method="fisher", token_text=lambda t: f"w{t}"
    ).to_pandas()
    assert (table.token == "w" + table.token_id.astype(str)).all()
    top = store.sql("select * from top_tokens('q1', 5)").df()
    expected = (
        table[(table.query_id == "q1") & (table.side == "train")]
        .sort_values(["score", "rank", "position"], ascending=[False, True, True])
        .head(5)
    )
    assert top.example_id.tolist() == expected.example_id.tolist()
    assert top.position.tolist() == expected.position.tolist()
    np.testing.assert_allclose(top.score, expected.score)
    following = table.set_index(["query_id", "example_id", "side", "position"]).token
    for row in top.itertuples():
        key = ("q1", row.example_id, "train", row.position + 1)
        assert row.next_token == (following[key] if key in following.index else None)


def test_token_scores_refuse_methods_that_do_not_decompose(lm_store):
    store, _, train, queries = lm_store
    for method in ("cosine", "trackstar", "tracin"):
        with pytest.raises(gradstore.GradstoreError, match="token_scores does not take"):
            store.token_scores(queries, _examples(train), run=RUN, k=K, method=method, write=False)


@pytest.mark.parametrize(
    "options",
    [
        {"projection": None},
        {"projection": "dense", "k_in": 2, "k_out": 4},
        {"k_in": 3, "k_out": 2, "normalizer": "adam_factored"},
    ],
    ids=["exact", "dense", "factorized-adam"],
)
def test_token_rows_sum_to_the_captured_row(options):
    from ingest import CaptureConfig, GradientCapture
    from ingest.tokens import TokenGradientCapture

    model = tiny_gpt2().eval()
    batch = _batch(_texts()[:4])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(**batch).loss.backward()
    optimizer.step()  # Adam state for the normaliser
    optimizer.zero_grad()
    config = {"loss_reduction": "token_mean", **options}
    captured = []
    with GradientCapture(model, captured.append, CaptureConfig.from_options(**config), optimizer=optimizer):
        model(**batch).loss.backward()
    model.zero_grad()
    with TokenGradientCapture(model, CaptureConfig.from_options(**config), optimizer=optimizer) as capture:
        model(**batch).loss.backward()
    tokens = capture.results[0]
    assert tokens.rows.shape[:2] == batch["input_ids"].shape
    assert torch.equal(tokens.inputs, batch["input_ids"]) and torch.equal(tokens.mask, batch["attention_mask"].bool())
    assert tokens.rows[~tokens.mask].abs().max() == 0  # padding carries nothing
    torch.testing.assert_close(
        tokens.rows.sum(dim=1), captured[0].grads, rtol=1e-4, atol=1e-5 * captured[0].grads.abs().max().item()
    )


def test_layers_that_do_not_run_per_token_are_refused():
    from torch import nn

    from ingest import CaptureConfig
    from ingest.tokens import TokenGradientCapture

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)

        def forward(self, input_ids):
            return self.head(self.embed(input_ids).mean(dim=1))  # the head sees one position per example

    model = Pooled()
    with (
        pytest.raises(ValueError, match="positions per example"),
        TokenGradientCapture(model, CaptureConfig.from_options(k_in=2, k_out=2)),
    ):
        model(torch.randint(0, 10, (3, 5))).sum().backward()
    with TokenGradientCapture(model, CaptureConfig.from_options(k_in=2, k_out=2, exclude="head")) as capture:
        model(torch.randint(0, 10, (3, 5))).sum().backward()
    assert capture.results[0].rows.shape == (3, 5, 4)
