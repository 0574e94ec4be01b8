"""Exact replay (``store.replay``, ``method="replay"``) against autograd through the full unrolled run.

A 2-layer tanh MLP on 16 examples, batches of 4, 12 steps, float64, trained under capture (projection off) with
torch.optim's SGD, SGD with momentum (and weight decay, Nesterov), Adam and AdamW. The reference differentiates the
final query losses with respect to a vector of all examples' loss weights through the whole unrolled run (no
checkpointing, the optimizers' update formulas written out here once more); the replay, checkpointed in segments,
must equal it to float64 rounding.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

import gradstore
from gradstore.answers.replay import Optimizer
from gradstore.capture.online import RandomSelection, select_online
from gradstore.errors import GradstoreError, InvalidArgumentError, MissingIdsError, MissingReplayError

N, D, H, B, T = 16, 3, 4, 4, 12
RUN = "mlp"
QUERIES = ["q0", "q1", "q2"]

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.3}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.8, "nesterov": True}),
    "sgd-dampening": (torch.optim.SGD, {"lr": 0.2, "momentum": 0.5, "dampening": 0.3}),
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1, "betas": (0.8, 0.99)}),
}


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N + len(QUERIES), D, generator=generator, dtype=torch.float64)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(N + len(QUERIES), generator=generator, dtype=torch.float64)
    batches = [torch.randperm(N, generator=generator)[:B].tolist() for _ in range(T)]
    rates = [1.0 - 0.04 * t for t in range(T)]  # a schedule: multiplies the optimizer's lr
    ids = [str(i) for i in range(N)] + QUERIES
    return x, y, batches, rates, {name: i for i, name in enumerate(ids)}


def model_fn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, 1)).double()


def batch_fn(ids):
    x, y, _, _, index = data()
    rows = [index[i] for i in ids]  # KeyError for an id it does not know
    return x[rows], y[rows]


def loss_fn(model, batch):
    x, y = batch
    return 0.5 * (model(x).squeeze(-1) - y) ** 2


def train(store: gradstore.GradStore, name: str, steps: int = T, *, record_losses: bool = False) -> nn.Module:
    """Train under capture with the torch.optim optimizer ``name``; every step's rows recorded (with
    ``record_losses``, their per-example losses too: capture's ``per_example_loss``)."""
    x, y, batches, rates, _ = data()
    model = model_fn()
    kind, hyper = OPTIMIZERS[name]
    optimizer = kind(model.parameters(), **hyper)
    targets = {}

    def per_example_loss(outputs, args, kwargs):
        return 0.5 * (outputs.squeeze(-1) - targets["y"]) ** 2

    options = {"per_example_loss": per_example_loss} if record_losses else {}
    with store.capture(model, RUN, optimizer=optimizer, projection=None, **options) as cap:
        cap.set_step(0)
        for t in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = hyper["lr"] * rates[t % T]
            batch = batches[t % T]
            targets["y"] = y[batch]
            cap.set_ids([str(i) for i in batch])
            loss_fn(model, (x[batch], y[batch])).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def unrolled(
    name: str,
    steps: int = T,
    weight: float = 1.0,
    *,
    schedule: bool = True,
    reduction: str = "mean",
    lr: float | None = None,
    groups=None,
) -> np.ndarray:
    """``-d L_q(theta_T) / d eps`` for every example through the whole unrolled run (autograd, create_graph), taken
    where every ``eps = weight`` (``schedule``: the learning rates of :func:`train`, else the optimizer's
    throughout; ``reduction``: of each batch's losses; ``lr``: instead of the optimizer's; ``groups(i, t)``: the
    hyper-parameters, ``lr`` included, of parameter ``i`` (in the model's order) at step ``t`` instead of the
    optimizer's, ``None`` for a parameter the run does not update)."""
    x, y, batches, rates, _ = data()
    kind, base = OPTIMIZERS[name]
    base = {**base, "lr": base["lr"] if lr is None else lr}
    model = model_fn()
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    weights = torch.full((N,), weight, dtype=torch.float64, requires_grad=True)
    first = [torch.zeros_like(p) for p in params]
    second = [torch.zeros_like(p) for p in params]
    for t in range(steps):
        batch = batches[t % T]
        out = torch.func.functional_call(model, dict(zip(names, params)), (x[batch],)).squeeze(-1)
        weighted = weights[batch] * 0.5 * (out - y[batch]) ** 2
        loss = weighted.mean() if reduction == "mean" else weighted.sum()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        updated = []
        for i, (p, g) in enumerate(zip(params, grads)):
            hyper = {**base, "lr": base["lr"] * (rates[t % T] if schedule else 1.0)}
            hyper = groups(i, t) if groups else hyper
            if hyper is None:
                updated.append(p)
                continue
            lr, momentum = hyper["lr"], hyper.get("momentum", 0.0)
            decay = hyper.get("weight_decay", 1e-2 if kind is torch.optim.AdamW else 0)
            beta1, beta2 = hyper.get("betas", (0.9, 0.999))
            if kind is torch.optim.SGD:
                g = g + decay * p
                if momentum:
                    first[i] = g if t == 0 else momentum * first[i] + (1 - hyper.get("dampening", 0.0)) * g
                    g = g + momentum * first[i] if hyper.get("nesterov") else first[i]
                updated.append(p - lr * g)
                continue
            if kind is torch.optim.AdamW:
                p = p * (1 - lr * decay)
            first[i] = beta1 * first[i] + (1 - beta1) * g
            second[i] = beta2 * second[i] + (1 - beta2) * g * g
            hat_m = first[i] / (1 - beta1 ** (t + 1))
            hat_v = second[i] / (1 - beta2 ** (t + 1))
            updated.append(p - lr * hat_m / (hat_v.sqrt() + hyper.get("eps", 1e-8)))
        params = updated
    qx, qy = batch_fn(QUERIES)
    out = torch.func.functional_call(model, dict(zip(names, params)), (qx,)).squeeze(-1)
    losses = 0.5 * (out - qy) ** 2
    return np.stack(
        [-torch.autograd.grad(losses[q], weights, retain_graph=True)[0].numpy() for q in range(len(QUERIES))]
    )


def by_example(replayed) -> np.ndarray:
    out = np.zeros((len(replayed.query_ids), N))
    for column, example in enumerate(replayed.example_ids):
        out[:, int(example)] = replayed.scores[:, column]
    return out


