"""``bench/scale_rows.py`` end to end at a tiny size: both storage dtypes grown through two sizes (the second
resuming the first's generated block), scanned in process and on Ray, indexed (IVF) and reported, its store
deleted after. The figures themselves are the bench's (docs/benchmarks.md), not checked here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("faiss")
pytest.importorskip("psutil")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale_rows.py"


@pytest.mark.slow
def test_scale_rows_bench_runs_both_dtypes(tmp_path):
    command = [sys.executable, str(BENCH), "--rows", "4096", "--sizes", "2048,4096", "--dims", "64"]
    command += ["--dtype", "both", "--rounds", "1", "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    for dtype in ("float16", "int8"):
        assert f"{dtype}, 64 dims" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("2,048", "4,096"))]
    assert len(rows) == 4 and all(row[-1] == "True" for row in rows)  # in-process and Ray found the same ids
    assert out.count("recall@10 two-stage") == 4  # the index at every size, both dtypes
    assert "peak RSS, exact scans" in out and "ray::" in out
    assert out.strip().splitlines()[-1].startswith("RESULT scale_rows_cost_flatness=")
    assert not list(tmp_path.glob("gradstore-scale-rows-*"))  # the stores are deleted
