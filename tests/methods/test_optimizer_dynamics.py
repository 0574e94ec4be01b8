"""Optimizer-aware trajectory attribution (``dvemb`` over SGD with momentum / weight decay, Adam, AdamW) against
autograd through the recorded unrolled run, and the stability rule.

The model is a two-output linear regression with squared loss: quadratic in its weights, so the batch Hessian is
exactly ``I_2 (x) mean x~ x~^T``, which the true-Fisher rows (``sqrt 2`` times the gradient of each output, split
``"true-fisher"``) give exactly; rows are stored unprojected (``projection=None``), so Adam's per-coordinate
preconditioner is recorded exactly. The reference differentiates the final query loss with respect to per-example
loss weights through a functional replay of the optimizer (PyTorch's update rules), Adam's second moment held at
its recorded values (the preconditioner is frozen per step: what the linearised dynamics model).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import gradstore
from gradstore.core import schema as S
from gradstore.errors import InvalidArgumentError, UnstableRecursionError, UnstableStepWarning
from gradstore.methods import TRUE_FISHER_SPLIT, dvemb, dynamics

N, D, OUT, B, T = 10, 3, 2, 4, 8
RUN = "quad"

OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}, 0.1),
    "sgd-momentum-wd": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.05}, 0.1),
    "sgd-nesterov-wd": (torch.optim.SGD, {"momentum": 0.8, "nesterov": True, "weight_decay": 0.02}, 0.1),
    "adam": (torch.optim.Adam, {"betas": (0.9, 0.99), "weight_decay": 0.01}, 0.05),
    "adamw": (torch.optim.AdamW, {"betas": (0.8, 0.95), "weight_decay": 0.1}, 0.05),
    # AMSGrad divides by the running maximum of the second moment, which the recorded preconditioner must be
    "adam-amsgrad": (torch.optim.Adam, {"betas": (0.9, 0.9), "amsgrad": True}, 0.05),
    # parameter groups: no weight decay on the bias (recorded per coordinate)
    "sgd-momentum-groups": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.05, "bias_weight_decay": 0.0}, 0.1),
    "adamw-groups": (torch.optim.AdamW, {"betas": (0.8, 0.95), "weight_decay": 0.1, "bias_weight_decay": 0.0}, 0.05),
    # the bias in a group of its own, listed first, at another learning rate (recorded per layer, per coordinate)
    "sgd-momentum-bias-lr": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.05, "bias_lr": 0.2}, 0.1),
    "adamw-bias-lr": (torch.optim.AdamW, {"betas": (0.8, 0.95), "weight_decay": 0.1, "bias_lr": 3.0}, 0.05),
    # the loop multiplies its losses by a constant it gives capture as loss_scale: the steps are that much larger
    "sgd-momentum-loss-scale": (torch.optim.SGD, {"momentum": 0.9, "loss_scale": 2.0}, 0.05),
    "adam-loss-scale": (torch.optim.Adam, {"betas": (0.9, 0.99), "weight_decay": 0.01, "loss_scale": 0.5}, 0.05),
}


def variant_options(name: str) -> tuple[float, float]:
    """The bias's learning rate over the weight's and the loss scale of optimizer variant ``name``."""
    options = OPTIMIZERS[name][1]
    return options.get("bias_lr", 1.0), options.get("loss_scale", 1.0)


def optimizer_for(model: nn.Linear, name: str) -> torch.optim.Optimizer:
    cls, options, base = OPTIMIZERS[name]
    options = {k: v for k, v in options.items() if k not in ("bias_lr", "loss_scale")}
    bias_decay = options.pop("bias_weight_decay", None)
    bias_lr, _ = variant_options(name)
    if bias_decay is None and bias_lr == 1.0:
        return cls(model.parameters(), lr=base, **options)
    if bias_lr != 1.0:
        return cls([{"params": [model.bias], "lr": base * bias_lr}, {"params": [model.weight]}], lr=base, **options)
    groups = [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": bias_decay}]
    return cls(groups, lr=base, **options)


def problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=generator, dtype=torch.float64)
    y = torch.randn(N, OUT, generator=generator, dtype=torch.float64)
    qx = torch.randn(2, D, generator=generator, dtype=torch.float64)
    qy = torch.randn(2, OUT, generator=generator, dtype=torch.float64)
    batches = [torch.randperm(N, generator=generator)[:B] for _ in range(T)]
    return x, y, qx, qy, batches


def init_model() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(D, OUT).double()


def schedule(base: float) -> list[float]:
    return [base * (1 - 0.05 * t) for t in range(T)]


def train_captured(store: gradstore.GradStore, name: str, steps: int = T) -> nn.Linear:
    """``steps`` optimizer steps inside one capture: per step, true-Fisher rows then the training rows."""
    x, y, _, _, batches = problem()
    _, _, base = OPTIMIZERS[name]
    model = init_model()
    optimizer = optimizer_for(model, name)
    rates = schedule(base)
    bias_lr, scale = variant_options(name)
    options = {"loss_scale": scale} if scale != 1.0 else {}
    with store.capture(model, RUN, optimizer=optimizer, projection=None, **options) as cap:
        for t in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = rates[t] * (bias_lr if group["params"][0] is model.bias else 1.0)
            ids = [str(int(i)) for i in batches[t]]
            cap.set_split(TRUE_FISHER_SPLIT)
            for output in range(OUT):  # sqrt(OUT) x each output's gradient: C^T C / (OUT B) = the batch Hessian
                cap.set_ids(ids)
                (scale * math.sqrt(OUT) * model(x[batches[t]])[:, output]).mean().backward()
                optimizer.zero_grad()
            cap.set_split("train")
            cap.set_ids(ids)
            (scale * 0.5 * ((model(x[batches[t]]) - y[batches[t]]) ** 2).sum(1)).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def capture_queries(store: gradstore.GradStore, model: nn.Linear, step: int = T) -> None:
    _, _, qx, qy, _ = problem()
    with store.capture(model, RUN, checkpoint="final", projection=None, loss_scale=1.0) as cap:
        cap.set_step(step)
        cap.set_split("query")
        cap.set_ids(["qa", "qb"])
        (0.5 * ((model(qx) - qy) ** 2).sum(1)).mean().backward()
        model.zero_grad()
    store.core.record_checkpoint(RUN, "final", step=step)


def replay(name: str, frozen: bool = True, steps: int = T) -> tuple[np.ndarray, torch.Tensor]:
    """``-d L_q(theta_T) / d w_z`` (float64 autograd) through a functional replay of the optimizer with
    per-example loss weights ``w`` (all 1: the recorded run), and the replay's final weights ``[OUT, D + 1]``."""
    x, y, qx, qy, batches = problem()
    cls, options, base = OPTIMIZERS[name]
    model = init_model()
    rates = schedule(base)
    weights = torch.ones(N, dtype=torch.float64, requires_grad=True)
    theta = torch.cat([model.weight.detach(), model.bias.detach()[:, None]], 1).clone().requires_grad_()
    xt = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    qt = torch.cat([qx, torch.ones(2, 1, dtype=torch.float64)], 1)
    wd = torch.full_like(theta, options.get("weight_decay", 0.0))
    wd[:, -1] = options.get("bias_weight_decay", options.get("weight_decay", 0.0))
    bias_lr, scale = variant_options(name)
    buffer, m, v = None, torch.zeros_like(theta), torch.zeros_like(theta)
    peak = torch.zeros_like(theta)  # AMSGrad's running maximum of v
    for t in range(steps):
        lr, batch = torch.full_like(theta, rates[t]), batches[t]
        lr[:, -1] *= bias_lr
        residual = xt[batch] @ theta.T - y[batch]
        loss = scale * (weights[batch] * 0.5 * (residual**2).sum(1)).mean()
        (grad,) = torch.autograd.grad(loss, theta, create_graph=True)
        if cls is torch.optim.SGD:
            grad = grad + wd * theta
            mu = options["momentum"]
            buffer = grad if buffer is None else mu * buffer + grad
            theta = theta - lr * ((grad + mu * buffer) if options.get("nesterov") else buffer)
            continue
        beta1, beta2 = options["betas"]
        if cls is torch.optim.Adam:
            grad = grad + wd * theta
        else:
            theta = theta * (1 - lr * wd)
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * (grad.detach() if frozen else grad) ** 2
        if options.get("amsgrad"):
            peak = torch.maximum(peak, v)
        denominator = ((peak if options.get("amsgrad") else v) / (1 - beta2 ** (t + 1))).sqrt() + 1e-8
        theta = theta - lr / (1 - beta1 ** (t + 1)) * m / denominator
    effects = []
    for query in range(2):
        loss = 0.5 * ((qt[query] @ theta.T - qy[query]) ** 2).sum()
        (grad_w,) = torch.autograd.grad(loss, weights, retain_graph=True)
        effects.append(-grad_w.numpy())
    return np.stack(effects), theta.detach()


