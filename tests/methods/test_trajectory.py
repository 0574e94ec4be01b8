"""Trajectory-aware attribution (``tracin-steps``, ``source``, ``dvemb``) against closed forms.

The model is a linear regression with squared loss: quadratic in its weights, so the batch Hessian is exactly
``mean x~ x~^T`` and the true-Fisher rows (gradients of the output, split ``"true-fisher"``) give it exactly.
The reference is autograd through the recorded SGD trajectory with per-example loss weights: the true effect of
up-weighting an example on each query's final loss.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from quadratic import (
    INIT,
    RUN,
    D,
    N,
    T,
    capture_queries,
    columns,
    model_at,
    passes_store,
    problem,
    train_captured,
    trained_store,
    true_effects,
)

import gradstore
from gradstore.errors import InvalidArgumentError, MissingIdsError
from gradstore.methods import TRUE_FISHER_SPLIT, dvemb


@pytest.fixture
def trained(built_store, tmp_path):
    """A copy of the trained store (built once per session: :func:`quadratic.trained_store`)."""
    shutil.copytree(built_store("quadratic", trained_store), tmp_path / "store")
    return gradstore.open(tmp_path / "store")


@pytest.mark.parametrize("chunk_bytes", [None, 1])  # the default; a chunk per step (memory bounded by one step)
def test_dvemb_equals_the_unrolled_effect_of_up_weighting(trained, monkeypatch, chunk_bytes):
    store = trained
    if chunk_bytes is not None:
        monkeypatch.setattr("gradstore.methods.dvemb.CHUNK_BYTES", chunk_bytes)
    truth, _ = true_effects()
    matrix = store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")
    np.testing.assert_allclose(columns(matrix), truth, rtol=2e-4, atol=1e-6)
    top = store.attribute(["qa"], run=RUN, method="dvemb", k=3, write=False)
    assert top.column("method").to_pylist() == ["dvemb"] * 3
    assert top.column("run_id").to_pylist() == [RUN] * 3
    expected = np.argsort(-truth[0], kind="stable")[:3]
    assert [int(e) for e in top.column("example_id").to_pylist()] == expected.tolist()
    np.testing.assert_allclose(top.column("score").to_numpy(), truth[0][expected], rtol=2e-4, atol=1e-6)


def test_tracin_steps_equals_the_per_step_sum(trained):
    store = trained
    _, reference = true_effects()
    matrix = store.score_matrix(["qa", "qb"], run=RUN, method="tracin-steps")
    np.testing.assert_allclose(columns(matrix), reference, rtol=2e-4, atol=1e-6)
    top = store.attribute(["qa", "qb"], run=RUN, method="tracin-steps", k=N, opponents=True, write=False)
    best = top.filter(top.column("rank").to_numpy() == 1)
    assert [int(e) for e in best.column("example_id").to_pylist()] == np.argmax(reference, 1).tolist()
    worst = top.filter(top.column("rank").to_numpy() == -1)
    assert [int(e) for e in worst.column("example_id").to_pylist()] == np.argmin(reference, 1).tolist()


def test_dvemb_is_incremental_and_survives_compaction(tmp_path):
    """Training that goes on extends the embeddings (new steps only) to what one build over every step gives;
    compaction keeps the derived run valid (no rebuild) and an index over it searches like attribute."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = model_at(INIT)
    train_captured(store, range(5), model)
    capture_queries(store, model, "mid", 5)
    store.core.record_checkpoint(RUN, "mid", step=5)
    first = store.score_matrix(["qa"], run=RUN, method="dvemb", query_checkpoint="mid")
    truth_mid, _ = true_effects(5)
    np.testing.assert_allclose(columns(first)[0], truth_mid[0], rtol=2e-4, atol=1e-6)
    state = dvemb._read_state(store.core, RUN)
    assert state.last_step == 4
    train_captured(store, range(5, T), model)
    capture_queries(store, model, "final", T)
    store.core.record_checkpoint(RUN, "final", step=T)
    calls = []
    recursion = dvemb.recursion
    dvemb.recursion = lambda *args: calls.append([s.step for s in args[3]]) or recursion(*args)
    try:
        extended = store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")
        assert calls == [[5, 6, 7, 8]]  # only the new steps were recursed
        store.compact()
        again = store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")
        assert len(calls) == 1  # compaction kept the derived run valid
    finally:
        dvemb.recursion = recursion
    truth, _ = true_effects()
    np.testing.assert_allclose(columns(extended), truth, rtol=5e-4, atol=1e-6)
    np.testing.assert_array_equal(columns(again), columns(extended))
    index = store.build_index(RUN, method="dvemb")
    queries = store.core.read_gradients(RUN, checkpoint="final", split="query", columns=("example_id",))
    scores, grad_ids = index.search(queries.vectors, 3)
    top = store.attribute(list(queries.metadata.column("example_id").to_pylist()), run=RUN, method="dvemb", k=3)
    np.testing.assert_allclose(np.sort(scores.ravel()), np.sort(top.column("score").to_numpy()), rtol=1e-5)
    assert dvemb.derived_run(RUN) in store.runs().column("run_id").to_pylist()


