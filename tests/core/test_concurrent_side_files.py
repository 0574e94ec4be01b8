"""Processes that fit and index the same rows at once: each saves the same fit and index (a local store's
writers' lock makes them take turns, readers wait for a save to finish); every process gets the right top-k and
the store's side files check out afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gradstore
from ingest.projection import LayerSlot, ProjectionSpec

JOB = Path(__file__).parents[1] / "jobs" / "attribute_job.py"  # run as a separate process

DIM, PROCESSES = 40, 4


def _store(path: Path) -> gradstore.GradStore:
    store = gradstore.open(path, row_files=False)
    spec = ProjectionSpec(0, "none", (LayerSlot("w", "linear", 8, 5, None, None, "exact", 0, DIM, False),))
    store.create_run("r", dim=DIM, projection=spec.to_dict())
    vectors = np.random.default_rng(0).standard_normal((300, DIM)).astype(np.float32)
    with store.writer("r") as writer:
        writer.append(vectors, [f"e{i}" for i in range(300)], checkpoint="c", split="train")
    return store


@pytest.mark.parametrize(("method", "kind"), [("fisher", "exact"), ("grad-dot", "Flat")])
def test_processes_fitting_and_indexing_at_once_all_succeed(tmp_path, method, kind) -> None:
    store = _store(tmp_path / "s")
    job = [sys.executable, str(JOB), str(tmp_path / "s"), method, kind]
    processes = [
        subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(PROCESSES)
    ]
    results = [process.communicate(timeout=600) for process in processes]
    failures = [error[-2000:] for process, (_, error) in zip(processes, results) if process.returncode]
    assert not failures, failures
    expected = (
        store.attribute(
            np.random.default_rng(99).standard_normal((4, DIM)).astype(np.float32),
            run="r",
            k=6,
            method=method,
            kind=kind,
            write=False,
        )
        .column("grad_id")
        .to_pylist()
    )
    assert all(json.loads(output) == expected for output, _ in results)
    report = store.verify()
    assert report.ok, report
