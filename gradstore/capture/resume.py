"""Resumable capture: a training job that crashed and resumed from its last checkpoint re-runs some steps;
``store.capture(..., resume=True)`` skips the rows of those steps that were already committed.

A row is identified by ``(run, checkpoint, step, split, example_id)``. On the first captured batch the keys
of the run's committed rows from that batch's step on are read once (only the re-run window, not the whole
run); every later batch drops the rows whose key is among them. Rows a crash lost before their commit are
not among them, so they are written again: the rows after a resume equal those of an uninterrupted run.
The resumed loop must record the same steps as the first run did (``cap.set_step(step_of_checkpoint)``
when the optimizer's step count restarts at zero).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from gradstore.core import StoreCore, gradient_filter
from ingest import CapturedBatch

Key = tuple[str, int, str, str]
"""``(checkpoint, step, split, example_id)`` of a row of one run."""


class CommittedRows:
    """The committed row keys of one run from some step on, loaded on first use."""

    def __init__(self, store: StoreCore, run: str) -> None:
        self.store = store
        self.run = run
        self.from_step: int | None = None
        self.keys: set[Key] = set()

    def _load(self, from_step: int) -> None:
        self.from_step = from_step
        if not self.store.has_run(self.run):
            return
        where = gradient_filter(self.run, None, None, (from_step, None), None)
        table = (
            self.store.gradient_table(self.run)
            .to_lance()
            .to_table(columns=["checkpoint", "step", "split", "example_id"], filter=where)
        )
        self.keys = set(
            zip(*(table.column(name).to_pylist() for name in ("checkpoint", "step", "split", "example_id")))
        )

    def new_rows(self, batch: CapturedBatch) -> CapturedBatch | None:
        """``batch`` without the rows already committed (``None`` if none is left)."""
        if self.from_step is None or batch.step < self.from_step:
            self._load(batch.step)
        keep = np.array(
            [
                (batch.checkpoint, batch.step, batch.split, example_id) not in self.keys
                for example_id in batch.example_ids
            ],
            dtype=bool,
        )
        if keep.all():
            return batch
        if not keep.any():
            return None
        return rows_of(batch, keep)


def rows_of(batch: CapturedBatch, keep: np.ndarray) -> CapturedBatch:
    """The rows of ``batch`` where ``keep`` is true (per-row fields subset, the rest as is)."""
    mask = torch.from_numpy(keep)
    positions = np.flatnonzero(keep).tolist()
    return dataclasses.replace(
        batch,
        grads=batch.grads[mask],
        example_ids=[batch.example_ids[i] for i in positions],
        example_hash=None if batch.example_hash is None else [batch.example_hash[i] for i in positions],
        loss=None if batch.loss is None else batch.loss[mask],
        num_tokens=batch.num_tokens[mask],
    )