def source_reference(store: gradstore.GradStore, checkpoints: list[tuple[str, int, float]]) -> np.ndarray:
    """SOURCE from the stored rows with numpy: F_l from the checkpoint's true-Fisher rows, matrix functions by
    eigendecomposition, the product over later segments applied to the final queries."""
    core = store.core
    queries = core.read_gradients(RUN, checkpoint=checkpoints[-1][0], split="query").vectors.astype(np.float64)
    total, previous, carried = np.zeros((2, N)), 0, []
    segments = []
    for name, step, rate in checkpoints:
        segments.append((name, step - previous, rate))
        previous = step
    operator = np.eye(D + 1)
    for name, steps, rate in reversed(segments):
        fisher_rows = core.read_gradients(RUN, checkpoint=name, split=TRUE_FISHER_SPLIT).vectors.astype(np.float64)
        values, vectors = np.linalg.eigh(fisher_rows.T @ fisher_rows / len(fisher_rows))
        c = rate * steps
        term = np.where(values * c > 1e-12, -np.expm1(-c * values) / np.where(values > 0, values, 1), c)
        segment_term = (vectors * term) @ vectors.T
        block = core.read_gradients(RUN, checkpoint=name, split="train")
        rows = block.vectors.astype(np.float64)
        prepared = queries @ operator.T @ segment_term / len(rows)
        for column, example in enumerate(block.metadata.column("example_id").to_pylist()):
            total[:, int(example)] += prepared @ rows[column]
        operator = operator @ ((vectors * np.exp(-c * values)) @ vectors.T)
        carried.append(name)
    return total


def checkpoint_passes(store: gradstore.GradStore, rate: float, steps: int, every: int) -> list[tuple[str, int, float]]:
    """Full-batch gradient descent of ``steps`` steps at ``rate``; a checkpoint pass (training rows of every
    example, true-Fisher rows, the queries) every ``every`` steps."""
    x, y, qx, qy, _, _ = problem()
    model = model_at(INIT)
    optimizer = torch.optim.SGD(model.parameters(), lr=rate)
    ids = [str(i) for i in range(N)]
    plan = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        (0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()).backward()
        optimizer.step()
        if step % every == 0:
            name = f"c{step}"
            with store.capture(model, RUN, checkpoint=name, learning_rate=rate, projection=None) as cap:
                cap.set_step(step)
                cap.set_ids(ids)
                (0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()).backward()
                cap.set_split(TRUE_FISHER_SPLIT)
                cap.set_ids(ids)
                model(x).squeeze(-1).mean().backward()
                cap.set_split("query")
                cap.set_ids(["qa", "qb"])
                (0.5 * ((model(qx).squeeze(-1) - qy) ** 2).mean()).backward()
                model.zero_grad()
            plan.append((name, step, rate))
    return plan


