"""Toy data, model and checkpoint passes shared by the examples (not an example itself).

The task: points in ``DIM`` dimensions from three *sources* (``news``, ``code``, ``math``), each source with
its own input region and its own class prototypes (a Gaussian mixture over ``CLASSES`` classes); a fraction
of the training labels can be flipped on purpose (``mislabeled`` column) so that audits have something to
find. The model is a two-layer MLP in plain PyTorch. Everything is generated in code from a seed; nothing is downloaded.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.nn import functional as F

import gradstore

DIM = 12
CLASSES = 4
SOURCES = ("news", "code", "math")


@dataclass
class ToyData:
    """One split of the toy task: inputs, labels and the metadata stored in ``examples``."""

    ids: list[str]
    x: torch.Tensor  # float32 [n, DIM]
    y: torch.Tensor  # int64 [n]
    source: list[str]
    mislabeled: list[bool]

    def __len__(self) -> int:
        return len(self.ids)

    def frame(self) -> pd.DataFrame:
        """The examples as a DataFrame (for ``store.add_examples``): id, text, label, source, mislabeled."""
        return pd.DataFrame(
            {
                "example_id": self.ids,
                "text": [f"{s} item {i} -> class {int(y)}" for i, s, y in zip(self.ids, self.source, self.y)],
                "label": self.y.tolist(),
                "source": self.source,
                "mislabeled": self.mislabeled,
            }
        )

    def batches(self, size: int, generator: torch.Generator | None = None) -> Iterator[tuple[list[str], dict]]:
        """``(ids, {"x": ..., "y": ...})`` mini-batches, shuffled when a generator is given."""
        order = torch.randperm(len(self), generator=generator) if generator is not None else torch.arange(len(self))
        for start in range(0, len(self), size):
            rows = order[start : start + size]
            yield [self.ids[i] for i in rows.tolist()], {"x": self.x[rows], "y": self.y[rows]}


def make_data(n_train: int, n_query: int, *, mislabel: float = 0.0, seed: int = 0) -> tuple[ToyData, ToyData]:
    """Training and query splits of the toy task; ``mislabel`` is the share of training labels flipped."""
    generator = torch.Generator().manual_seed(seed)
    centers = 4.0 * torch.randn(len(SOURCES), DIM, generator=generator)  # where each source's inputs lie
    prototypes = 1.5 * torch.randn(len(SOURCES), CLASSES, DIM, generator=generator)  # class offsets per source

    def sample(n: int, prefix: str, flip: float) -> ToyData:
        which = torch.randint(0, len(SOURCES), (n,), generator=generator)
        y = torch.randint(0, CLASSES, (n,), generator=generator)
        x = centers[which] + prototypes[which, y] + torch.randn(n, DIM, generator=generator)
        flipped = torch.rand(n, generator=generator) < flip
        shift = torch.randint(1, CLASSES, (n,), generator=generator)
        y = torch.where(flipped, (y + shift) % CLASSES, y)
        return ToyData(
            [f"{prefix}-{i:04d}" for i in range(n)], x, y, [SOURCES[s] for s in which.tolist()], flipped.tolist()
        )

    return sample(n_train, "train", mislabel), sample(n_query, "query", 0.0)


def make_model(seed: int = 0, hidden: int = 32) -> nn.Module:
    """A two-layer MLP classifier (plain PyTorch)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES))


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of a batch (the capture default ``loss_reduction="mean"`` undoes the mean)."""
    return F.cross_entropy(model(batch["x"]), batch["y"])


def accuracy(model: nn.Module, data: ToyData) -> float:
    """Share of ``data`` the model classifies as labelled."""
    with torch.no_grad():
        return float((model(data.x).argmax(dim=1) == data.y).float().mean())


def capture_pass(
    store: gradstore.GradStore,
    run: str,
    model: nn.Module,
    train: ToyData,
    queries: ToyData,
    *,
    checkpoint: str,
    learning_rate: float,
    step: int,
    batch_size: int = 64,
    **options,
) -> None:
    """A checkpoint pass: per-example gradients of every training and query example at the current weights.

    Nothing is updated: the loop runs forward + backward only, inside ``store.capture`` with the checkpoint's
    name and learning rate (recorded in ``checkpoints``, used by TracIn and selection to weight checkpoints).
    ``options`` are capture options (``projection``, ``k_in``, ``k_out``...), needed on the first pass only.
    """
    with store.capture(model, run, checkpoint=checkpoint, learning_rate=learning_rate, **options) as cap:
        cap.set_step(step)
        for split, data in (("train", train), ("query", queries)):
            cap.set_split(split)
            for ids, batch in data.batches(batch_size):
                cap.set_ids(ids)
                loss_fn(model, batch).backward()
                model.zero_grad()


def train_with_passes(
    store: gradstore.GradStore,
    run: str,
    train: ToyData,
    queries: ToyData,
    *,
    epochs: int,
    pass_every: int,
    learning_rate: float = 0.05,
    batch_size: int = 32,
    seed: int = 0,
    **options,
) -> nn.Module:
    """Train the MLP with plain SGD and a linearly decaying learning rate (no capture during training); after
    every ``pass_every`` epochs (and after the last) run a :func:`capture_pass` named ``epoch-<n>`` whose
    learning rate is the one the optimizer applies next."""
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 - epoch / (epochs + 1))
    generator = torch.Generator().manual_seed(seed)
    step = 0
    for epoch in range(1, epochs + 1):
        for _, batch in train.batches(batch_size, generator):
            loss_fn(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        schedule.step()
        if epoch % pass_every == 0 or epoch == epochs:
            capture_pass(
                store,
                run,
                model,
                train,
                queries,
                checkpoint=f"epoch-{epoch}",
                learning_rate=optimizer.param_groups[0]["lr"],
                step=step,
                **options,
            )
    return model


def run_example(doc: str, main: Callable[..., None], quick: dict[str, Any], full: dict[str, Any]) -> None:
    """Command line of every example: ``--store DIR`` (new or empty) and ``--quick`` (small sizes, for tests)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--store", required=True, help="new or empty store directory")
    parser.add_argument("--quick", action="store_true", help="smaller data and fewer epochs (for tests)")
    args = parser.parse_args()
    main(args.store, **(quick if args.quick else full))
