"""A linear regression with squared loss trained by SGD under capture (tests/methods/test_trajectory.py, the
trajectory store of tests/serve/test_serve_security.py): quadratic in its weights, so trajectory-aware methods
have closed forms. The schedule (data, batches, learning rates) is fixed by ``problem()``."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import gradstore
from gradstore.methods import TRUE_FISHER_SPLIT

N, D, B, T = 10, 3, 4, 9
RUN = "quad"


def problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=generator, dtype=torch.float64)
    y = torch.randn(N, generator=generator, dtype=torch.float64)
    qx = torch.randn(2, D, generator=generator, dtype=torch.float64)
    qy = torch.randn(2, generator=generator, dtype=torch.float64)
    batches = [torch.randperm(N, generator=generator)[:B] for _ in range(T)]
    rates = [0.3 - 0.02 * t for t in range(T)]
    return x, y, qx, qy, batches, rates


def model_at(weight: torch.Tensor) -> nn.Linear:
    model = nn.Linear(D, 1).double()
    with torch.no_grad():
        model.weight.copy_(weight[:D].reshape(1, D))
        model.bias.copy_(weight[D:])
    return model


INIT = torch.tensor([0.1, -0.2, 0.05, 0.3], dtype=torch.float64)


def train_captured(store: gradstore.GradStore, steps: range, model: nn.Linear, true_fisher: bool = True) -> None:
    """SGD over ``steps`` of the schedule inside one capture: per step, true-Fisher rows (the output's
    gradient) then the training rows, then the optimizer step."""
    x, y, _, _, batches, rates = problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=rates[0])
    with store.capture(model, RUN, optimizer=optimizer, projection=None) as cap:
        cap.set_step(steps.start)
        for t in steps:
            for group in optimizer.param_groups:
                group["lr"] = rates[t]
            ids = [str(int(i)) for i in batches[t]]
            if true_fisher:
                cap.set_split(TRUE_FISHER_SPLIT)
                cap.set_ids(ids)
                model(x[batches[t]]).squeeze(-1).mean().backward()
                optimizer.zero_grad()
            cap.set_split("train")
            cap.set_ids(ids)
            loss = 0.5 * ((model(x[batches[t]]).squeeze(-1) - y[batches[t]]) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def capture_queries(store: gradstore.GradStore, model: nn.Linear, checkpoint: str, step: int) -> None:
    _, _, qx, qy, _, _ = problem()
    with store.capture(model, RUN, checkpoint=checkpoint, projection=None) as cap:
        cap.set_step(step)
        cap.set_split("query")
        cap.set_ids(["qa", "qb"])
        (0.5 * ((model(qx).squeeze(-1) - qy) ** 2).mean()).backward()
        model.zero_grad()


def trained_store(path) -> None:
    """A float32 store at ``path`` holding the whole schedule's training (and true-Fisher) rows from ``INIT`` and
    the two queries at checkpoint ``"final"`` (step ``T``)."""
    store = gradstore.open(path, storage_dtype="float32")
    model = model_at(INIT)
    train_captured(store, range(T), model)
    capture_queries(store, model, "final", T)
    store.core.record_checkpoint(RUN, "final", step=T)


def true_effects(steps: int = T) -> tuple[np.ndarray, np.ndarray]:
    """``-d L_q(theta_T) / d w_z`` through ``steps`` SGD steps (float64 autograd), and the tracin-steps reference
    ``sum_t lr_t / B q_T . g_{z,t}`` from the per-step per-example gradients along the same trajectory."""
    x, y, qx, qy, batches, rates = problem()
    weights = torch.ones(N, dtype=torch.float64, requires_grad=True)
    theta = INIT.clone().requires_grad_()
    xt = torch.cat([x, torch.ones(N, 1, dtype=torch.float64)], 1)
    qt = torch.cat([qx, torch.ones(2, 1, dtype=torch.float64)], 1)
    trajectory = []
    for t in range(steps):
        trajectory.append(theta.detach().clone())
        batch = batches[t]
        residual = xt[batch] @ theta - y[batch]
        loss = (weights[batch] * 0.5 * residual**2).mean()
        (grad,) = torch.autograd.grad(loss, theta, create_graph=True)
        theta = theta - rates[t] * grad
    effects = []
    final = theta.detach()
    query_grads = (qt @ final - qy)[:, None] * qt  # per-query loss gradients at the final weights
    for query in range(2):
        loss = 0.5 * (qt[query] @ theta - qy[query]) ** 2
        (grad_w,) = torch.autograd.grad(loss, weights, retain_graph=True)
        effects.append(-grad_w.numpy())
    tracin = np.zeros((2, N))
    for t, point in enumerate(trajectory):
        for i in batches[t].tolist():
            g = (xt[i] @ point - y[i]) * xt[i]
            tracin[:, i] += rates[t] / B * (query_grads @ g).numpy()
    return np.stack(effects), tracin


def columns(matrix: gradstore.ScoreMatrix) -> np.ndarray:
    """The matrix's scores with columns in example-id order 0..N-1 (examples never drawn score 0)."""
    out = np.zeros((len(matrix.query_ids), N))
    for column, example in enumerate(matrix.example_ids):
        out[:, int(example)] = matrix.scores[:, column]
    return out


def passes_store(
    path, true_fisher: bool = True, passes: tuple[tuple[str, int], ...] = (("mid", 4), ("final", T))
) -> gradstore.GradStore:
    """In-loop rows of the whole schedule, then checkpoint passes (training and query rows, a step and learning
    rate each) at ``passes`` ``(checkpoint, step)`` of the same model (by default steps 4 and ``T``: SOURCE's
    segments; the final one for self-influence)."""
    store = gradstore.open(path, storage_dtype="float32")
    model = model_at(INIT)
    train_captured(store, range(T), model, true_fisher=true_fisher)
    x, y, qx, qy, _, _ = problem()
    for name, step in passes:
        with store.capture(model, RUN, checkpoint=name, learning_rate=0.1, projection=None) as cap:
            cap.set_step(step)
            cap.set_ids([str(i) for i in range(N)])
            (0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()).backward()
            cap.set_split("query")
            cap.set_ids(["qa", "qb"])
            (0.5 * ((model(qx).squeeze(-1) - qy) ** 2).mean()).backward()
            model.zero_grad()
    return store