def columns(matrix: gradstore.ScoreMatrix) -> np.ndarray:
    out = np.zeros((len(matrix.query_ids), N))
    for column, example in enumerate(matrix.example_ids):
        out[:, int(example)] = matrix.scores[:, column]
    return out


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_dvemb_equals_autograd_through_the_optimizers_unrolled_run(tmp_path, monkeypatch, name, streamed):
    if streamed:  # one step's rows and dynamics read at a time; the product updated one row at a time (buffers)
        monkeypatch.setattr("gradstore.methods.dvemb.CHUNK_BYTES", 1)
        monkeypatch.setattr("gradstore.methods.dynamics.SUMMARY_STEPS", 1)
        monkeypatch.setattr("gradstore.methods.dynamics.SLICE_BYTES", 1)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = train_captured(store, name)
    capture_queries(store, model)
    truth, final = replay(name)
    trained = torch.cat([model.weight.detach(), model.bias.detach()[:, None]], 1)
    torch.testing.assert_close(final, trained, rtol=1e-10, atol=1e-12)  # the replay is the recorded run
    recorded = store.sql(f"select * from {S.OPTIMIZER_STEPS} order by step").to_arrow_table().to_pylist()
    assert [r["step"] for r in recorded] == list(range(T))
    assert recorded[0]["optimizer"] == name.split("-")[0]
    if name.endswith("-groups"):  # per coordinate: the bias (each row's last entry) decays by 0
        decays = np.array(recorded[0]["weight_decays"]).reshape(OUT, D + 1)
        assert (decays[:, -1] == 0).all() and (decays[:, :-1] == OPTIMIZERS[name][1]["weight_decay"]).all()
    else:
        assert recorded[0]["weight_decays"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstableStepWarning)
        scores = columns(store.score_matrix(["qa", "qb"], run=RUN, method="dvemb"))
    if streamed:  # the per-chunk reads of the recorded dynamics stream: none is kept in the store's row cache
        scans = [key for key in store.core.row_cache._entries if isinstance(key, tuple) and key[1:2] == ("scan",)]
        assert scans and not [key for key in scans if key[2] == S.OPTIMIZER_STEPS]
    error = np.abs(scores - truth).max()
    print(f"{name}: max |dvemb - autograd| = {error:.3g} (scale {np.abs(truth).max():.3g})")
    np.testing.assert_allclose(scores, truth, rtol=2e-4, atol=2e-6 * np.abs(truth).max())


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_the_frozen_preconditioner_is_close_to_adams_full_derivative(tmp_path, name):
    """What freezing ``v`` per step leaves out: reported against autograd through ``v`` as well."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = train_captured(store, name)
    capture_queries(store, model)
    full, _ = replay(name, frozen=False)
    scores = columns(store.score_matrix(["qa", "qb"], run=RUN, method="dvemb"))
    correlation = np.corrcoef(scores.ravel(), full.ravel())[0, 1]
    print(f"{name}: Pearson(dvemb, autograd through v too) = {correlation:.5f}")
    assert correlation > 0.5


def test_stores_without_recorded_optimizer_steps_score_with_the_plain_model(tmp_path):
    """A run whose steps have no ``optimizer_steps`` rows (stores made before the table) is ``lr x gradient``:
    what dvemb gave before, whatever optimizer trained it."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = train_captured(store, "sgd-momentum")
    capture_queries(store, model)
    steps = dvemb_steps(store)
    assert all(s.coefficients is not None and s.coefficients.has_momentum for s in steps)
    old = gradstore.open(tmp_path / "old", storage_dtype="float32")
    copy_rows(store, old)
    assert not old.core.has_table(S.OPTIMIZER_STEPS)
    assert all(s.coefficients is None for s in dvemb_steps(old))
    plain = columns(old.score_matrix(["qa", "qb"], run=RUN, method="dvemb"))
    aware = columns(store.score_matrix(["qa", "qb"], run=RUN, method="dvemb"))
    truth, _ = replay("sgd-momentum")
    assert np.abs(aware - truth).max() < 1e-3 * np.abs(truth).max()
    assert np.abs(plain - truth).max() > 0.1 * np.abs(truth).max()  # a step 10x too small