def full_batch_truth(rate: float, steps: int) -> np.ndarray:
    x, y, qx, qy, _, _ = problem()
    weights = torch.ones(N, dtype=torch.float64, requires_grad=True)
    xt = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    qt = torch.cat([qx, torch.ones(2, 1, dtype=torch.float64)], 1)
    theta = INIT.clone().requires_grad_()
    for _ in range(steps):
        loss = (weights * 0.5 * (xt @ theta - y) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, theta, create_graph=True)
        theta = theta - rate * grad
    return np.stack(
        [
            -torch.autograd.grad(0.5 * (qt[q] @ theta - qy[q]) ** 2, weights, retain_graph=True)[0].numpy()
            for q in range(2)
        ]
    )


def test_source_equals_its_closed_form_and_the_unrolled_effect(tmp_path):
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    rate, steps = 0.02, 120
    plan = checkpoint_passes(store, rate, steps, every=20)
    matrix = store.score_matrix(["qa", "qb"], run=RUN, method="source")
    np.testing.assert_allclose(columns(matrix), source_reference(store, plan), rtol=1e-4, atol=1e-7)
    # gradient flow with segment-constant gradients: close to the true effect at a small learning rate
    truth = full_batch_truth(rate, steps)
    relative = np.abs(columns(matrix) - truth).max() / np.abs(truth).max()
    assert relative < 0.1, relative
    assert np.corrcoef(columns(matrix).ravel(), truth.ravel())[0, 1] > 0.99
    chosen = store.score_matrix(["qa", "qb"], run=RUN, method="source", checkpoints=[p[0] for p in plan[-2:]])
    np.testing.assert_allclose(columns(chosen), source_reference(store, plan[-2:]), rtol=1e-4, atol=1e-7)
    top = store.attribute(["qa", "qb"], run=RUN, method="source", k=2, write=False)
    assert set(top.column("checkpoint").to_pylist()) == {",".join(p[0] for p in plan)}