@pytest.fixture
def store(tmp_path):
    return gradstore.open(tmp_path / "store", storage_dtype="float32", row_files=False)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_replay_equals_autograd_through_the_unrolled_run(store, name):
    trained = train(store, name)
    kind, hyper = OPTIMIZERS[name]
    replayed = store.replay(
        QUERIES,
        run=RUN,
        model_fn=model_fn,
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        optimizer=Optimizer.of(kind, **hyper),
    )
    truth = unrolled(name)
    assert np.abs(truth).max() > 1e-3  # the effects are not trivially zero
    np.testing.assert_allclose(by_example(replayed), truth, rtol=0, atol=1e-10 * np.abs(truth).max())
    for n, p in trained.named_parameters():  # the replay retraced the recorded run
        torch.testing.assert_close(replayed.final[n], p.detach(), rtol=0, atol=1e-12)
    assert replayed.segments == math.ceil(T / math.ceil(T / math.ceil(math.sqrt(T))))


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw"])
def test_replay_at_another_weight_equals_autograd_there(store, name):
    """``weight=0.5``: the derivative where every example's loss carries half its weight (the middle of random
    halves), equal to autograd through the run unrolled at those weights; it differs from the derivative at 1."""
    train(store, name)
    kind, hyper = OPTIMIZERS[name]
    common = {"run": RUN, "model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn}
    replayed = store.replay(QUERIES, optimizer=Optimizer.of(kind, **hyper), weight=0.5, **common)
    truth = unrolled(name, weight=0.5)
    np.testing.assert_allclose(by_example(replayed), truth, rtol=0, atol=1e-10 * np.abs(truth).max())
    assert replayed.weight == 0.5
    assert np.abs(truth - unrolled(name)).max() > 1e-3 * np.abs(truth).max()
    matrix = store.score_matrix(None, run=RUN, method="replay")
    np.testing.assert_allclose(matrix.scores, replayed.scores, rtol=1e-6)
    # a replay at another weight replaces the stored one: no matrix mixes two points of expansion
    store.replay(QUERIES[:1], optimizer=Optimizer.of(kind, **hyper), **common)
    assert store.score_matrix(None, run=RUN, method="replay").query_ids == QUERIES[:1]
    with pytest.raises(MissingReplayError, match="were not replayed"):
        store.attribute(["q1"], run=RUN, method="replay")


def test_a_batch_fn_in_another_order_is_refused_from_the_recorded_losses(store):
    """Where capture recorded per-example losses, the replay compares its first step's with them: the same
    batch_fn and loss_fn replay silently (and exactly); a batch_fn that returns the examples in another order
    than the ids is refused (every example's metagradient would be another's); a loss_fn other than the
    training's is warned about."""
    train(store, "sgd-momentum", record_losses=True)
    kind, hyper = OPTIMIZERS["sgd-momentum"]
    common = {"run": RUN, "model_fn": model_fn, "loss_fn": loss_fn, "optimizer": Optimizer.of(kind, **hyper)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replayed = store.replay(QUERIES, batch_fn=batch_fn, write=False, **common)
    truth = unrolled("sgd-momentum")
    np.testing.assert_allclose(by_example(replayed), truth, rtol=0, atol=1e-10 * np.abs(truth).max())

    def sorted_batches(ids):
        return batch_fn(sorted(ids, key=int))  # the examples of the ids, in another order

    with pytest.raises(InvalidArgumentError, match="another order"):
        store.replay(QUERIES, batch_fn=sorted_batches, write=False, **common)
    with pytest.warns(gradstore.ReplayMismatchWarning, match="differ from those capture recorded"):
        store.replay(QUERIES, batch_fn=batch_fn, write=False, **{**common, "loss_fn": lambda m, b: 2 * loss_fn(m, b)})


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_one_query_at_a_time_equals_the_vectorised_pass(store, monkeypatch, name):
    """Where an operation has no batching rule the adjoints go back one query at a time: the same scores."""
    train(store, name)
    common = {"run": RUN, "model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "write": False}
    optimizer = Optimizer.of(*OPTIMIZERS[name][:1], **OPTIMIZERS[name][1])
    vectorised = store.replay(QUERIES, optimizer=optimizer, **common)
    monkeypatch.setattr("gradstore.answers.replay._Adjoint.vectorised", False)
    looped = store.replay(QUERIES, optimizer=optimizer, **common)
    np.testing.assert_allclose(looped.scores, vectorised.scores, rtol=0, atol=1e-13)


def test_the_optimizer_instance_of_the_run_and_names_give_the_same_replay(store):
    train(store, "sgd-momentum")
    kind, hyper = OPTIMIZERS["sgd-momentum"]
    common = {"run": RUN, "model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "write": False}
    instance = store.replay(QUERIES, optimizer=kind(model_fn().parameters(), **hyper), **common)
    named = store.replay(QUERIES, optimizer=Optimizer("sgd", momentum=0.9, weight_decay=1e-2), **common)
    np.testing.assert_array_equal(instance.scores, named.scores)


@pytest.mark.parametrize("name", ["sgd-momentum", "sgd-nesterov", "sgd-dampening", "adam", "adamw"])
def test_the_functional_step_equals_torch_optim(name):
    """Same gradients, several steps: the functional update equals torch.optim's step to rounding."""
    kind, hyper = OPTIMIZERS[name]
    generator = torch.Generator().manual_seed(3)
    params = [
        torch.randn(3, 2, generator=generator, dtype=torch.float64),
        torch.randn(2, generator=generator, dtype=torch.float64),
    ]
    params[1][0] = 0.0
    torch_params = [nn.Parameter(p.clone()) for p in params]
    optimizer = kind(torch_params, **hyper)
    spec = Optimizer.of(optimizer)
    mine, state = tuple(p.clone() for p in params), spec.init(tuple(params))
    for t in range(5):
        grads = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params]
        grads[1][0] = 0.0  # a coordinate without gradient (Adam: v = 0)
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        optimizer.step()
        mine, state = spec.step(mine, state, tuple(grads), hyper["lr"], t)
        for a, b in zip(mine, torch_params):
            torch.testing.assert_close(a, b.detach(), rtol=1e-14, atol=1e-15)


def test_checkpointed_replay_holds_about_two_sqrt_steps_states(store):
    steps = 64
    train(store, "adam", steps=steps)
    kind, hyper = OPTIMIZERS["adam"]
    common = {"run": RUN, "model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "write": False}
    optimizer = Optimizer.of(kind, **hyper)
    default = store.replay(QUERIES[:1], optimizer=optimizer, **common)
    assert default.segments == 8 and default.peak_states <= 2 * 8 + 1, default.peak_states
    unchecked = store.replay(QUERIES[:1], optimizer=optimizer, segments=1, **common)
    assert unchecked.peak_states == steps  # one segment: every state of the run at once
    np.testing.assert_allclose(default.scores, unchecked.scores, rtol=0, atol=1e-12)
    np.testing.assert_allclose(by_example(default), unrolled("adam", steps)[:1], rtol=0, atol=1e-9)
    for segments in (3, 20):
        other = store.replay(QUERIES[:1], optimizer=optimizer, segments=segments, **common)
        assert other.peak_states <= segments + math.ceil(steps / segments)
        np.testing.assert_allclose(other.scores, default.scores, rtol=0, atol=1e-12)


def test_attribute_ranks_the_replayed_metagradients(store):
    train(store, "sgd")
    with pytest.raises(MissingReplayError, match="store.replay"):
        store.attribute(["q0"], run=RUN, method="replay", write=False)
    replayed = store.replay(
        QUERIES[:2], run=RUN, model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer="sgd"
    )
    store.replay(QUERIES[2:], run=RUN, model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer="sgd")
    top = store.attribute(["q2", "q0"], run=RUN, method="replay", k=3, opponents=True)
    truth = unrolled("sgd")
    for q, query in ((2, "q2"), (0, "q0")):
        rows = [r for r in top.to_pylist() if r["query_id"] == query]
        best = [r["example_id"] for r in sorted(rows, key=lambda r: r["rank"]) if r["rank"] > 0]
        worst = [r["example_id"] for r in sorted(rows, key=lambda r: -r["rank"]) if r["rank"] < 0]
        assert best == [str(i) for i in np.argsort(-truth[q], kind="stable")[:3]]
        assert worst == [str(i) for i in np.argsort(truth[q], kind="stable")[:3]]
        np.testing.assert_allclose([r["score"] for r in rows if r["rank"] > 0], np.sort(truth[q])[::-1][:3], rtol=1e-9)
    assert set(top.column("method").to_pylist()) == {"replay"}
    assert store.sql("SELECT count(*) FROM scores WHERE method = 'replay'").fetchall() == [(12,)]
    matrix = store.score_matrix(None, run=RUN, method="replay")
    assert matrix.query_ids == QUERIES and matrix.example_ids == replayed.example_ids
    np.testing.assert_allclose(matrix.scores[:2], replayed.scores, rtol=1e-6)
    with pytest.raises(MissingReplayError, match="were not replayed"):
        store.attribute(["q9"], run=RUN, method="replay")
    with pytest.raises(InvalidArgumentError, match="list of query ids"):
        store.attribute(np.zeros((1, 3)), run=RUN, method="replay")
    with pytest.raises(InvalidArgumentError, match="does not use damping"):
        store.attribute(["q0"], run=RUN, method="replay", damping=0.1)
    with pytest.raises(InvalidArgumentError, match="engine"):
        store.attribute(["q0"], run=RUN, method="replay", engine="ray")
    train_more = model_fn()  # the run goes on: the replay is stale
    with store.capture(train_more, RUN, optimizer=torch.optim.SGD(train_more.parameters(), lr=0.1),
                       projection=None) as cap:  # fmt: skip
        cap.set_step(T)
        cap.set_ids(["0", "1"])
        loss_fn(train_more, batch_fn(["0", "1"])).mean().backward()
    with pytest.raises(MissingReplayError, match="again"):
        store.attribute(["q0"], run=RUN, method="replay")


def test_misuse_is_a_gradstore_error(store):
    train(store, "sgd")
    common = {"run": RUN, "model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "optimizer": "sgd"}

    def other_model():
        return nn.Sequential(nn.Linear(D, H + 1), nn.Tanh(), nn.Linear(H + 1, 1)).double()

    def partial_batches(ids):
        if "7" in ids:
            raise KeyError("7")
        return batch_fn(ids)

    cases = [
        (MissingIdsError, "batch_fn could not build", {"batch_fn": partial_batches}),
        (MissingIdsError, "the queries", {"queries": ["nope"]}),
        (InvalidArgumentError, "another architecture", {"model_fn": other_model}),
        (InvalidArgumentError, "per-example losses", {"loss_fn": lambda m, b: loss_fn(m, b).mean()}),
        (InvalidArgumentError, "replay optimizers", {"optimizer": "rmsprop"}),
        (InvalidArgumentError, "amsgrad", {"optimizer": torch.optim.Adam(model_fn().parameters(), amsgrad=True)}),
        (InvalidArgumentError, "segments", {"segments": 0}),
        (InvalidArgumentError, "non-empty list", {"queries": "q0"}),
        *[(InvalidArgumentError, "positive finite", {"weight": w}) for w in (0, -0.5, math.nan, math.inf, True, "1")],
        (InvalidArgumentError, "model_fn\\(\\) failed", {"model_fn": nn.Linear}),
        (InvalidArgumentError, "trained with sgd", {"optimizer": "adam"}),
        (InvalidArgumentError, "recorded as sgd\\(momentum=0.0", {"optimizer": Optimizer("sgd", momentum=0.9)}),
        (InvalidArgumentError, "recorded as sgd", {"optimizer": Optimizer("sgd", nesterov=True, momentum=0.5)}),
    ]
    for error, message, change in cases:
        arguments = {**common, **change}
        queries = arguments.pop("queries", QUERIES)
        with pytest.raises(error, match=message) as raised:
            store.replay(queries, write=False, **arguments)
        assert isinstance(raised.value, GradstoreError)


def test_an_optimizer_contradicting_the_recorded_one_is_refused(store):
    """Capture recorded the run's optimizer (SGD, momentum 0.9, weight decay 1e-2): a replay with other
    hyper-parameters would differentiate another training, so it is refused; an L2 weight decay where none was
    recorded stands for an objective's penalty (the same gradient) and is taken."""
    train(store, "sgd-momentum")
    common = {"run": RUN, "model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "write": False}
    for wrong in ("sgd", Optimizer("sgd", momentum=0.9), Optimizer("sgd", momentum=0.9, weight_decay=0.1), "adamw"):
        with pytest.raises(InvalidArgumentError, match="pass the run's optimizer"):
            store.replay(QUERIES, optimizer=wrong, **common)
    other = gradstore.open(store.uri.rstrip("/") + "-plain", storage_dtype="float32", row_files=False)
    train(other, "sgd")
    replayed = other.replay(QUERIES, optimizer=Optimizer("sgd", weight_decay=0.1), **common)
    assert np.isfinite(replayed.scores).all()


def train_loop(store, run, make_optimizer, *, step=None, backward=None, reduction="mean", **capture):
    """Train under capture (every step's rows recorded) with ``make_optimizer(model)``, no schedule;
    ``backward(loss)`` replaces ``loss.backward()``, ``step(model, optimizer)`` the ``optimizer.step()``."""
    x, y, batches, _, _ = data()
    model = model_fn()
    optimizer = make_optimizer(model)
    with store.capture(model, run, optimizer=optimizer, projection=None, **capture) as cap:
        for t in range(T):
            batch = batches[t]
            cap.set_ids([str(i) for i in batch])
            losses = loss_fn(model, (x[batch], y[batch]))
            loss = losses.mean() if reduction == "mean" else losses.sum()
            (backward or torch.Tensor.backward)(loss)
            (step or (lambda _, optimizer: optimizer.step()))(model, optimizer)
            optimizer.zero_grad()
    return model, optimizer


def recorded_gradients(store, run):
    query = f"select gradients from optimizer_steps where run_id = '{run}' order by step"
    return [row[0] for row in store.sql(query).fetchall()]


#: Parameters of the MLP in the model's order: 0.weight, 0.bias, 2.weight, 2.bias.
WEIGHTS, BIASES = (0, 2), (1, 3)


def body_and_head(m, body: dict, head: dict) -> list[dict]:
    """Two parameter groups: the first layer (``body``'s hyper-parameters) and the last (``head``'s)."""
    return [{"params": m[0].parameters(), **body}, {"params": m[2].parameters(), **head}]


def decay_and_no_decay(m, decay: float) -> list[dict]:
    """The HF Trainer's groups: weights with weight decay, biases without."""
    return [
        {"params": [m[0].weight, m[2].weight], "weight_decay": decay},
        {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0},
    ]


def test_parameter_groups_that_differ_replay_exactly(store):
    """SGD with momentum, the body at another learning rate and weight decay than the head; AdamW with the biases
    in a group without weight decay: each parameter gets its group's hyper-parameters, equal to autograd through
    the unrolled run, given the run's torch.optim instance or only the first captured layer's group's settings."""
    common = {"model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "write": False}
    body, head = {"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.3, "weight_decay": 0.0}

    def sgd(m):
        return torch.optim.SGD(body_and_head(m, body, head), lr=0.1, momentum=0.9)

    trained, optimizer = train_loop(store, "sgd-groups", sgd)
    recorded = store.sql("select distinct group_differences from optimizer_steps where run_id = 'sgd-groups'")
    assert recorded.fetchall() == [("lr, weight_decay",)]
    truth = unrolled("sgd-momentum", groups=lambda i, t: {**(body if i < 2 else head), "momentum": 0.9})
    assert np.abs(truth - unrolled("sgd-momentum", schedule=False)).max() > 1e-2 * np.abs(truth).max()
    for given in (optimizer, sgd(model_fn()), Optimizer("sgd", momentum=0.9, weight_decay=0.1)):
        replayed = store.replay(QUERIES, run="sgd-groups", optimizer=given, **common)
        np.testing.assert_allclose(by_example(replayed), truth, rtol=0, atol=1e-10 * np.abs(truth).max())
    for n, p in trained.named_parameters():
        torch.testing.assert_close(replayed.final[n], p.detach(), rtol=0, atol=1e-12)
    assert len(replayed.optimizer.groups) == 2 and replayed.group_learning_rates == [[0.05, 0.3]] * T

    def adamw(m):
        return torch.optim.AdamW(decay_and_no_decay(m, 0.5), lr=0.05, betas=(0.8, 0.99))

    trained, optimizer = train_loop(store, "adamw-groups", adamw)
    hyper = {"lr": 0.05, "betas": (0.8, 0.99)}
    truth = unrolled("adamw", groups=lambda i, t: {**hyper, "weight_decay": 0.5 if i in WEIGHTS else 0.0})
    for given in (optimizer, Optimizer("adamw", betas=(0.8, 0.99), weight_decay=0.5)):
        replayed = store.replay(QUERIES, run="adamw-groups", optimizer=given, **common)
        np.testing.assert_allclose(by_example(replayed), truth, rtol=0, atol=1e-10 * np.abs(truth).max())
    for n, p in trained.named_parameters():
        torch.testing.assert_close(replayed.final[n], p.detach(), rtol=0, atol=1e-12)


def test_a_scheduler_changing_each_groups_learning_rate_is_replayed(store):
    """A LambdaLR with one schedule per group: each step's learning rate of each group, as recorded."""
    schedules = [lambda t: 1.0 - 0.05 * t, lambda t: 0.5 + 0.1 * (t % 3)]
    x, y, batches, _, _ = data()
    model = model_fn()
    optimizer = torch.optim.SGD(body_and_head(model, {"lr": 0.2}, {"lr": 0.1}), lr=0.1, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    with store.capture(model, RUN, optimizer=optimizer, projection=None) as cap:
        for t in range(T):
            cap.set_ids([str(i) for i in batches[t]])
            loss_fn(model, (x[batches[t]], y[batches[t]])).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    rates = [[0.2 * schedules[0](t), 0.1 * schedules[1](t)] for t in range(T)]
    replayed = store.replay(
        QUERIES, run=RUN, model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer=optimizer, write=False
    )
    np.testing.assert_allclose(replayed.group_learning_rates, rates, rtol=1e-15)
    truth = unrolled("sgd-momentum", groups=lambda i, t: {"lr": rates[t][i // 2], "momentum": 0.5})
    np.testing.assert_allclose(by_example(replayed), truth, rtol=0, atol=1e-10 * np.abs(truth).max())
    for n, p in model.named_parameters():
        torch.testing.assert_close(replayed.final[n], p.detach(), rtol=0, atol=1e-12)


def test_parameters_in_no_group_are_not_updated(store):
    """A trainable parameter the optimizer does not hold stays as it is in the run, and in the replay."""
    trained, _ = train_loop(store, "head-only", lambda m: torch.optim.SGD(m[2].parameters(), lr=0.3))
    replayed = store.replay(QUERIES, run="head-only", model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn,
                            optimizer="sgd", write=False)  # fmt: skip
    truth = unrolled("sgd", schedule=False, groups=lambda i, t: {"lr": 0.3} if i >= 2 else None)
    np.testing.assert_allclose(by_example(replayed), truth, rtol=0, atol=1e-10 * np.abs(truth).max())
    assert sorted(replayed.final) == ["2.bias", "2.weight"]
    torch.testing.assert_close(trained[0].weight.detach(), model_fn()[0].weight.detach(), rtol=0, atol=0)


def test_what_the_groups_cannot_replay_is_refused(store, monkeypatch):
    """A model whose parameter names are not the run's, a replay optimizer with other groups than the run's, a
    group with a setting the functional step does not implement, and (a capture of an earlier version, which
    recorded no groups) groups that differ: each refused saying what to do."""
    common = {"batch_fn": batch_fn, "loss_fn": loss_fn, "write": False}
    body, head = {"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.3}
    _, optimizer = train_loop(store, "groups", lambda m: torch.optim.SGD(body_and_head(m, body, head), lr=0.1))

    def renamed():
        torch.manual_seed(1)
        layers = [("hidden", nn.Linear(D, H)), ("act", nn.Tanh()), ("out", nn.Linear(H, 1))]
        return nn.Sequential(OrderedDict(layers)).double()

    with pytest.raises(InvalidArgumentError, match=r"no parameters named \['0.weight'.*by name.*named_parameters"):
        store.replay(QUERIES, run="groups", model_fn=renamed, optimizer=optimizer, **common)
    other = torch.optim.SGD(body_and_head(model_fn(), {**body, "weight_decay": 0.2}, head), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="group 0 was recorded as sgd.*weight_decay=0.1.*weight_decay=0.2"):
        store.replay(QUERIES, run="groups", model_fn=model_fn, optimizer=other, **common)
    three = torch.optim.SGD([{"params": [p], "lr": 0.1 * (i + 1)} for i, p in enumerate(model_fn().parameters())])
    with pytest.raises(InvalidArgumentError, match="had 2 parameter groups but.*4"):
        store.replay(QUERIES, run="groups", model_fn=model_fn, optimizer=three, **common)

    def amsgrad(m):
        return torch.optim.Adam([{"params": m[0].parameters()}, {"params": m[2].parameters(), "amsgrad": True}])

    train_loop(store, "amsgrad", amsgrad)
    with pytest.raises(InvalidArgumentError, match="group 1 cannot be replayed.*amsgrad=True"):
        store.replay(QUERIES, run="amsgrad", model_fn=model_fn, optimizer="adam", **common)

    def unrecorded(self, row, optimizer):  # a capture of an earlier version: no groups recorded
        row["group_parameters"] = row["group_hyperparameters"] = None

    monkeypatch.setattr("gradstore.capture.optimizer_state.ParameterGroups.mark", unrecorded)
    _, optimizer = train_loop(store, "earlier", lambda m: torch.optim.SGD(body_and_head(m, body, head), lr=0.1))
    for given in (optimizer, Optimizer("sgd", weight_decay=0.1)):
        with pytest.raises(InvalidArgumentError, match="differ in lr, weight_decay.*capture the run again"):
            store.replay(QUERIES, run="earlier", model_fn=model_fn, optimizer=given, **common)
    _, optimizer = train_loop(
        store,
        "groups-same",
        lambda m: torch.optim.SGD([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.3),
    )
    replayed = store.replay(QUERIES, run="groups-same", model_fn=model_fn, optimizer=optimizer, **common)
    np.testing.assert_allclose(by_example(replayed), unrolled("sgd", schedule=False), rtol=1e-9, atol=1e-12)


def test_a_model_fn_at_other_weights_than_the_run_started_from_is_refused(store, monkeypatch):
    """Capture fingerprints the weights before its first step: a model_fn() returning the trained model (or
    another initialisation) is refused; the run's initial weights replay; a capture that began later in the run
    (resumed) is not compared."""
    trained = train(store, "sgd")
    common = {"run": RUN, "batch_fn": batch_fn, "loss_fn": loss_fn, "optimizer": "sgd", "write": False}
    for wrong in (lambda: trained, lambda: nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, 1)).double()):
        with pytest.raises(InvalidArgumentError, match="other weights than run 'mlp' started from.*step 0"):
            store.replay(QUERIES, model_fn=wrong, **common)
    nudged = model_fn()
    with torch.no_grad():
        nudged[2].bias.add_(1e-5)
    with pytest.raises(InvalidArgumentError, match="parameter '2.bias'"):
        store.replay(QUERIES, model_fn=lambda: nudged, **common)
    store.replay(QUERIES, model_fn=model_fn, **common)
    fingerprints = store.sql("select step from optimizer_steps where initial_weights is not null").fetchall()
    assert fingerprints == [(0,)]
    resumed = gradstore.open(store.uri.rstrip("/") + "-resumed", storage_dtype="float32", row_files=False)
    monkeypatch.setattr("gradstore.capture.session.weights_fingerprint", lambda model: None)  # as earlier versions
    train(resumed, "sgd", steps=T // 2)
    monkeypatch.undo()
    x, y, batches, _, _ = data()
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    with resumed.capture(model, RUN, optimizer=optimizer, projection=None) as cap:  # goes on at step T / 2
        cap.set_step(T // 2)
        cap.set_ids([str(i) for i in batches[0]])
        loss_fn(model, (x[batches[0]], y[batches[0]])).mean().backward()
        optimizer.step()
    assert resumed.sql("select step from optimizer_steps where initial_weights is not null").fetchall() == [(T // 2,)]
    resumed.replay(QUERIES, model_fn=model_fn, **common)  # its fingerprint is of step T / 2, not the replay's first


def test_steps_on_other_gradients_than_the_backwards_are_refused(store):
    """Capture records whether each step applied the backward's gradients: clipping that cut the norm is
    refused (the replay would differentiate the unclipped run), as is a GradScaler capture was not told of;
    clipping under its bound, gradient accumulation and a GradScaler given to capture (it only unscales) replay
    exactly."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.3)  # noqa: E731
    common = {"model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "optimizer": "sgd", "write": False}
    exact = unrolled("sgd", schedule=False)

    def clipped(bound):
        def step(model, optimizer):
            torch.nn.utils.clip_grad_norm_(model.parameters(), bound)
            optimizer.step()

        return step

    train_loop(store, "clipped", sgd, step=clipped(0.05))
    assert recorded_gradients(store, "clipped") == ["modified"] * T
    with pytest.raises(InvalidArgumentError, match=f"in {T} of its {T} recorded steps.*clip_grad_norm_"):
        store.replay(QUERIES, run="clipped", **common)
    train_loop(store, "under-bound", sgd, step=clipped(1e6))
    assert recorded_gradients(store, "under-bound") == ["backward"] * T
    np.testing.assert_allclose(by_example(store.replay(QUERIES, run="under-bound", **common)), exact, rtol=1e-9)

    def halves(loss):  # the step's gradient accumulated over two backwards
        (loss / 2).backward(retain_graph=True)
        (loss / 2).backward()

    train_loop(store, "accumulated", sgd, backward=halves)
    assert recorded_gradients(store, "accumulated") == ["backward"] * T
    np.testing.assert_allclose(by_example(store.replay(QUERIES, run="accumulated", **common)), exact, rtol=1e-9)

    for run, clip, told in (("amp", False, True), ("amp-untold", False, False), ("amp-clipped", True, True)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

        def step(model, optimizer, scaler=scaler, clip=clip):
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(optimizer)
            scaler.update()

        train_loop(store, run, sgd, backward=lambda loss, s=scaler: s.scale(loss).backward(), step=step,
                   grad_scaler=scaler if told else None)  # fmt: skip
        assert recorded_gradients(store, run) == ["modified" if clip or not told else "unscaled"] * T
    np.testing.assert_allclose(by_example(store.replay(QUERIES, run="amp", **common)), exact, rtol=1e-9)
    for run in ("amp-untold", "amp-clipped"):
        with pytest.raises(InvalidArgumentError, match="GradScaler not given to capture"):
            store.replay(QUERIES, run=run, **common)


def test_the_replay_reduces_as_the_runs_capture_was_told(store):
    """A run captured with an explicit ``loss_reduction`` replays with it by default, and a replay reduction that
    contradicts it is refused; a run left at the library's default takes either."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    common = {"model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "optimizer": "sgd", "write": False}
    train_loop(store, "sum", sgd, reduction="sum", loss_reduction="sum")
    exact = unrolled("sgd", schedule=False, reduction="sum", lr=0.05)
    np.testing.assert_allclose(by_example(store.replay(QUERIES, run="sum", **common)), exact, rtol=1e-9)
    with pytest.raises(InvalidArgumentError, match="loss_reduction='sum'.*reduction='mean'"):
        store.replay(QUERIES, run="sum", reduction="mean", **common)
    train_loop(store, "explicit-mean", sgd, loss_reduction="mean")
    with pytest.raises(InvalidArgumentError, match="loss_reduction='mean'.*reduction='sum'"):
        store.replay(QUERIES, run="explicit-mean", reduction="sum", **common)
    train_loop(store, "default", sgd, reduction="sum")  # the capture was not told: its default is no evidence
    replayed = store.replay(QUERIES, run="default", reduction="sum", **common)
    np.testing.assert_allclose(by_example(replayed), exact, rtol=1e-9)


def test_a_failing_loss_fn_is_an_invalid_argument_naming_it(store):
    """An error raised in ``loss_fn`` (or the model's forward inside it) is an ``InvalidArgumentError`` naming
    ``loss_fn`` and the original message, chained to the original error."""
    train(store, "sgd")

    def wrong_dtype(model, batch):
        return loss_fn(model, (batch[0].float(), batch[1]))

    def wrong_targets(model, batch):
        return loss_fn(model, (batch[0], batch[1][:, None].expand(-1, 3)))

    for bad, original in ((wrong_dtype, "dtype"), (wrong_targets, "size of tensor")):
        with pytest.raises(InvalidArgumentError, match=f"loss_fn\\(model, batch\\).*failed.*{original}") as raised:
            store.replay(QUERIES, run=RUN, model_fn=model_fn, batch_fn=batch_fn, loss_fn=bad, optimizer="sgd")
        assert isinstance(raised.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    "hyper, named",
    [
        ({"kind": "sgd", "momentum": -1.0}, "momentum"),
        ({"kind": "sgd", "momentum": math.inf}, "momentum"),
        ({"kind": "sgd", "dampening": math.nan, "momentum": 0.5}, "dampening"),
        ({"kind": "sgd", "weight_decay": math.nan}, "weight_decay"),
        ({"kind": "adamw", "weight_decay": -0.1}, "weight_decay"),
        ({"kind": "adam", "betas": (1.5, 0.999)}, "betas\\[0\\]"),
        ({"kind": "adam", "betas": (0.9, 1.0)}, "betas\\[1\\]"),
        ({"kind": "adam", "betas": (0.9,)}, "betas"),
        ({"kind": "adam", "eps": -1.0}, "eps"),
        ({"kind": "sgd", "nesterov": "yes", "momentum": 0.5}, "nesterov"),
    ],
)
def test_an_optimizer_out_of_range_is_refused_when_built(hyper, named):
    with pytest.raises(InvalidArgumentError, match=named):
        Optimizer(**hyper)


def test_a_token_mean_run_replays_with_sum_only():
    """``loss_reduction="token_mean"`` (the batch's token mean) is no replay reduction: ``"sum"`` with a
    ``loss_fn`` that divides by the batch's token count forms it; anything else is refused, saying so."""
    from gradstore.answers.replay import _run_reduction

    class TokenMeanRun:
        def run_config(self, run):
            return {"capture": {"loss_reduction": "token_mean"}, "explicit_options": ["loss_reduction"]}

    assert _run_reduction(TokenMeanRun(), "lm", "sum") == "sum"
    for reduction in (None, "mean"):
        with pytest.raises(InvalidArgumentError, match=r"num_items_in_batch\), and pass reduction='sum'"):
            _run_reduction(TokenMeanRun(), "lm", reduction)


def test_a_run_trained_with_online_selection_is_refused(store):
    x, y, batches, _, _ = data()
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        store.capture(model, RUN, optimizer=optimizer, projection=None) as cap,
        select_online(cap, RandomSelection(0.5)),
    ):
        for batch in batches:
            cap.set_ids([str(i) for i in batch])
            loss_fn(model, (x[batch], y[batch])).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    with pytest.raises(InvalidArgumentError, match="online data selection"):
        store.replay(QUERIES, run=RUN, model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer="sgd")


def test_a_loss_fn_giving_nan_or_no_gradient_is_refused_not_stored(store):
    """A ``loss_fn`` whose losses are NaN (a log of 0) or do not depend on the parameters (``.detach()``) gave
    NaN or all-zero metagradients, stored for ``method="replay"``: both are refused, naming the cause, and
    nothing is stored."""
    train(store, "sgd")
    common = {"run": RUN, "model_fn": model_fn, "batch_fn": batch_fn, "optimizer": "sgd"}
    with pytest.raises(InvalidArgumentError, match=r"non-finite: the weights after step 0 hold NaN/Inf"):
        store.replay(QUERIES, loss_fn=lambda m, b: loss_fn(m, b) * float("nan"), **common)

    def nan_on_queries(m, b):
        out = loss_fn(m, b)
        return out * float("nan") if len(out) == len(QUERIES) else out

    with pytest.raises(InvalidArgumentError, match=r"non-finite: the queries' final losses hold NaN/Inf"):
        store.replay(QUERIES, loss_fn=nan_on_queries, **common)
    for detached in (lambda m, b: loss_fn(m, b).detach(), lambda m, b: torch.zeros(len(b[1]), dtype=torch.float64)):
        with pytest.raises(InvalidArgumentError, match="do not depend on the model's parameters"):
            store.replay(QUERIES, loss_fn=detached, **common)
    with pytest.raises(MissingReplayError):
        store.attribute(["q0"], run=RUN, method="replay")
    assert np.isfinite(store.replay(QUERIES, loss_fn=loss_fn, write=False, **common).scores).all()


def test_a_loss_scaled_run_replays_exactly(store):
    """A loop multiplying its loss by a constant it gives capture as ``loss_scale`` took steps that much larger:
    the replay takes each step's objective at the scale capture recorded (``row_weights``), exact against the
    unrolled run (here plain SGD, where the scale is the learning rate's)."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.3)  # noqa: E731
    train_loop(store, "scaled", sgd, backward=lambda loss: (2.0 * loss).backward(), loss_scale=2.0)
    replayed = store.replay(
        QUERIES, run="scaled", model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer="sgd", write=False
    )
    np.testing.assert_allclose(by_example(replayed), unrolled("sgd", schedule=False, lr=0.6), rtol=1e-9)


def accumulated(
    store, run: str, sizes: tuple[int, ...], optimizer_of=lambda m: torch.optim.SGD(m.parameters(), lr=0.3)
):
    """Each step's batch in micro-batches of ``sizes``, each micro-batch's mean loss divided by their number (the
    usual gradient accumulation, told to capture as ``loss_scale``), one optimizer step after them."""
    x, y, batches, _, _ = data()
    model = model_fn()
    optimizer = optimizer_of(model)
    with store.capture(model, run, optimizer=optimizer, projection=None, loss_scale=1 / len(sizes)) as cap:
        for t in range(T):
            start = 0
            for size in sizes:
                part = batches[t][start : start + size]
                start += size
                cap.set_ids([str(i) for i in part])
                (loss_fn(model, (x[part], y[part])).mean() / len(sizes)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def test_gradient_accumulation_replays_equal_micro_batches_and_refuses_unequal_ones(store):
    """Micro-batches of equal size, each reduced by its mean and divided by their number, make the step the mean
    over the whole batch: replayed exactly. Of unequal sizes (1 + 3) an example of the small one weighed three times
    another's, which a replay reducing the step's losses by one mean cannot reproduce: refused, naming it."""
    common = {"model_fn": model_fn, "batch_fn": batch_fn, "loss_fn": loss_fn, "optimizer": "sgd", "write": False}
    accumulated(store, "even", (2, 2))
    replayed = store.replay(QUERIES, run="even", **common)
    np.testing.assert_allclose(by_example(replayed), unrolled("sgd", schedule=False), rtol=1e-9)
    accumulated(store, "uneven", (1, 3))
    with pytest.raises(InvalidArgumentError, match="weighted its examples unevenly.*micro-batches of different sizes"):
        store.replay(QUERIES, run="uneven", **common)


@pytest.mark.parametrize("name", ["sgd-momentum", "adam"])
def test_a_capture_begun_mid_training_is_refused(store, name):
    """Steps taken before the capture left momentum buffers (Adam's moments and step count) that the store does not
    hold; the replay starts from an empty optimizer state, so it refuses the run."""
    x, y, batches, _, _ = data()
    model = model_fn()
    kind, hyper = OPTIMIZERS[name]
    optimizer = kind(model.parameters(), **hyper)
    for t in range(2):  # before the capture
        loss_fn(model, (x[batches[t]], y[batches[t]])).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with store.capture(model, "late", optimizer=optimizer, projection=None) as cap:
        for t in range(2, T):
            cap.set_ids([str(i) for i in batches[t]])
            loss_fn(model, (x[batches[t]], y[batches[t]])).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    with pytest.raises(InvalidArgumentError, match="began mid-training.*capture from the run's first optimizer step"):
        store.replay(
            QUERIES, run="late", model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer=optimizer, write=False
        )


class Gated(nn.Module):
    """The MLP plus a parameter used only by batches that hold example ``"0"`` (an expert no token was routed to)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = model_fn()
        self.extra = nn.Linear(D, 1).double()

    def forward(self, x: torch.Tensor, gate: bool) -> torch.Tensor:
        out = self.body(x).squeeze(-1)
        return out + self.extra(x).squeeze(-1) if gate else out


def gated_model() -> Gated:
    torch.manual_seed(2)
    return Gated()


def gated_batch(ids):
    x, y = batch_fn(ids)
    return x, y, "0" in ids


def gated_loss(model, batch):
    x, y, gate = batch
    return 0.5 * (model(x, gate) - y) ** 2


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("name", ["sgd-momentum", "adamw"])
def test_parameters_without_a_gradient_are_replayed_as_the_optimizer_left_them(store, name, set_to_none):
    """``torch.optim`` skips a parameter whose ``.grad`` is ``None`` (no momentum, weight decay or Adam step count
    for it at that step); one whose gradient was zeroed in place (``zero_grad(set_to_none=False)``) is stepped.
    Capture records which had none (``without_gradients``); the replay's final weights are the training's."""
    x, y, batches, _, _ = data()
    model = gated_model()
    kind, hyper = OPTIMIZERS[name]
    optimizer = kind(model.parameters(), **hyper)
    with store.capture(model, RUN, optimizer=optimizer, projection=None) as cap:
        for t in range(T):
            ids = [str(i) for i in batches[t]]
            cap.set_ids(ids)
            gated_loss(model, gated_batch(ids)).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    skipped = store.sql("select count(*) from optimizer_steps where without_gradients is not null").fetchall()[0][0]
    assert (skipped > 0) == set_to_none and 0 < skipped < T if set_to_none else skipped == 0
    replayed = store.replay(
        QUERIES, run=RUN, model_fn=gated_model, batch_fn=gated_batch, loss_fn=gated_loss, optimizer=optimizer,
        write=False,
    )  # fmt: skip
    for name_, parameter in model.named_parameters():
        torch.testing.assert_close(replayed.final[name_], parameter.detach(), rtol=1e-12, atol=1e-13)


def test_schedulers_own_entries_and_decoupled_adam_are_not_hyper_parameters_to_refuse(store):
    """OneCycleLR keeps its ``max_lr``/``min_lr`` in the parameter groups (bookkeeping, not the update's): the
    run replays exactly with the torch optimizer given; ``Adam(decoupled_weight_decay=True)`` is AdamW."""
    held = {}

    def make(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        held["schedule"] = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.3, total_steps=T, cycle_momentum=False
        )
        return optimizer

    def step(model, optimizer):
        optimizer.step()
        held["schedule"].step()

    _, optimizer = train_loop(store, "cycle", make, step=step)
    replayed = store.replay(
        QUERIES, run="cycle", model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer=optimizer, write=False
    )
    model = model_fn()
    assert set(replayed.final) == {n for n, _ in model.named_parameters()}
    rates = [r[0] for r in replayed.group_learning_rates]
    assert len(set(rates)) > 2  # the cycle's learning rates, as recorded
    decoupled = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)
    assert Optimizer.of(decoupled) == Optimizer.of("adamw", weight_decay=0.1)


@pytest.mark.parametrize(
    "build, named",
    [
        (lambda: Optimizer("sgd", betas=(0.1, 0.2)), "sgd does not use betas"),
        (lambda: Optimizer("sgd", eps=5.0), "sgd does not use eps"),
        (lambda: Optimizer("adam", momentum=0.9), "adam does not use momentum"),
        (lambda: Optimizer("adamw", nesterov=True), "adamw does not use nesterov"),
    ],
)
def test_an_optimizer_setting_the_replay_would_not_use_is_refused(build, named):
    """Every setting of the replay's optimizer means something: one its kind does not use is an InvalidArgumentError
    naming it; a torch optimizer's own lr is not read (each step's is the recorded one)."""
    with pytest.raises(InvalidArgumentError, match=named):
        build()
    model = model_fn()
    assert Optimizer.of(torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5)) == Optimizer("sgd", momentum=0.5)


def test_clipping_is_recorded_where_the_checked_gradient_sums_to_zero(tmp_path):
    """The fingerprint of a step's gradients is a sum of squares: a 2-class head's bias (the smallest captured
    parameter, the one fingerprinted) has a gradient summing to zero by construction, so a plain sum recorded
    clipped steps as the backward's (and rounding noise once looked like a GradScaler's power of two). Every
    clipped step is recorded "modified", with no UnscaledRowsWarning; an unclipped run records "backward"."""
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, D, generator=generator), torch.randint(0, 2, (32,), generator=generator)

    def run(name: str, clip: float | None) -> list:
        torch.manual_seed(4)
        model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        store = gradstore.open(tmp_path / name)
        with store.capture(model, "run", optimizer=optimizer, projection=None) as cap:
            for t in range(8):
                batch = slice(4 * t, 4 * t + 4)
                cap.set_ids([str(i) for i in range(32)][batch])
                nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
        return [row[0] for row in store.sql("select gradients from optimizer_steps order by step").fetchall()]

    with warnings.catch_warnings():
        warnings.simplefilter("error", gradstore.UnscaledRowsWarning)
        assert run("clipped", 1e-4) == ["modified"] * 8
        assert run("plain", None) == ["backward"] * 8


def test_a_run_whose_first_step_has_no_rows_is_refused(store):
    """A capture in Adam's geometry (``normalizer="adam_sqrt"``) records no rows at the first step: the replay
    would start at the second from ``model_fn()``'s initial weights and an empty state (its final weights were
    off by more than training moved them). It refuses, naming the step without rows."""
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.05)  # noqa: E731
    train_loop(store, "geometry", adam, normalizer="adam_sqrt")
    with pytest.raises(InvalidArgumentError, match="before the first step with training rows, 1"):
        store.replay(
            QUERIES, run="geometry", model_fn=model_fn, batch_fn=batch_fn, loss_fn=loss_fn, optimizer="adam",
            write=False,
        )  # fmt: skip


class Attending(nn.Module):
    """A linear layer, then PyTorch's fused attention over each example's ``D`` features as tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x.unsqueeze(-1).float()).unsqueeze(1)  # [B, 1 head, D tokens, 8]
        return nn.functional.scaled_dot_product_attention(h, h, h).sum((1, 2, 3)).double()


def test_an_operation_without_a_second_derivative_is_named_with_what_to_do(store):
    """The replay differentiates each step's gradient: a model whose fused attention kernel has no second
    derivative (PyTorch's CPU flash attention) is an InvalidArgumentError naming it and the eager alternative,
    not a bare RuntimeError."""
    x, y, batches, _, _ = data()

    def make() -> nn.Module:
        torch.manual_seed(5)
        return Attending()

    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with store.capture(model, "attention", optimizer=optimizer, projection=None) as cap:
        for t in range(3):
            cap.set_ids([str(i) for i in batches[t]])
            loss_fn(model, (x[batches[t]], y[batches[t]])).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    with pytest.raises(InvalidArgumentError, match="second derivative.*attn_implementation='eager'"):
        store.replay(
            QUERIES, run="attention", model_fn=make, batch_fn=batch_fn, loss_fn=loss_fn, optimizer="sgd", write=False
        )