def dvemb_steps(store: gradstore.GradStore):
    from gradstore.methods.trajectory import recorded_steps

    return dynamics.with_dynamics(store.core, RUN, "train", recorded_steps(store.core, RUN, "train"))


def copy_rows(source: gradstore.GradStore, target: gradstore.GradStore) -> None:
    """The run's rows and checkpoints into another store, without the ``optimizer_steps`` table."""
    block = source.core.read_gradients(RUN, columns=("example_id", "checkpoint", "step", "split", "learning_rate"))
    target.core.create_run(RUN, dim=source.core.run_dim(RUN))
    meta = block.metadata
    with target.writer(RUN) as writer:
        writer.append(
            block.vectors,
            meta.column("example_id").to_pylist(),
            checkpoint=meta.column("checkpoint").to_pylist(),
            step=meta.column("step").to_pylist(),
            split=meta.column("split").to_pylist(),
            learning_rate=meta.column("learning_rate").to_pylist(),
        )
    target.core.record_checkpoint(RUN, "final", step=T)


# ---------------------------------------------------------------------------------------------- stability
def write_steps(store: gradstore.GradStore, rate: float, steps: int, momentum: float | None = None) -> None:
    """Hand-written in-loop rows: ``steps`` steps of the same batch at learning rate ``rate`` whose curvature
    (true-Fisher rows ``x~``) has largest eigenvalue ``lambda_max``; with ``momentum``, SGD rows of the
    ``optimizer_steps`` table."""
    x, _, qx, _, _ = problem()
    rows = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1).numpy()
    store.core.create_run(RUN, dim=D + 1)
    with store.writer(RUN) as writer:
        for t in range(steps):
            ids = [str(i) for i in range(N)]
            writer.append(rows, ids, checkpoint="train", step=t, split="train", learning_rate=rate)
            writer.append(rows, ids, checkpoint="train", step=t, split=TRUE_FISHER_SPLIT, learning_rate=rate)
        writer.append(rows[:2], ["qa", "qb"], checkpoint="final", step=steps, split="query")
    store.core.record_checkpoint(RUN, "final", step=steps)
    if momentum is not None:
        import pyarrow as pa

        records = [
            {"run_id": RUN, "checkpoint": "train", "step": t, "optimizer": "sgd", "learning_rate": rate,
             "momentum": momentum, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}
            for t in range(steps)
        ]  # fmt: skip
        store.core.results.append_table(
            S.OPTIMIZER_STEPS, pa.Table.from_pylist(records, schema=S.OPTIMIZER_STEPS_SCHEMA)
        )