def test_true_fisher_rows_are_what_fisher_fits(tmp_path):
    """A checkpoint's true-Fisher rows replace its training rows in the fit (never scored as training rows)."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    plan = checkpoint_passes(store, 0.05, 20, every=20)
    name = plan[-1][0]
    core = store.core
    queries = core.read_gradients(RUN, checkpoint=name, split="query").vectors.astype(np.float64)
    fisher_rows = core.read_gradients(RUN, checkpoint=name, split=TRUE_FISHER_SPLIT).vectors.astype(np.float64)
    train = core.read_gradients(RUN, checkpoint=name, split="train")
    gram = fisher_rows.T @ fisher_rows / len(fisher_rows)
    damping = 0.1 * np.trace(gram) / len(gram)
    expected = queries @ np.linalg.inv(gram + damping * np.eye(len(gram))) @ train.vectors.astype(np.float64).T
    matrix = store.score_matrix(["qa", "qb"], run=RUN, method="fisher", checkpoint=name)
    assert len(matrix.example_ids) == N  # the true-Fisher rows are not scored
    np.testing.assert_allclose(matrix.scores, expected, rtol=1e-4, atol=1e-6)


def test_sample_labels_draws_from_the_model():
    logits = torch.tensor([[0.0, 50.0, 0.0], [50.0, 0.0, 0.0]]).repeat(3, 1)
    labels = gradstore.sample_labels(logits, generator=torch.Generator().manual_seed(0))
    assert labels.tolist() == [1, 0] * 3
    many = gradstore.sample_labels(torch.zeros(20000, 4), generator=torch.Generator().manual_seed(1))
    counts = np.bincount(many.numpy(), minlength=4) / 20000
    np.testing.assert_allclose(counts, 0.25, atol=0.02)


def test_trajectory_methods_say_what_they_need(tmp_path):
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    checkpoint_passes(store, 0.05, 20, every=10)
    for method in ("tracin-steps", "dvemb"):
        with pytest.raises(InvalidArgumentError, match="captured during training"):
            store.attribute(["qa"], run=RUN, method=method, write=False)
    with pytest.raises(InvalidArgumentError, match="does not use damping"):
        store.attribute(["qa"], run=RUN, method="source", damping=0.1, write=False)
    with pytest.raises(InvalidArgumentError, match="does not use kind"):
        store.attribute(["qa"], run=RUN, method="source", kind="HNSW32,Flat", write=False)
    with pytest.raises(InvalidArgumentError, match="no recorded step"):
        store.attribute(["qa"], run=RUN, method="source", checkpoints=["nope"], write=False)
    with pytest.raises(InvalidArgumentError, match="does not take"):
        store.token_scores(None, [], run=RUN, method="source")
    store_with_steps = gradstore.open(tmp_path / "steps", storage_dtype="float32")
    train_captured(store_with_steps, range(3), model_at(INIT))
    capture_queries(store_with_steps, model_at(INIT), "final", 3)
    store_with_steps.core.create_run(dvemb.derived_run(RUN), dim=D + 1)
    with pytest.raises(InvalidArgumentError, match="not derived from"):
        store_with_steps.attribute(["qa"], run=RUN, method="dvemb", write=False)
    in_loop_only = gradstore.open(tmp_path / "in-loop", storage_dtype="float32")
    train_captured(in_loop_only, range(3), model_at(INIT))
    with pytest.raises(InvalidArgumentError, match="final-model gradient"):
        in_loop_only.self_influence(run=RUN, method="tracin-steps", write=False)
    with pytest.raises(InvalidArgumentError, match="no checkpoint pass"):
        in_loop_only.attribute(np.ones((1, D + 1), np.float32), run=RUN, method="source", write=False)


def test_trajectory_methods_on_ray_equal_in_process(tmp_path, ray_engine):
    """tracin-steps, source and dvemb on a local Ray cluster (2 CPUs) give the in-process results."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = model_at(INIT)
    train_captured(store, range(T), model)
    for name, step in (("mid", 4), ("final", T)):
        with store.capture(model, RUN, checkpoint=name, learning_rate=0.1, projection=None) as cap:
            cap.set_step(step)
            cap.set_ids([str(i) for i in range(N)])
            x, y, qx, qy, _, _ = problem()
            (0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()).backward()
            cap.set_split("query")
            cap.set_ids(["qa", "qb"])
            (0.5 * ((model(qx).squeeze(-1) - qy) ** 2).mean()).backward()
            model.zero_grad()
    engine = ray_engine
    for method in ("tracin-steps", "source", "dvemb"):
        local = store.attribute(run=RUN, method=method, k=4, opponents=True, write=False)
        remote = store.attribute(run=RUN, method=method, k=4, opponents=True, write=False, engine=engine)
        assert remote.column("example_id").to_pylist() == local.column("example_id").to_pylist(), method
        np.testing.assert_allclose(remote.column("score").to_numpy(), local.column("score").to_numpy(), rtol=1e-6)


def test_trajectory_self_influence_and_selection_equal_their_score_matrices(tmp_path):
    """Self-influence scores each example's final-model gradient against its own history (the diagonal of the
    score matrix of those gradients); selection ranks examples by the max/mean of their scores over the target."""
    store = passes_store(tmp_path / "store")
    final = store.core.read_gradients(RUN, checkpoint="final", split="train")
    own = final.metadata.column("example_id").to_pylist()
    for method in ("tracin-steps", "source", "dvemb"):
        dense = store.score_matrix(final.vectors, run=RUN, method=method)
        column = {e: i for i, e in enumerate(dense.example_ids)}
        expected = {e: dense.scores[row, column[e]] if e in column else 0.0 for row, e in enumerate(own)}
        table = store.self_influence(run=RUN, method=method, write=False)
        got = dict(zip(table.column("example_id").to_pylist(), table.column("self_influence").to_pylist()))
        assert set(got) == set(own), method
        np.testing.assert_allclose([got[e] for e in own], [expected[e] for e in own], rtol=1e-4, atol=1e-7)
        targets = store.score_matrix(["qa", "qb"], run=RUN, method=method)
        for aggregate, reduce in (("max", np.max), ("mean", np.mean)):
            chosen = store.select(["qa", "qb"], run=RUN, preconditioner=method, budget=3, aggregate=aggregate)
            values = reduce(targets.scores, axis=0)
            order = sorted(range(len(values)), key=lambda i: (-values[i], targets.example_ids[i]))[:3]
            assert chosen.column("example_id").to_pylist() == [targets.example_ids[i] for i in order], method
            np.testing.assert_allclose(chosen.column("score").to_numpy(), values[order], rtol=1e-4, atol=1e-7)
    with pytest.raises(InvalidArgumentError, match="does not use checkpoints"):
        store.select(["qa"], run=RUN, preconditioner="dvemb", checkpoints=["final"])


