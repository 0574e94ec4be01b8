"""What the trajectory methods (``tracin-steps``, ``source``, ``dvemb``) do with ``split`` and ``where``.

``dvemb`` honours ``where`` on the in-loop training rows it sums (each step's curvature and batch size stay the
whole step's): a step filter is the effect of up-weighting the examples at those steps only, through the whole
recorded trajectory (checked against autograd on the quadratic problem of :mod:`quadratic`). A split a method
does not read, or a ``where`` that selects none of its rows, is an ``InvalidArgumentError`` naming the user's run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quadratic import INIT, RUN, N, T, columns, passes_store, problem, true_effects

from gradstore.errors import InvalidArgumentError
from gradstore.methods import dvemb


def effects_of_steps(first: int) -> np.ndarray:
    """``-d L_q(theta_T) / d w_z`` for loss weights ``w_z`` on the rows of steps ``>= first`` only (float64
    autograd through the whole schedule)."""
    x, y, qx, qy, batches, rates = problem()
    weights = torch.ones(T, N, dtype=torch.float64, requires_grad=True)
    theta = INIT.clone().requires_grad_()
    xt = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    qt = torch.cat([qx, torch.ones(2, 1, dtype=torch.float64)], 1)
    for t in range(T):
        batch = batches[t]
        residual = xt[batch] @ theta - y[batch]
        (grad,) = torch.autograd.grad((weights[t, batch] * 0.5 * residual**2).mean(), theta, create_graph=True)
        theta = theta - rates[t] * grad
    effects = []
    for query in range(2):
        (grad_w,) = torch.autograd.grad(0.5 * (qt[query] @ theta - qy[query]) ** 2, weights, retain_graph=True)
        effects.append(-grad_w[first:].sum(0).numpy())
    return np.stack(effects)


@pytest.fixture
def store(tmp_path):
    return passes_store(tmp_path / "store")


def test_dvemb_where_selects_the_summed_rows_through_the_whole_trajectory(store, monkeypatch):
    full = columns(store.score_matrix(["qa", "qb"], run=RUN, method="dvemb"))
    np.testing.assert_allclose(full, true_effects()[0], rtol=2e-4, atol=1e-6)
    later = columns(store.score_matrix(["qa", "qb"], run=RUN, method="dvemb", where="step >= 5"))
    np.testing.assert_allclose(later, effects_of_steps(5), rtol=2e-4, atol=1e-6)
    assert not np.allclose(later, full)
    # an example filter keeps the others' embeddings whole (curvature and batch sizes are the steps' own)
    others = store.score_matrix(["qa", "qb"], run=RUN, method="dvemb", where="example_id != '3'")
    assert "3" not in others.example_ids
    kept = [int(e) for e in others.example_ids]
    np.testing.assert_allclose(columns(others)[:, kept], full[:, kept], rtol=1e-5, atol=1e-7)
    # the unfiltered embeddings were kept beside the variants: no rebuild, the same scores
    calls = []
    recursion = dvemb.recursion
    monkeypatch.setattr(dvemb, "recursion", lambda *args: calls.append(args) or recursion(*args))
    again = columns(store.score_matrix(["qa", "qb"], run=RUN, method="dvemb"))
    assert calls == []
    np.testing.assert_array_equal(again, full)
    top = store.attribute(["qa"], run=RUN, method="dvemb", where="step >= 5", k=3, write=False)
    expected = np.argsort(-effects_of_steps(5)[0], kind="stable")[:3]
    assert [int(e) for e in top.column("example_id").to_pylist()] == expected.tolist()


def test_dvemb_self_influence_and_select_honour_where(store):
    final = store.core.read_gradients(RUN, checkpoint="final", split="train")
    where = "step >= 5"
    dense = store.score_matrix(final.vectors, run=RUN, method="dvemb", where=where)
    column = {e: i for i, e in enumerate(dense.example_ids)}
    own = final.metadata.column("example_id").to_pylist()
    table = store.self_influence(run=RUN, method="dvemb", where=where, write=False)
    got = dict(zip(table.column("example_id").to_pylist(), table.column("self_influence").to_pylist()))
    expected = {e: dense.scores[row, column[e]] if e in column else 0.0 for row, e in enumerate(own)}
    assert set(got) == set(own)
    np.testing.assert_allclose([got[e] for e in own], [expected[e] for e in own], rtol=1e-4, atol=1e-7)
    targets = store.score_matrix(["qa", "qb"], run=RUN, method="dvemb", where=where)
    chosen = store.select(["qa", "qb"], run=RUN, preconditioner="dvemb", budget=3, where=where)
    values = targets.scores.max(0)
    order = sorted(range(len(values)), key=lambda i: (-values[i], targets.example_ids[i]))[:3]
    assert chosen.column("example_id").to_pylist() == [targets.example_ids[i] for i in order]


@pytest.mark.parametrize("method", ["dvemb", "tracin-steps"])
@pytest.mark.parametrize("split", ["query", "true-fisher"])
def test_in_loop_methods_refuse_a_split_they_do_not_read(store, method, split):
    with pytest.raises(InvalidArgumentError, match=f"does not use split='{split}'.*split 'train'|split 'train'"):
        store.score_matrix(["qa"], run=RUN, method=method, split=split)
    with pytest.raises(InvalidArgumentError, match="split 'train'"):
        store.attribute(["qa"], run=RUN, method=method, split=split, write=False)
    with pytest.raises(InvalidArgumentError, match="split 'train'"):
        store.self_influence(run=RUN, method=method, split=split, write=False)


@pytest.mark.parametrize("method", ["dvemb", "tracin-steps", "source"])
@pytest.mark.parametrize("where", ["step < 0", "example_id = 'nope'"])
def test_a_where_matching_no_rows_names_the_run_and_the_filter(store, method, where):
    for call in (
        lambda: store.score_matrix(["qa"], run=RUN, method=method, where=where),
        lambda: store.attribute(["qa"], run=RUN, method=method, where=where, write=False),
        lambda: store.select(["qa"], run=RUN, preconditioner=method, where=where),
    ):
        with pytest.raises(InvalidArgumentError) as caught:
            call()
        message = str(caught.value)
        assert f"where={where!r} matches none" in message and f"run {RUN!r}" in message, message
        assert dvemb.derived_run(RUN) not in message and "capture the run first" not in message


def test_source_names_the_split_it_reads(store):
    with pytest.raises(InvalidArgumentError, match="curvature rows, which it fits") as caught:
        store.score_matrix(["qa"], run=RUN, method="source", split="true-fisher")
    assert "no checkpoint pass" not in str(caught.value)
    with pytest.raises(InvalidArgumentError, match=r"holds no 'held-out' rows at its checkpoint passes \['final', "):
        store.score_matrix(["qa"], run=RUN, method="source", split="held-out")


def test_source_where_selects_scored_rows_not_the_curvature(tmp_path):
    """Without true-Fisher rows a segment's curvature is its pass's training rows, all of them: an example filter
    leaves the other examples' scores as they were, and a filter leaving a pass without rows still scores."""
    store = passes_store(tmp_path / "store", true_fisher=False)
    full = columns(store.score_matrix(["qa", "qb"], run=RUN, method="source"))
    others = store.score_matrix(["qa", "qb"], run=RUN, method="source", where="example_id != '3'")
    kept = [int(e) for e in others.example_ids]
    assert 3 not in kept
    np.testing.assert_allclose(columns(others)[:, kept], full[:, kept], rtol=1e-5, atol=1e-7)
    final_only = columns(store.score_matrix(["qa", "qb"], run=RUN, method="source", where=f"step >= {T}"))
    assert np.isfinite(final_only).all() and not np.allclose(final_only, full)