def largest_curvature() -> float:
    x, *_ = problem()
    rows = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    return float(torch.linalg.eigvalsh(rows.T @ rows / N)[-1])


def test_an_unstable_step_is_clipped_with_a_warning_naming_it(tmp_path):
    """``lr lambda_max = 3``: beyond plain SGD's bound 2 (clipped, warned, finite and bounded), within heavy
    ball's ``2 (1 + 0.9)`` (no warning)."""
    rate = 3.0 / largest_curvature()
    store = gradstore.open(tmp_path / "plain", storage_dtype="float32")
    write_steps(store, rate, 12)
    with pytest.warns(UnstableStepWarning, match=r"12 recorded step\(s\) \(steps \[0, 1, 2"):
        scores = store.score_matrix(["qa", "qb"], run=RUN, method="dvemb").scores
    assert np.isfinite(scores).all()
    assert np.abs(scores).max() < 12 * rate * 10 * largest_curvature()  # clipped modes do not grow
    heavy = gradstore.open(tmp_path / "heavy", storage_dtype="float32")
    write_steps(heavy, rate, 12, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstableStepWarning)
        assert np.isfinite(heavy.score_matrix(["qa", "qb"], run=RUN, method="dvemb").scores).all()


@pytest.mark.parametrize("momentum", [None, 0.5])
def test_an_overflowing_recursion_names_the_step_not_the_rows(tmp_path, monkeypatch, momentum):
    monkeypatch.setattr(dynamics, "STABILITY", "off")
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    write_steps(store, 1e20, 20, momentum=momentum)
    with pytest.raises(UnstableRecursionError, match=r"non-finite at step \d+") as raised:
        store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")
    assert "nonfinite='drop'" not in str(raised.value)
    assert "STABILITY = 'clip'" in str(raised.value)  # what to do
    monkeypatch.setattr(dynamics, "STABILITY", "clip")
    with pytest.warns(UnstableStepWarning):
        assert np.isfinite(store.score_matrix(["qa", "qb"], run=RUN, method="dvemb").scores).all()


def test_embeddings_overflowing_float32_say_what_to_do(tmp_path, monkeypatch):
    """A recursion finite in float64 whose embeddings overflow the store's float32 rows (``|1 - lr lambda| = 100``
    over 20 steps): the error says to turn the stability rule back on."""
    monkeypatch.setattr(dynamics, "STABILITY", "off")
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    write_steps(store, 101.0 / largest_curvature(), 20)
    with pytest.raises(UnstableRecursionError, match="overflow float32") as raised:
        store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")
    assert "turn the stability rule back on (gradstore.methods.dynamics.STABILITY = 'clip'" in str(raised.value)


def test_cached_embeddings_keep_their_stability_rule_and_warn_what_it_clipped(tmp_path, monkeypatch):
    """The derived run keeps the rule it was built under and the steps that rule clipped: every later use of the
    cached embeddings (a store opened again: another process) warns them again, and another rule rebuilds them
    (what a fresh build under that rule gives); a rule other than 'clip' and 'off' is refused."""
    rate = 3.0 / largest_curvature()  # beyond plain SGD's bound: every step clipped under 'clip'
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    write_steps(store, rate, 12)
    with pytest.warns(UnstableStepWarning, match=r"12 recorded step\(s\) \(steps \[0, 1, 2"):
        clipped = store.score_matrix(["qa", "qb"], run=RUN, method="dvemb").scores
    builds = []
    recursion = dvemb.recursion
    monkeypatch.setattr(dvemb, "recursion", lambda *args: builds.append(args) or recursion(*args))
    reopened = gradstore.open(tmp_path / "store")
    for _ in range(2):
        with pytest.warns(UnstableStepWarning, match=r"12 recorded step\(s\) \(steps \[0, 1, 2"):
            np.testing.assert_array_equal(reopened.score_matrix(["qa", "qb"], run=RUN, method="dvemb").scores, clipped)
    with pytest.warns(UnstableStepWarning, match=r"12 recorded step\(s\)"):
        reopened.attribute(["qa"], run=RUN, method="dvemb", k=2, write=False)
    assert not builds  # read from the cache each time
    monkeypatch.setattr(dynamics, "STABILITY", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstableStepWarning)
        unclipped = reopened.score_matrix(["qa", "qb"], run=RUN, method="dvemb").scores
        fresh = gradstore.open(tmp_path / "fresh", storage_dtype="float32")
        write_steps(fresh, rate, 12)
        np.testing.assert_allclose(unclipped, fresh.score_matrix(["qa", "qb"], run=RUN, method="dvemb").scores)
    assert len(builds) == 2  # rebuilt under the new rule
    assert np.abs(unclipped).max() > 10 * np.abs(clipped).max()  # unclipped modes grow: not the cached numbers
    monkeypatch.setattr(dynamics, "STABILITY", "clipped")
    with pytest.raises(InvalidArgumentError, match="set it to 'clip'"):
        reopened.score_matrix(["qa", "qb"], run=RUN, method="dvemb")