def test_the_readme_flow_needs_no_recorded_steps_for_one_query_checkpoint(tmp_path):
    """Rows captured in the loop and queries at one checkpoint captured without a step (the README's flow):
    tracin-steps and dvemb score every step with those queries; self-influence reads the one training pass."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = model_at(INIT)
    train_captured(store, range(T), model)
    _, _, qx, qy, _, _ = problem()
    with store.capture(model, RUN, split="query", checkpoint="final", projection=None) as cap:
        cap.set_ids(["qa", "qb"])
        (0.5 * ((model(qx).squeeze(-1) - qy) ** 2).mean()).backward()
        model.zero_grad()
    _, reference = true_effects()
    np.testing.assert_allclose(
        columns(store.score_matrix(run=RUN, method="tracin-steps")), reference, rtol=2e-4, atol=1e-6
    )
    assert store.attribute(run=RUN, method="dvemb", k=2, write=False).num_rows == 4
    x, y, _, _, _, _ = problem()
    with store.capture(model, RUN, checkpoint="final", projection=None) as cap:
        cap.set_ids([str(i) for i in range(N)])
        (0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()).backward()
        model.zero_grad()
    assert store.self_influence(run=RUN, method="tracin-steps", write=False).num_rows == N


def test_source_ekfac_uses_each_checkpoints_ekfac(tmp_path):
    """source-ekfac equals SOURCE's closed form with F_l the dense matrix of each checkpoint's fitted EK-FAC
    (its Kronecker eigenbasis and refitted eigenvalues), functions taken by a dense eigendecomposition."""
    from gradstore.methods import METHODS
    from gradstore.preconditioning.fitting import Selection, fit_spec

    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    plan = checkpoint_passes(store, 0.05, 40, every=20)
    core = store.core
    queries = core.read_gradients(RUN, checkpoint=plan[-1][0], split="query").vectors.astype(np.float64)
    total, operator, previous, segments = np.zeros((2, N)), np.eye(D + 1), 0, []
    for name, step, rate in plan:
        segments.append((name, step - previous, rate))
        previous = step
    for name, steps, rate in reversed(segments):
        fitted = store.fits.get(fit_spec(core, Selection(RUN, name), METHODS["source-ekfac"]))
        (layer,) = fitted.layout
        q_a, q_s = (fitted.basis[layer[0]][i].numpy() for i in (0, 1))
        rotation = np.kron(q_s, q_a)
        dense = rotation @ np.diag(fitted.eigenvalues[layer[0]].numpy().ravel()) @ rotation.T
        values, vectors = np.linalg.eigh(dense)
        c = rate * steps
        term = np.where(values * c > 1e-12, -np.expm1(-c * values) / np.where(values > 0, values, 1), c)
        block = core.read_gradients(RUN, checkpoint=name, split="train")
        prepared = queries @ operator.T @ ((vectors * term) @ vectors.T) / len(block.vectors)
        for column, example in enumerate(block.metadata.column("example_id").to_pylist()):
            total[:, int(example)] += prepared @ block.vectors[column].astype(np.float64)
        operator = operator @ ((vectors * np.exp(-c * values)) @ vectors.T)
    matrix = store.score_matrix(["qa", "qb"], run=RUN, method="source-ekfac")
    np.testing.assert_allclose(columns(matrix), total, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("rows, size", [(5, 12), (20, 8)])
@pytest.mark.parametrize("span", [1, 2, 7])
def test_dvemb_carries_a_recorded_step_for_its_span(rows, size, span):
    """``P (I - rate C^T C)^span`` (a recorded step standing for ``span`` steps), through the smaller Gram
    matrix's eigendecomposition, equals repeated multiplication."""
    generator = torch.Generator().manual_seed(rows * span)
    products = torch.randn(3, size, size, generator=generator, dtype=torch.float64)
    curvature = 0.3 * torch.randn(3, rows, size, generator=generator, dtype=torch.float64)
    factor = torch.eye(size, dtype=torch.float64) - 0.05 * curvature.transpose(1, 2) @ curvature
    expected = products @ torch.linalg.matrix_power(factor, span)
    torch.testing.assert_close(dvemb._carried(products, curvature, 0.05, span), expected, rtol=1e-12, atol=1e-12)


