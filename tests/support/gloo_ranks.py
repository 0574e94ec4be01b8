"""Two gloo ranks on CPU training one small model (tests/integrations/test_distributed.py, test_fsdp1.py): the model,
the data, each rank's share of a global batch, a free port, and the single-process reference rows."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import torch
from torch import nn

import gradstore

WORLD = 2
N_EXAMPLES, GLOBAL_BATCH, STEPS = 16, 8, 4
OPTIONS = {"projection": "factorized", "k_in": 4, "k_out": 4, "seed": 3, "loss_reduction": "mean"}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def make_data() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_EXAMPLES, 6, generator=gen)
    y = torch.randn(N_EXAMPLES, 3, generator=gen)
    return x, y, [f"ex{i}" for i in range(N_EXAMPLES)]


def global_batch(step: int) -> slice:
    start = (step * GLOBAL_BATCH) % N_EXAMPLES
    return slice(start, start + GLOBAL_BATCH)


def train(model: nn.Module, cap, opt, rank: int, world: int, steps: int, *, on_backward=None) -> None:
    """The unchanged loop: each rank takes its contiguous share of the global batch, mean loss."""
    x, y, ids = make_data()
    for step in range(steps):
        if hasattr(cap, "set_epoch"):
            cap.set_epoch(step * GLOBAL_BATCH // N_EXAMPLES)
        sl = global_batch(step)
        share = GLOBAL_BATCH // world
        lo, hi = sl.start + rank * share, sl.start + (rank + 1) * share
        cap.set_ids(ids[lo:hi])
        loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        if on_backward is not None:
            on_backward(step)
        opt.step()
        opt.zero_grad()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_rows(tmp_path: Path) -> dict[tuple[str, int], np.ndarray]:
    store = gradstore.open(tmp_path / "reference", storage_dtype="float32")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with store.capture(model, "ref", optimizer=opt, **OPTIONS) as cap:
        train(model, cap, opt, 0, 1, STEPS)
    return rows_by_key(store, "ref")


def rows_by_key(store, run: str) -> dict[tuple[str, int], np.ndarray]:
    block = store.read_gradients(run, columns=("example_id", "step", "rank"))
    keys = list(zip(block.metadata.column("example_id").to_pylist(), block.metadata.column("step").to_pylist()))
    assert len(set(keys)) == len(keys), "a row is duplicated"
    return dict(zip(keys, block.vectors))