# ---------------------------------------------------------------------------------------------- source
def heavy_ball_passes(store: gradstore.GradStore, rate: float, mu: float, wd: float, steps: int, every: int):
    """Full-batch SGD with momentum ``mu`` and weight decay ``wd`` (its steps recorded by a paused capture with
    the optimizer); a checkpoint pass (training rows, true-Fisher rows, queries) every ``every`` steps."""
    x, y, qx, qy, _ = problem()
    model = init_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=rate, momentum=mu, weight_decay=wd)
    ids = [str(i) for i in range(N)]
    plan = []
    for start in range(0, steps, every):
        with store.capture(model, RUN, optimizer=optimizer, checkpoint="steps", projection=None) as cap:
            cap.set_step(start)
            with cap.paused():
                for _ in range(every):
                    optimizer.zero_grad()
                    (0.5 * ((model(x) - y) ** 2).sum(1)).mean().backward()
                    optimizer.step()
        name = f"c{start + every}"
        with store.capture(model, RUN, checkpoint=name, learning_rate=rate, projection=None) as cap:
            cap.set_step(start + every)
            cap.set_ids(ids)
            (0.5 * ((model(x) - y) ** 2).sum(1)).mean().backward()
            cap.set_split(TRUE_FISHER_SPLIT)
            for output in range(OUT):
                cap.set_ids(ids)
                (math.sqrt(OUT) * model(x)[:, output]).mean().backward()
            cap.set_split("query")
            cap.set_ids(["qa", "qb"])
            (0.5 * ((model(qx) - qy) ** 2).sum(1)).mean().backward()
            model.zero_grad()
        plan.append((name, start + every))
    optimizer.zero_grad()
    return plan


def heavy_ball_truth(rate: float, mu: float, wd: float, steps: int) -> np.ndarray:
    x, y, qx, qy, _ = problem()
    model = init_model()
    weights = torch.ones(N, dtype=torch.float64, requires_grad=True)
    theta = torch.cat([model.weight.detach(), model.bias.detach()[:, None]], 1).clone().requires_grad_()
    xt = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    qt = torch.cat([qx, torch.ones(2, 1, dtype=torch.float64)], 1)
    buffer = None
    for _ in range(steps):
        loss = (weights * 0.5 * ((xt @ theta.T - y) ** 2).sum(1)).mean()
        (grad,) = torch.autograd.grad(loss, theta, create_graph=True)
        grad = grad + wd * theta
        buffer = grad if buffer is None else mu * buffer + grad
        theta = theta - rate * buffer
    return np.stack(
        [
            -torch.autograd.grad(0.5 * ((qt[q] @ theta.T - qy[q]) ** 2).sum(), weights, retain_graph=True)[0].numpy()
            for q in range(2)
        ]
    )


def heavy_ball_source_reference(store: gradstore.GradStore, plan, rate: float, mu: float, wd: float) -> np.ndarray:
    """SOURCE over the heavy ball's discrete dynamics with numpy: per segment the joint ``2d x 2d`` step
    ``A = [[I - lr (F + wd), -lr mu], [F + wd, mu]]``, ``S = sum_j A^j [-lr; 1]``, the final weights' row carried."""
    core = store.core
    dim = (D + 1) * OUT
    queries = core.read_gradients(RUN, checkpoint=plan[-1][0], split="query").vectors.astype(np.float64)
    total, previous, segments = np.zeros((2, N)), 0, []
    for name, step in plan:
        segments.append((name, step - previous))
        previous = step
    eye = np.eye(dim)
    carried = np.hstack([eye, np.zeros((dim, dim))])
    for name, steps in reversed(segments):
        rows = core.read_gradients(RUN, checkpoint=name, split=TRUE_FISHER_SPLIT).vectors.astype(np.float64)
        curvature = rows.T @ rows / len(rows) + wd * eye
        step = np.block([[eye - rate * curvature, -rate * mu * eye], [curvature, mu * eye]])
        inject, power, summed = np.vstack([-rate * eye, eye]), np.eye(2 * dim), np.zeros((2 * dim, dim))
        for _ in range(steps):
            summed += power @ inject
            power = step @ power
        block = core.read_gradients(RUN, checkpoint=name, split="train")
        train = block.vectors.astype(np.float64)
        prepared = -queries @ carried @ summed / len(train)
        for column, example in enumerate(block.metadata.column("example_id").to_pylist()):
            total[:, int(example)] += prepared @ train[column]
        carried = carried @ power
    return total


def test_sources_isotropic_preconditioner_weights_adams_by_its_second_moment():
    eps = 1e-8
    v = np.array([4.0, 1.0, 0.25, 0.0, 0.0, 0.0])  # three coordinates that never saw a gradient: p = 1 / eps there
    p = 1.0 / (np.sqrt(v) + eps)
    co = dynamics.Coefficients(1.0, 1e-3, 0.0, 0.9, 0.1, 0.0, torch.from_numpy(p), "adam")
    scale = dynamics.isotropic_preconditioner(co, {"eps": eps, "preconditioner": p})  # recorded per coordinate
    assert scale == pytest.approx(float((p * v).sum() / v.sum()), rel=1e-12)  # (2 + 1 + 0.5) / 5.25
    assert scale < 2.0 < float(p.mean())  # the plain mean, ~5e7, is the coordinates without gradients
    per_layer = dynamics.Coefficients(1.0, 1e-3, 0.0, 0.9, 0.1, 0.0, torch.tensor([2.0, 2.0, 2.0, 8.0]), "adam")
    assert dynamics.isotropic_preconditioner(per_layer, {"eps": eps, "preconditioner": [2.0, 8.0]}) == 3.5
    assert dynamics.isotropic_preconditioner(dynamics.Coefficients.plain(1e-3), {}) == 1.0