def test_trajectory_methods_refuse_a_query_checkpoint_without_query_rows(tmp_path):
    """``query_checkpoint=`` naming a checkpoint without query rows is refused as ``fisher`` refuses it, naming the
    checkpoints that hold query rows, whether the run holds them at one checkpoint or several; with query vectors
    it is refused too (they are not stored rows)."""
    store = passes_store(tmp_path / "store", passes=(("final", T),))
    model = model_at(INIT)
    methods = ("fisher", "tracin-steps", "source", "dvemb")
    for method in methods:
        with pytest.raises(MissingIdsError, match=r"at checkpoint 'nope': .*query rows at \['final'\]"):
            store.attribute(["qa"], run=RUN, method=method, query_checkpoint="nope", write=False)
        with pytest.raises(InvalidArgumentError, match=r"query rows exist at checkpoints \['final'\]"):
            store.score_matrix(run=RUN, method=method, query_checkpoint="nope")
        with pytest.raises(InvalidArgumentError, match="vectors or a QueryBatch have none"):
            store.score_matrix(np.ones((1, D + 1), np.float32), run=RUN, method=method, query_checkpoint="final")
    capture_queries(store, model, "other", T)
    for method in methods[1:]:
        with pytest.raises(MissingIdsError, match=r"query rows at \['final', 'other'\]") as raised:
            store.attribute(["qa"], run=RUN, method=method, query_checkpoint="nope", write=False)
        assert "training rows' checkpoint" not in str(raised.value)


def test_query_checkpoints_take_their_step_from_their_rows(tmp_path):
    """Queries captured at checkpoints of their own with ``cap.set_step(step)`` (capture records no checkpoint for
    query rows): the trajectory methods take each one's step from its rows, as if recorded; a checkpoint whose
    rows carry several steps is refused with the call that records one."""

    def build(path, record: bool) -> gradstore.GradStore:
        store = gradstore.open(path, storage_dtype="float32")
        model = model_at(INIT)
        train_captured(store, range(5), model)
        capture_queries(store, model, "mid", 5)
        train_captured(store, range(5, T), model)
        capture_queries(store, model, "final", T)
        if record:
            store.core.record_checkpoint(RUN, "mid", step=5)
            store.core.record_checkpoint(RUN, "final", step=T)
        return store

    recorded, from_rows = build(tmp_path / "recorded", True), build(tmp_path / "rows", False)
    assert not {"mid", "final"} & set(from_rows.core.checkpoints(RUN).column("checkpoint").to_pylist())
    for method in ("tracin-steps", "dvemb"):  # tracin-steps: each step's queries; dvemb: the final ones
        expected = recorded.score_matrix(["qa", "qb"], run=RUN, method=method)
        np.testing.assert_array_equal(
            columns(from_rows.score_matrix(["qa", "qb"], run=RUN, method=method)), columns(expected)
        )
    truth, _ = true_effects()
    np.testing.assert_allclose(columns(from_rows.score_matrix(run=RUN, method="dvemb")), truth, rtol=5e-4, atol=1e-6)
    capture_queries(from_rows, model_at(INIT), "mid", 6)  # "mid" now holds query rows of steps 5 and 6
    for method in ("tracin-steps", "dvemb"):
        with pytest.raises(InvalidArgumentError, match=r"\['mid'\] with no step.*store.record_checkpoint\('quad'"):
            from_rows.score_matrix(run=RUN, method=method)
    from_rows.core.record_checkpoint(RUN, "mid", step=5)  # the call the error names
    from_rows.score_matrix(run=RUN, method="tracin-steps")
