"""Scan files and read snapshots: the small metadata reads of a call (runs, checkpoints, a selection's ids and
example ids) served to a new process from local Arrow files, never stale or damaged; one version per table for a
whole call."""

from __future__ import annotations

import contextvars
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import lance
import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import gradstore
from gradstore.core import schema as S
from gradstore.core.row_cache import SCAN_FILE_SUFFIX, SCANS_DIRECTORY
from ingest.projection import LayerSlot, ProjectionSpec

DIM = 12
K = 4


def _open(path, cache) -> gradstore.GradStore:
    return gradstore.open(path, row_files=cache)


def _write(store: gradstore.GradStore, rows: int, seed: int, run: str = "r") -> None:
    if not store.core.has_run(run):
        spec = ProjectionSpec(0, "none", (LayerSlot("w", "linear", 3, 4, None, None, "exact", 0, DIM, False),))
        store.create_run(run, dim=DIM, projection=spec.to_dict())
        store.record_checkpoint(run, "c", step=1)
    vectors = np.random.default_rng(seed).standard_normal((rows, DIM)).astype(np.float32)
    with store.writer(run) as writer:
        writer.append(vectors, [f"{run}-{seed}-{i}" for i in range(rows)], checkpoint="c", split="train")


def _queries() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((3, DIM)).astype(np.float32)


def _attribute(store: gradstore.GradStore) -> pa.Table:
    return store.attribute(_queries(), run="r", k=K, write=False, method="grad-dot").select(
        ["query_id", "example_id", "grad_id", "score"]
    )


def _reference(store: gradstore.GradStore) -> list[str]:
    """Top-k example ids by brute force over the stored rows (decoded)."""
    block = store.read_gradients("r", checkpoint="c", split="train", columns=("example_id",))
    order = np.argsort(-(_queries() @ block.vectors.T), axis=1, kind="stable")[:, :K]
    example_ids = block.metadata.column("example_id").to_pylist()
    return [example_ids[i] for i in order.reshape(-1)]


def _scan_files(cache) -> list:
    directory = cache / SCANS_DIRECTORY
    return sorted(directory.glob(f"*{SCAN_FILE_SUFFIX}")) if directory.exists() else []