def test_source_carries_heavy_ball_dynamics(tmp_path, monkeypatch):
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    rate, mu, wd, steps = 0.01, 0.9, 0.05, 60
    plan = heavy_ball_passes(store, rate, mu, wd, steps, every=20)
    recorded = store.sql(f"select step, momentum from {S.OPTIMIZER_STEPS}").to_arrow_table()
    assert sorted(recorded.column("step").to_pylist()) == list(range(steps))
    scores = columns(store.score_matrix(["qa", "qb"], run=RUN, method="source"))
    reference = heavy_ball_source_reference(store, plan, rate, mu, wd)
    error = np.abs(scores - reference).max()
    print(f"source heavy ball: max |source - discrete closed form| = {error:.3g} (scale {np.abs(reference).max():.3g})")
    np.testing.assert_allclose(scores, reference, rtol=1e-4, atol=1e-6 * np.abs(reference).max())
    truth = heavy_ball_truth(rate, mu, wd, steps)
    relative = np.abs(scores - truth).max() / np.abs(truth).max()
    correlation = np.corrcoef(scores.ravel(), truth.ravel())[0, 1]
    print(f"source heavy ball vs unrolled truth: relative max error {relative:.3g}, Pearson {correlation:.5f}")
    assert correlation > 0.95
    # without the recorded steps (a store made before them): SOURCE's lr x gradient flow, 10x too short a horizon
    monkeypatch.setattr(dynamics, "segment_coefficients", lambda store, run, ends: [None] * len(ends))
    plain = columns(store.score_matrix(["qa", "qb"], run=RUN, method="source"))
    plain_relative = np.abs(plain - truth).max() / np.abs(truth).max()
    plain_correlation = np.corrcoef(plain.ravel(), truth.ravel())[0, 1]
    print(
        f"source plain lr model vs unrolled truth: relative max error {plain_relative:.3g}, "
        f"Pearson {plain_correlation:.5f}"
    )
    assert relative < plain_relative


# ---------------------------------------------------------------------------------------------- capture
def expected_preconditioner(optimizer: torch.optim.Optimizer, layers: list[nn.Linear]) -> list[torch.Tensor]:
    """Per layer ``1 / (sqrt(v_hat) + eps)`` as ``[d_out, d_in + 1]`` (the bias as the last column)."""
    eps, beta2 = optimizer.param_groups[0]["eps"], optimizer.param_groups[0]["betas"][1]
    out = []
    for layer in layers:
        parts = []
        for param in (layer.weight, layer.bias):
            state = optimizer.state[param]
            v = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
            parts.append(1 / (v.sqrt() + eps))
        out.append(torch.cat([parts[0], parts[1][:, None]], 1))
    return out


@pytest.mark.parametrize("projection", [None, "factorized"])
def test_capture_records_adams_preconditioner_in_the_rows_space(tmp_path, projection):
    """Unprojected rows: per coordinate, in the rows' layout; projected: one value per layer, the layer's
    preconditioner weighted by ``v_hat``. dvemb scores over either."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    options = {"projection": projection} if projection is None else {"projection": projection, "k_in": 2, "k_out": 2}
    with store.capture(model, RUN, optimizer=optimizer, **options) as cap:
        for _ in range(3):
            cap.set_ids([str(i) for i in range(6)])
            (0.5 * ((model(x) - y) ** 2).sum(1)).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    rows = store.sql(f"select * from {S.OPTIMIZER_STEPS} order by step").to_arrow_table().to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["adam_step"] == 3
    assert rows[-1]["momentum"] == 0.9 and rows[-1]["beta2"] == 0.999 and rows[-1]["optimizer"] == "adam"
    recorded = torch.tensor(rows[-1]["preconditioner"], dtype=torch.float64)
    expected = expected_preconditioner(optimizer, [model[0], model[2]])
    if projection is None:
        torch.testing.assert_close(recorded, torch.cat([e.reshape(-1) for e in expected]), rtol=1e-12, atol=0)
    else:
        v = [1 / (e - 1e-8) ** 2 for e in expected]  # v_hat back from 1 / (sqrt(v_hat) + eps)
        means = torch.stack([(e * w).sum() / w.sum() for e, w in zip(expected, v)])
        torch.testing.assert_close(recorded, means, rtol=1e-6, atol=0)
    with store.capture(model, RUN, checkpoint="final", **options) as cap:
        cap.set_step(3)
        cap.set_split("query")
        cap.set_ids(["qa"])
        (0.5 * ((model(x[:1]) - y[:1]) ** 2).sum(1)).mean().backward()
        model.zero_grad()
    store.core.record_checkpoint(RUN, "final", step=3)
    assert np.isfinite(store.score_matrix(["qa"], run=RUN, method="dvemb").scores).all()


def test_source_clips_an_unstable_segment_with_a_warning(tmp_path):
    """Heavy ball at ``lr lambda_max = 4.5 > 2 (1 + 0.9)``: the segments' modes beyond the bound are clipped."""
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    rate = 4.5 / largest_curvature()
    heavy_ball_passes(store, rate, 0.9, 0.0, 20, every=10)
    with pytest.warns(UnstableStepWarning, match=r"segment\(s\) \['c10 \(largest eigenvalue"):
        scores = store.score_matrix(["qa", "qb"], run=RUN, method="source").scores
    assert np.isfinite(scores).all()


