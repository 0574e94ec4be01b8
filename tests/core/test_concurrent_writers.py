"""Many writers and compaction at once: every acknowledged row is committed exactly once."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

import gradstore
from gradstore.core import commits

WRITERS, APPENDS, ROWS = 4, 40, 8


def _write(path: str, tag: int, acknowledged) -> None:
    """Append ``APPENDS`` batches, flushing every second one; report each batch once it is acknowledged."""
    store = gradstore.open(path)
    pending = []
    with store.writer("r", commit_rows=2 * ROWS, max_fragments=6) as writer:
        for i in range(APPENDS):
            rows = np.full((ROWS, 4), tag * 1000 + i, np.float32)
            writer.append(rows, [f"{tag}-{i}-{j}" for j in range(ROWS)], step=i)
            pending.append(i)
            if i % 2 == 1:
                writer.flush()
                for batch in pending:
                    acknowledged.put((tag, batch))
                pending = []


def test_four_writer_processes_and_compaction_commit_every_acknowledged_row_once(store_path):
    store = gradstore.open(store_path, storage_dtype="float32")
    store.create_run("r", dim=4)
    ctx = mp.get_context("spawn")
    acknowledged = ctx.Queue()
    procs = [ctx.Process(target=_write, args=(str(store_path), k, acknowledged)) for k in range(WRITERS)]
    for p in procs:
        p.start()
    compactions = 0
    while any(p.is_alive() for p in procs):
        store.compact()  # rewrites fragments while the writers commit
        compactions += 1
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    store.compact()
    expected = set()
    while not acknowledged.empty():
        tag, batch = acknowledged.get()
        expected.update(f"{tag}-{batch}-{j}" for j in range(ROWS))
    assert len(expected) == WRITERS * APPENDS * ROWS
    block = store.read_gradients("r", columns=("example_id", "step"))
    ids = block.metadata.column("example_id").to_pylist()
    assert len(ids) == len(set(ids)) and set(ids) == expected
    assert len(set(block.grad_ids.tolist())) == len(ids)
    tags = np.array([int(i.split("-")[0]) for i in ids])
    np.testing.assert_array_equal(block.vectors[:, 0], tags * 1000 + block.metadata.column("step").to_numpy())
    assert compactions >= 1


def test_retrying_reruns_only_retryable_conflicts():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError(
                "Retryable commit conflict for version 7: This Append transaction was preempted by "
                "concurrent transaction Rewrite at version 7. Please retry."
            )
        return "done"

    assert commits.retrying(flaky, "test") == "done" and len(calls) == 3

    def broken():
        calls.append(1)
        raise OSError("disk full")

    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        commits.retrying(broken, "test")
    assert len(calls) == 1


def test_a_transaction_lance_gave_up_rebasing_is_retried():
    # what a writer saw once in the soak: Lance's own rebase retries exhausted by other writers' commits
    exhausted = OSError(
        "Commit conflict for version 725: Failed to commit the transaction after 20 retries., "
        "rust/lance/src/io/commit.rs:2083:9"
    )
    assert commits.is_retryable(exhausted)
    assert not commits.is_retryable(OSError("Commit conflict for version 7: incompatible schema change"))
