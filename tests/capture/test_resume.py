"""Resumable capture: a job killed with SIGKILL and resumed from its last checkpoint with resume=True ends
with exactly the rows of an uninterrupted run; without it the re-run steps are duplicated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from store_workload import job_environment

import gradstore

JOB = Path(__file__).parents[1] / "jobs" / "resume_job.py"


def _job(store: Path, workdir: Path, mode: str) -> int:
    return subprocess.run(
        [sys.executable, str(JOB), str(store), str(workdir), mode],
        env=job_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    ).returncode


def _rows(store_path: Path) -> tuple[list[tuple], np.ndarray]:
    block = gradstore.open(store_path, create=False).read_gradients("run", columns=("checkpoint", "step", "example_id"))
    keys = list(zip(*(block.metadata.column(c).to_pylist() for c in ("checkpoint", "step", "example_id"))))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return [keys[i] for i in order], block.vectors[order]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    assert _job(workdir / "store", workdir, "full") == 0
    return _rows(workdir / "store")


@pytest.mark.parametrize("resume", [True, False])
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, uninterrupted, resume):
    assert _job(tmp_path / "store", tmp_path, "crash-after-4") == -9  # SIGKILL after step 4's rows committed
    crashed, _ = _rows(tmp_path / "store")
    assert {step for _, step, _ in crashed} == {0, 1, 2, 3, 4}
    assert _job(tmp_path / "store", tmp_path, "resume" if resume else "rerun") == 0  # from step 3's checkpoint
    keys, vectors = _rows(tmp_path / "store")
    if resume:
        assert keys == uninterrupted[0]
        np.testing.assert_array_equal(vectors, uninterrupted[1])
    else:  # what resume=True prevents: steps 3 and 4 twice
        assert len(keys) == len(uninterrupted[0]) + 2 * 4