def test_rows_in_adams_geometry_are_not_preconditioned_again(tmp_path):
    """A capture with ``normalizer="adam_sqrt"`` records it on each step: its rows carry Adam's preconditioner, so
    the step's dynamics keep Adam's momentum and bias correction with ``P = I`` (not ``P`` twice)."""
    from gradstore.methods import dynamics

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    with store.capture(model, RUN, optimizer=optimizer, projection=None, normalizer="adam_sqrt") as cap:
        for _ in range(3):
            cap.set_ids([str(i) for i in range(6)])
            (0.5 * ((model(x) - y) ** 2).sum(1)).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    rows = store.sql(f"select * from {S.OPTIMIZER_STEPS} order by step").to_arrow_table().to_pylist()
    assert [r["rows_normalizer"] for r in rows] == ["adam_sqrt"] * 3
    dim = store.core.run_dim(RUN)
    normalised = dynamics.coefficients(rows[-1], 0.01, dim, [(0, dim)])
    raw = dynamics.coefficients({**rows[-1], "rows_normalizer": None}, 0.01, dim, [(0, dim)])
    assert normalised.p is None and raw.p is not None
    assert normalised.mu == raw.mu == 0.9 and (normalised.a, normalised.b) == (raw.a, raw.b)
    assert not normalised.is_plain  # momentum and decoupled weight decay stay modelled


def trained_with(path, optimizer_of) -> gradstore.GradStore:
    """A store of 4 in-loop steps of ``optimizer_of(parameters)`` and checkpoint passes ``mid``/``final`` (for
    ``source``), query rows ``qa``/``qb``."""
    x, y, qx, qy, batches = problem()
    model = init_model()
    optimizer = optimizer_of(model.parameters())
    store = gradstore.open(path, storage_dtype="float32")
    with store.capture(model, RUN, optimizer=optimizer, projection=None) as cap:
        for t in range(4):
            cap.set_ids([str(int(i)) for i in batches[t]])
            (0.5 * ((model(x[batches[t]]) - y[batches[t]]) ** 2).sum(1)).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for checkpoint, step in (("mid", 2), ("final", 4)):
        with store.capture(model, RUN, checkpoint=checkpoint, learning_rate=0.05, projection=None) as cap:
            cap.set_step(step)
            cap.set_ids([str(i) for i in range(N)])
            (0.5 * ((model(x) - y) ** 2).sum(1)).mean().backward()
            cap.set_split("query")
            cap.set_ids(["qa", "qb"])
            (0.5 * ((model(qx) - qy) ** 2).sum(1)).mean().backward()
            model.zero_grad()
    return store


@pytest.mark.parametrize("kind", [torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.NAdam])
def test_steps_of_an_optimizer_the_dynamics_do_not_model_warn(tmp_path, kind):
    """dvemb and source over steps of RMSprop, Adagrad, NAdam take each as ``lr x gradient`` and say so, naming the
    optimizer (an SGD run, modelled, warns nothing)."""
    unmodelled = trained_with(tmp_path / "unmodelled", lambda params: kind(params, lr=0.05))
    sgd = trained_with(tmp_path / "sgd", lambda params: torch.optim.SGD(params, lr=0.05))
    for method in ("dvemb", "source"):
        with pytest.warns(gradstore.UnmodelledOptimizerWarning, match=f"trained with {kind.__name__}, whose update"):
            unmodelled.score_matrix(["qa", "qb"], run=RUN, method=method)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sgd.score_matrix(["qa", "qb"], run=RUN, method=method)


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adam])
def test_a_run_that_maximized_its_loss_is_refused_by_the_trajectory_methods(tmp_path, kind):
    """``maximize=True`` steps ascend the loss: the descent dynamics (and ``tracin-steps``' ``lr q . g``) would
    score with the wrong sign, so every trajectory method refuses the run, naming the setting."""
    store = trained_with(tmp_path / "store", lambda params: kind(params, lr=0.05, maximize=True))
    for method in ("tracin-steps", "dvemb", "source"):
        with pytest.raises(InvalidArgumentError, match=r"maximize=True \(4 recorded step\(s\), from step 0\)"):
            store.score_matrix(["qa", "qb"], run=RUN, method=method)
    assert store.attribute(["qa"], run=RUN, k=2, method="grad-dot", checkpoint="final", write=False).num_rows == 2


