"""Side-file writes and removals stopped between any two steps (as a SIGKILL would stop them; found by
tests/core/test_fault_injection.py): what is left checks out, is never half used, and the next build repairs it.

A kill is simulated by raising at the n-th low-level step of the operation, for every n.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import gradstore
from gradstore.core.sidefiles import SideFiles

#: Side-file writes and deletions of a FAISS index update (3 files and the manifest replaced, the 3 files of
#: the previous save deleted) and of the index's removal.
UPDATE_STEPS, REMOVAL_STEPS = 14, 6


class Killed(BaseException):
    """Stands for the SIGKILL: nothing after it runs."""


class Steps:
    """Counts the low-level steps of side-file writes and removals and raises ``Killed`` at step ``last``."""

    def __init__(self, last: int) -> None:
        self.last, self.taken = last, 0

    def take(self) -> None:
        """One more step (raises ``Killed`` instead of taking step ``last``)."""
        if self.taken == self.last:
            raise Killed
        self.taken += 1


class DyingFileSystem:
    """A filesystem whose deletions are steps."""

    def __init__(self, filesystem, steps: Steps) -> None:
        self.filesystem, self.steps = filesystem, steps

    def __getattr__(self, name: str):
        return getattr(self.filesystem, name)

    def delete_file(self, path: str) -> None:
        self.steps.take()
        self.filesystem.delete_file(path)

    def delete_dir(self, path: str) -> None:
        self.steps.take()
        self.filesystem.delete_dir(path)


def _die_at(monkeypatch, files: SideFiles, step: int) -> Steps:
    """From now on every file ``files`` writes whole and every deletion is a step; die at ``step``."""
    steps, put = Steps(step), SideFiles._put

    def dying_put(self, target: str, data: bytes) -> None:
        steps.take()
        put(self, target, data)

    monkeypatch.setattr(SideFiles, "_put", dying_put)
    monkeypatch.setattr(files, "filesystem", DyingFileSystem(files.filesystem, steps))
    return steps


@pytest.mark.parametrize("step", range(4))
def test_a_side_file_replaced_when_killed_reads_as_old_or_new(tmp_path, monkeypatch, step):
    files = SideFiles(str(tmp_path))
    files.write_bytes(b"old", "k", "file")
    _die_at(monkeypatch, files, step)
    with contextlib.suppress(Killed):
        files.write_bytes(b"new", "k", "file")
    monkeypatch.undo()
    assert files.read_bytes("k", "file") in (b"old", b"new")
    assert files.damaged() == ([], 1)
    files.write_bytes(b"newer", "k", "file")
    assert files.read_bytes("k", "file") == b"newer"


def _store_with_index(path) -> gradstore.GradStore:
    store = gradstore.open(path)
    store.create_run("r", dim=4)
    with store.writer("r") as writer:
        writer.append(
            np.random.default_rng(0).normal(size=(30, 4)), [f"e{i}" for i in range(30)], checkpoint="c", split="train"
        )
    store.build_index("r", checkpoint="c", kind="Flat", name="flat", method="grad-dot")
    with store.writer("r") as writer:  # rows the next build adds to the saved index in place
        writer.append(
            np.random.default_rng(1).normal(size=(10, 4)), [f"f{i}" for i in range(10)], checkpoint="c", split="train"
        )
    return store


def _check_index(path) -> None:
    store = gradstore.open(path)
    assert store.verify().ok, store.verify().problems
    index = store.build_index("r", checkpoint="c", kind="Flat", name="flat", method="grad-dot")
    block = store.read_gradients("r")
    assert sorted(index.indexed_ids) == sorted(block.grad_ids) and index.manifest["rows"] == 40
    queries = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    expected = block.grad_ids[np.argsort(-(queries @ block.vectors.T), axis=1)[:, :2]]
    np.testing.assert_array_equal(index.search(queries, 2)[1], expected)
    assert len([c for c in store.core.files.children("indexes", "flat") if c.startswith("faiss")]) == 1


@pytest.mark.parametrize("step", range(UPDATE_STEPS + 1))
def test_an_index_update_killed_at_any_step_leaves_an_index_that_works_or_rebuilds(store_path, monkeypatch, step):
    store = _store_with_index(store_path)
    steps = _die_at(monkeypatch, store.core.files, step)
    try:
        store.build_index(
            "r", checkpoint="c", kind="Flat", name="flat", method="grad-dot"
        )  # adds the 10 new rows and saves
    except Killed:
        pass
    else:  # the last step number lets the update finish: every step before was interrupted once
        assert step == UPDATE_STEPS, steps.taken
    monkeypatch.undo()
    _check_index(store_path)


@pytest.mark.parametrize("step", range(REMOVAL_STEPS + 1))
def test_an_index_removal_killed_at_any_step_leaves_nothing_damaged(store_path, monkeypatch, step):
    store = _store_with_index(store_path)
    steps = _die_at(monkeypatch, store.core.files, step)
    try:
        store.core.files.remove("indexes", "flat")
    except Killed:
        pass
    else:
        assert step == REMOVAL_STEPS, steps.taken
    monkeypatch.undo()
    _check_index(store_path)
