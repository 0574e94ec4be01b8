"""``gradstore verify`` finds damaged tables and side files; reads of a damaged store raise StoreCorruptError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import gradstore
from gradstore.cli import app
from gradstore.core.sidefiles import ROOT

runner = CliRunner()


def _store(path: Path) -> gradstore.GradStore:
    store = gradstore.open(path)
    store.create_run("r", dim=4)
    rng = np.random.default_rng(0)
    for part in range(3):  # several fragments
        with store.writer("r") as writer:
            writer.append(
                rng.normal(size=(5, 4)), [f"e{part}-{i}" for i in range(5)], checkpoint="train", split="train"
            )
    with store.writer("r") as writer:
        writer.append(rng.normal(size=(2, 4)), ["q0", "q1"], checkpoint="train", split="query")
    store.build_index("r", kind="Flat", name="flat", method="grad-dot")
    return store


def test_a_healthy_store_verifies(store_path):
    store = _store(store_path)
    report = store.verify()
    assert report.ok, report.problems
    assert report.tables["gradients"] == 17 and report.tables["runs"] == 1
    assert report.side_files_checked >= 3  # index manifest, FAISS index, its ids, the fit
    result = runner.invoke(app, ["verify", str(store_path)])
    assert result.exit_code == 0 and result.output.strip().endswith("ok")


def test_a_deleted_data_file_is_reported_and_reads_raise_store_corrupt(store_path):
    _store(store_path)
    data_file = sorted((store_path / "gradients.lance" / "data").iterdir())[0]
    data_file.unlink()
    report = gradstore.open(store_path).verify()
    assert not report.ok and any(p.startswith("table gradients: cannot be read") for p in report.problems)
    fresh = gradstore.open(store_path)
    with pytest.raises(gradstore.StoreCorruptError, match=data_file.name):
        fresh.read_gradients("r")
    with pytest.raises(gradstore.StoreCorruptError):
        fresh.attribute(run="r", k=2, method="fisher")
    result = runner.invoke(app, ["verify", str(store_path)])
    assert result.exit_code == 1 and "DAMAGED: table gradients" in result.output


def test_a_damaged_side_file_is_reported_and_never_used(store_path):
    _store(store_path)
    (faiss_dir,) = (store_path / ROOT / "indexes" / "flat").glob("faiss*")  # the FAISS files of the last save
    target = next(p for p in sorted(faiss_dir.iterdir()) if p.suffix != ".sha256" and p.stat().st_size > 64)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    report = gradstore.open(store_path).verify()
    assert [p for p in report.problems if "damaged" in p] == [
        f"side file {target.as_posix()} is damaged (checksum mismatch)"
    ]
    with pytest.raises(gradstore.StoreCorruptError, match=target.name):
        gradstore.open(store_path).index("flat")
    manifest = store_path / ROOT / "indexes" / "flat" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"rows": 15', '"rows": 14'))
    with pytest.raises(gradstore.StoreCorruptError, match="manifest.json"):
        gradstore.open(store_path).index("flat")