@pytest.fixture
def counted_lance_reads(monkeypatch):
    """Count ``LanceDataset.to_table`` calls (every scan of a metadata table or of a selection's ids)."""
    calls: list[dict] = []
    original = lance.LanceDataset.to_table

    def counting(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(lance.LanceDataset, "to_table", counting)
    return calls


def test_a_new_process_reads_its_metadata_from_scan_files(tmp_path, counted_lance_reads) -> None:
    cache = tmp_path / "cache"
    first = _open(tmp_path / "s", cache)
    _write(first, 120, seed=0)
    expected = _attribute(first)
    assert expected.column("example_id").to_pylist() == _reference(first)
    files = _scan_files(cache)
    assert len(files) >= 4  # runs, checkpoints, the selection's ids, its example ids
    counted_lance_reads.clear()
    again = _open(tmp_path / "s", cache)  # a new process: empty row cache
    assert _attribute(again).equals(expected)
    assert counted_lance_reads == []  # every scan from its file, the rows from the row cache's file or a block read
    assert _scan_files(cache) == files


def test_without_a_cache_directory_nothing_is_kept(tmp_path) -> None:
    store = _open(tmp_path / "s", False)
    _write(store, 50, seed=0)
    assert _attribute(store).column("example_id").to_pylist() == _reference(store)
    assert store.core.scan_files.directory is None and not (tmp_path / "cache").exists()


def test_appended_rows_and_new_checkpoints_are_seen_by_the_next_process(tmp_path) -> None:
    cache = tmp_path / "cache"
    first = _open(tmp_path / "s", cache)
    _write(first, 60, seed=0)
    _attribute(first)
    before = len(_scan_files(cache))
    _write(first, 80, seed=1)  # other rows: the ids and example ids are scanned again
    first.record_checkpoint("r", "c", step=2)  # another checkpoints version
    again = _open(tmp_path / "s", cache)
    assert again.count() == 140
    assert _attribute(again).column("example_id").to_pylist() == _reference(again)
    assert again.checkpoints("r").column("step").to_pylist() == [2]
    assert len(_scan_files(cache)) == before  # the stale files of the same scans were removed


def test_a_store_made_again_at_the_same_path_is_not_served_old_scans(tmp_path) -> None:
    cache = tmp_path / "cache"
    first = _open(tmp_path / "s", cache)
    _write(first, 40, seed=0)
    _attribute(first)
    shutil.rmtree(tmp_path / "s")
    remade = _open(tmp_path / "s", cache)
    _write(remade, 40, seed=3)  # same table versions, other rows and example ids
    assert _attribute(remade).column("example_id").to_pylist() == _reference(remade)


@pytest.mark.parametrize("damage", ["truncated", "other columns", "bad offsets"])
def test_a_damaged_scan_file_is_removed_and_read_from_the_store(tmp_path, caplog, damage) -> None:
    cache = tmp_path / "cache"
    first = _open(tmp_path / "s", cache)
    _write(first, 50, seed=0)
    expected = _attribute(first)
    for path in _scan_files(cache):
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif damage == "other columns":
            _write_arrow(path, pa.table({"grad_id": pa.array(["not", "ids"])}))
        else:  # a string column whose offsets point past its data
            _write_arrow(path, pa.table({"example_id": ["abc", "def"]}))
            offsets = np.array([0, 3, 6], np.int32).tobytes()
            damaged = np.array([0, 3, 1 << 30], np.int32).tobytes()
            assert path.read_bytes().count(offsets) == 1
            path.write_bytes(path.read_bytes().replace(offsets, damaged))
    again = _open(tmp_path / "s", cache)
    assert _attribute(again).equals(expected)
    assert "scan file" in caplog.text and "unusable" in caplog.text


def _write_arrow(path, table: pa.Table) -> None:
    with ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


def test_a_snapshot_sees_each_table_at_its_first_read(tmp_path) -> None:
    store = _open(tmp_path / "s", tmp_path / "cache")
    _write(store, 30, seed=0)
    other = _open(tmp_path / "s", tmp_path / "cache")  # another writer of the same store
    with store.core.snapshot():
        version = store.core.gradient_dataset("r").version
        assert store.count() == 30
        _write(other, 10, seed=1)
        assert store.core.gradient_dataset("r").version == version
        assert len(store.read_gradients("r").grad_ids) == 30  # reads inside the block: the version first seen
        with store.core.snapshot():  # nested: the same view
            assert store.core.gradient_dataset("r").version == version
    assert store.core.gradient_dataset("r").version > version
    assert len(store.read_gradients("r").grad_ids) == 40


def test_repeated_calls_open_each_table_once_until_another_writer_commits(tmp_path, monkeypatch) -> None:
    """A call on an unchanged store reuses the datasets the last one opened (a store call's fixed cost); a commit
    by another handle is seen by the next call, as a new dataset."""
    store = _open(tmp_path / "s", tmp_path / "cache")
    _write(store, 30, seed=0)
    expected = _attribute(store)
    opened: list[str] = []
    original = lancedb.table.LanceTable.to_lance
    monkeypatch.setattr(lancedb.table.LanceTable, "to_lance", lambda t: opened.append(t.name) or original(t))
    for _ in range(3):
        assert _attribute(store).equals(expected)
    assert opened == []
    _write(_open(tmp_path / "s", tmp_path / "cache"), 10, seed=1)  # another writer of the same store
    assert _attribute(store).column("example_id").to_pylist() == _reference(store)
    assert store.count() == 40 and opened and set(opened) <= set(store.core.tables.stored_names())


def test_a_snapshot_is_shared_with_threads_run_in_its_context(tmp_path) -> None:
    store = _open(tmp_path / "s", tmp_path / "cache")
    _write(store, 20, seed=0)
    with store.core.snapshot(), ThreadPoolExecutor(1) as pool:
        pinned = store.core.dataset(S.GRADIENTS)
        _write(_open(tmp_path / "s", tmp_path / "cache"), 5, seed=1)
        seen = pool.submit(contextvars.copy_context().run, store.core.dataset, S.GRADIENTS).result()
        outside = pool.submit(store.core.dataset, S.GRADIENTS).result()  # a thread outside the block's context
    assert seen is pinned
    assert outside.version > pinned.version


def test_a_scan_file_that_cannot_be_written_costs_nothing_but_the_file(tmp_path, disk_full, caplog) -> None:
    import gradstore.core.row_cache as row_cache

    disk_full(row_cache.ipc, "new_file")
    cache = tmp_path / "cache"
    store = _open(tmp_path / "s", cache)
    _write(store, 30, seed=0)
    assert _attribute(store).column("example_id").to_pylist() == _reference(store)
    assert "not written" in caplog.text
    assert list((cache / SCANS_DIRECTORY).iterdir()) == []  # no file, no temporary left


def test_scan_files_beyond_the_file_budget_go_least_recently_used_first(tmp_path) -> None:
    cache = tmp_path / "cache"
    store = _open(tmp_path / "s", cache)
    _write(store, 10, seed=0)
    store.core.scan_files.clear()
    store.core.scan_files.budget_files = 3
    wheres = [f"run_id = 'r' AND dim > {bound}" for bound in range(5)]  # five distinct scans of the runs table
    for age, where in enumerate(wheres):
        assert store.core.scan(S.RUNS, ["run_id"], where).column(0).to_pylist() == ["r"]
        os.utime(_scan_path(store, where), (1000 + age, 1000 + age))  # used in this order, whatever the clock says
    assert store.core.scan_files.usage()[0] == 3
    again = _open(tmp_path / "s", cache)  # a new process: only the three latest scans come from files
    again.core.scan_files.budget_files = 3
    kept = {
        where for where in wheres if again.core.scan_files._load(_scan_path(again, where), _runs_schema()) is not None
    }
    assert kept == set(wheres[2:])


def _scan_path(store: gradstore.GradStore, where: str):
    from gradstore.core.row_cache import cache_file_name, dataset_content

    identity = {
        "store": store.core.location,
        "table": S.RUNS,
        "columns": ["run_id"],
        "where": where,
        "row_address": False,
    }
    return (
        store.core.scan_files.directory
        / f"{cache_file_name(identity, dataset_content(store.core.dataset(S.RUNS)))}{SCAN_FILE_SUFFIX}"
    )


def _runs_schema() -> pa.Schema:
    return pa.schema([pa.field("run_id", pa.string())])