def in_loop(path, *, before_step=None, sizes=(B,), scale: float = 1.0) -> gradstore.GradStore:
    """A store of 4 SGD-momentum steps, each over micro-batches of ``sizes`` (each one's mean loss divided by their
    number, ``loss_scale`` told), the loss multiplied by ``scale``, ``before_step(model)`` between the backwards and
    the step; query rows at step 4."""
    x, y, _, _, batches = problem()
    model = init_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    store = gradstore.open(path, storage_dtype="float32")
    with store.capture(model, RUN, optimizer=optimizer, projection=None, loss_scale=1 / len(sizes)) as cap:
        for t in range(4):
            start = 0
            for size in sizes:
                part = batches[t][start : start + size]
                start += size
                cap.set_ids([str(int(i)) for i in part])
                (scale * 0.5 * ((model(x[part]) - y[part]) ** 2).sum(1)).mean().div(len(sizes)).backward()
            if before_step is not None:
                before_step(model)
            optimizer.step()
            optimizer.zero_grad()
    capture_queries(store, model, step=4)
    return store


def test_steps_the_dynamics_take_as_the_backwards_mean_warn_where_they_were_not(tmp_path):
    """Clipping that cut the norm (the step was not the backward's gradient), and micro-batches of unequal sizes
    each reduced by its own mean (examples weighed unevenly), are recorded by capture; dvemb and source say so
    (UnmodelledOptimizerWarning) instead of scoring such steps as if they were the rows' mean, silently. Equal
    micro-batches, and a run without either, warn nothing."""
    clipped = in_loop(tmp_path / "clip", before_step=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3))
    uneven = in_loop(tmp_path / "uneven", sizes=(1, 3))
    for store, message in ((clipped, "stepped on other gradients than the backward produced in 4 of its 4"),
                           (uneven, "weighted their rows unevenly in 4 of its 4 recorded steps")):  # fmt: skip
        with pytest.warns(gradstore.UnmodelledOptimizerWarning, match=message):
            store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")
    for store in (in_loop(tmp_path / "plain"), in_loop(tmp_path / "even", sizes=(2, 2))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")


def test_rows_of_a_grad_scaler_not_given_to_capture_are_warned(tmp_path):
    """A loop scaling its loss by a power of two and unscaling the gradients before the step (an AMP GradScaler
    not given to capture) leaves rows that carry the scale: capture says so and what to pass. A loop that does not
    rescale warns nothing."""

    def unscale(model):
        for p in model.parameters():
            p.grad.div_(1024.0)

    with pytest.warns(gradstore.UnscaledRowsWarning, match="grad_scaler=scaler"):
        in_loop(tmp_path / "scaled", before_step=unscale, scale=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        in_loop(tmp_path / "plain")


def test_scores_of_a_diverged_run_are_refused_not_ranked(tmp_path):
    """A run trained far beyond its stability bound (``lr lambda_max = 21``, weights ~1e32 after 26 steps) leaves
    rows whose products overflow float32: ``score_matrix`` and ``attribute`` raise ``NonFiniteScoresError`` saying
    so, and nothing is written to ``scores`` (they returned infinities and ranked NaN scores)."""
    x, y, qx, qy, _ = problem()
    design = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    rate = 21.0 / float(torch.linalg.eigvalsh(design.T @ design / N).max())
    model = init_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=rate)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    ids = [str(i) for i in range(N)]
    with store.capture(model, RUN, optimizer=optimizer, projection=None) as cap:
        for _ in range(26):
            cap.set_split(TRUE_FISHER_SPLIT)
            for output in range(OUT):
                cap.set_ids(ids)
                (math.sqrt(OUT) * model(x)[:, output]).mean().backward()
                optimizer.zero_grad()
            cap.set_split("train")
            cap.set_ids(ids)
            (0.5 * ((model(x) - y) ** 2).sum(1)).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    capture_queries(store, model, step=26)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableStepWarning)
        with pytest.raises(gradstore.NonFiniteScoresError, match="dvemb on run 'quad' gave .* NaN/Inf"):
            store.score_matrix(["qa", "qb"], run=RUN, method="dvemb")
        with pytest.raises(gradstore.NonFiniteScoresError, match="Nothing was written"):
            store.attribute(["qa", "qb"], run=RUN, method="dvemb", k=3)
    assert store.sql("select count(*) from scores").fetchall() == [(0,)]


def test_steps_without_rows_between_steps_with_rows_warn(tmp_path):
    """Rows of some steps missing at no regular stride (a capture paused there, or one that lost them: a
    torch.compile'd wrapper dropped whole steps) make dvemb stand each step with rows in for the steps up to the
    next: it says so. Every second step captured on purpose (a regular stride) warns nothing."""
    x, y, _, _, batches = problem()

    def run(path, paused: set[int]) -> gradstore.GradStore:
        model = init_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        store = gradstore.open(path, storage_dtype="float32")
        with store.capture(model, RUN, optimizer=optimizer, projection=None) as cap:
            for t in range(T):
                cap.set_ids([str(int(i)) for i in batches[t]])
                if t in paused:
                    cap.pause()
                (0.5 * ((model(x[batches[t]]) - y[batches[t]]) ** 2).sum(1)).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                cap.resume()
        capture_queries(store, model)
        return store

    with pytest.warns(gradstore.UnmodelledOptimizerWarning, match="1 recorded step.* without training rows.*step 2"):
        run(tmp_path / "lost", {2}).score_matrix(["qa", "qb"], run=RUN, method="dvemb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(tmp_path / "stride", {1, 3, 5, 7}).score_matrix(["qa", "qb"], run=RUN, method="dvemb")
