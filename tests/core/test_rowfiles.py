"""Row files: the rows one process prepared for exact search, mapped by the next one instead of read from Lance.

A store opened again (as a new process opens it) searches the file and returns what a search of the stored rows
returns; rows appended, a store made again at the same path, a damaged file, a file of other rows under the name
or a hostile pickle are never served (the rows are read from Lance and the bad file removed)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import gradstore
import gradstore.search.index
from gradstore.core.row_cache import ROW_FILE_SUFFIX, RowFiles
from indexers import ExactIndex
from indexers.saved_rows import SavedRowsError, rows_from_state, rows_state
from indexers.screening import ScreenedBlock
from ingest.projection import LayerSlot, ProjectionSpec

JOB = Path(__file__).parents[1] / "jobs" / "rowfile_job.py"  # run as a separate process

DIM = 40
K = 6


def _open(path, cache, **kwargs) -> gradstore.GradStore:
    store = gradstore.open(path, row_files=cache, **kwargs)
    store.core.row_files.min_bytes = 0  # the test's rows are small
    return store


def _write(store: gradstore.GradStore, rows: int, seed: int, run: str = "r") -> None:
    if not store.core.has_run(run):
        spec = ProjectionSpec(0, "none", (LayerSlot("w", "linear", 8, 5, None, None, "exact", 0, DIM, False),))
        store.create_run(run, dim=DIM, projection=spec.to_dict())
    vectors = np.random.default_rng(seed).standard_normal((rows, DIM)).astype(np.float32)
    with store.writer(run) as writer:
        writer.append(vectors, [f"{run}-{seed}-{i}" for i in range(rows)], checkpoint="c", split="train")


def _queries() -> np.ndarray:
    return np.random.default_rng(99).standard_normal((4, DIM)).astype(np.float32)


def _attribute(store: gradstore.GradStore, run: str = "r") -> tuple[np.ndarray, np.ndarray]:
    table = store.attribute(_queries(), run=run, k=K, write=False, method="grad-dot")
    shape = (len(_queries()), K)
    return table.column("grad_id").to_numpy().reshape(shape), table.column("score").to_numpy().reshape(shape)


def _reference(store: gradstore.GradStore, run: str = "r") -> np.ndarray:
    """Top-k grad_ids by brute force over the rows as the store decodes them."""
    block = store.read_gradients(run, checkpoint="c", split="train", columns=())
    scores = _queries().astype(np.float64) @ block.vectors.astype(np.float64).T
    return block.grad_ids[np.argsort(-scores, axis=1, kind="stable")[:, :K]]


def _files(cache) -> list:
    return sorted(cache.glob(f"*{ROW_FILE_SUFFIX}")) if cache.exists() else []


def _searched_once(tmp_path, cache, rows: int = 200) -> tuple[gradstore.GradStore, tuple, Path]:
    """A store of ``rows`` rows searched once, its row file written: ``(store, result, row file)``."""
    store = _open(tmp_path / "s", cache)
    _write(store, rows, seed=0)
    found = _attribute(store)
    store.core.row_files.wait()
    (path,) = _files(cache)
    return store, found, path


@pytest.fixture
def no_lance_reads(monkeypatch):
    """Fail any read of stored rows for search (what a search served from a row file never does)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the stored rows were read from Lance")

    return lambda: monkeypatch.setattr(gradstore.search.index, "stored_blocks", refuse)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_new_process_searches_the_row_file_and_finds_the_same_rows(tmp_path, dtype, no_lance_reads) -> None:
    cache = tmp_path / "cache"
    first = _open(tmp_path / "s", cache, storage_dtype=dtype)
    _write(first, 300, seed=0)
    found = _attribute(first)
    np.testing.assert_array_equal(found[0], _reference(first))
    first.core.row_files.wait()
    assert len(_files(cache)) == 1
    no_lance_reads()
    again = _open(tmp_path / "s", cache)  # a new process: empty row cache
    mapped = _attribute(again)
    np.testing.assert_array_equal(mapped[0], found[0])
    np.testing.assert_array_equal(mapped[1], found[1])


def test_appended_rows_make_a_new_file_and_remove_the_old(tmp_path) -> None:
    cache = tmp_path / "cache"
    store, _, old = _searched_once(tmp_path, cache)
    _write(store, 150, seed=1)
    again = _open(tmp_path / "s", cache)
    np.testing.assert_array_equal(_attribute(again)[0], _reference(again))
    again.core.row_files.wait()
    (new,) = _files(cache)
    assert new != old and new.name.split("-")[0] == old.name.split("-")[0]  # same rows' file, other version


def test_a_store_made_again_at_the_same_path_is_not_served_the_old_file(tmp_path) -> None:
    cache = tmp_path / "cache"
    _searched_once(tmp_path, cache)
    shutil.rmtree(tmp_path / "s")
    remade = _open(tmp_path / "s", cache)
    _write(remade, 200, seed=5)  # same table version number, other rows
    np.testing.assert_array_equal(_attribute(remade)[0], _reference(remade))


def test_a_damaged_file_is_removed_and_the_rows_read_from_the_store(tmp_path, caplog) -> None:
    cache = tmp_path / "cache"
    _, expected, path = _searched_once(tmp_path, cache)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again = _open(tmp_path / "s", cache)
    np.testing.assert_array_equal(_attribute(again)[0], expected[0])
    assert "unusable" in caplog.text
    again.core.row_files.wait()
    (rewritten,) = _files(cache)  # written again by the search that read the store
    assert rewritten == path and torch.load(path, mmap=True, weights_only=True)["format"] == 1


def test_a_file_of_other_rows_under_the_name_is_refused(tmp_path) -> None:
    """Each run's rows have their own file; one run's file put under the other's name does not check out (another
    row count) and is removed."""
    cache = tmp_path / "cache"
    store = _open(tmp_path / "s", cache)
    _write(store, 200, seed=0, run="a")
    _write(store, 120, seed=1, run="b")
    _attribute(store, "a")
    store.core.row_files.wait()
    (of_a,) = _files(cache)
    _attribute(store, "b")
    store.core.row_files.wait()
    (of_b,) = [path for path in _files(cache) if path != of_a]
    shutil.copyfile(of_a, of_b)
    again = _open(tmp_path / "s", cache)
    np.testing.assert_array_equal(_attribute(again, "b")[0], _reference(again, "b"))


class _Payload:
    """Unpickled by a plain ``pickle.load``, it creates the file ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_that_would_run_code_is_not_run(tmp_path) -> None:
    cache = tmp_path / "cache"
    _, expected, path = _searched_once(tmp_path, cache)
    with path.open("wb") as handle:
        pickle.dump({"format": 1, "kernel": _Payload(tmp_path / "ran")}, handle)
    with path.open("rb") as handle:  # the payload works: a plain unpickling runs it
        pickle.load(handle)
    assert (tmp_path / "ran").exists()
    (tmp_path / "ran").unlink()
    again = _open(tmp_path / "s", cache)
    np.testing.assert_array_equal(_attribute(again)[0], expected[0])
    assert not (tmp_path / "ran").exists()
    assert not path.exists() or torch.load(path, mmap=True, weights_only=True)["format"] == 1


def test_no_files_when_turned_off_or_too_small(tmp_path) -> None:
    off = gradstore.open(tmp_path / "off", row_files=False)
    _write(off, 100, seed=0)
    _attribute(off)
    off.core.row_files.wait()
    assert off.core.row_files.directory is None
    small = gradstore.open(tmp_path / "small", row_files=tmp_path / "cache")  # default minimum: 32 MiB
    _write(small, 100, seed=0)
    _attribute(small)
    small.row_files.wait()
    assert _files(tmp_path / "cache") == []


def test_files_beyond_the_budget_go_least_recently_used_first(tmp_path) -> None:
    cache = tmp_path / "cache"
    store = _open(tmp_path / "s", cache)
    for run in ("a", "b", "c"):
        _write(store, 100, seed=0, run=run)
    _attribute(store, "a")
    store.core.row_files.wait()
    (of_a,) = _files(cache)
    store.core.row_files.budget_bytes = 2 * of_a.stat().st_size + 1024  # two files
    _attribute(store, "b")
    store.core.row_files.wait()
    (of_b,) = [path for path in _files(cache) if path != of_a]
    for path in (of_a, of_b):
        os.utime(path, (1000, 1000))  # both long unused (no test depends on the clock's resolution)
    again = _open(tmp_path / "s", cache)
    again.core.row_files.budget_bytes = store.core.row_files.budget_bytes
    _attribute(again, "a")  # maps a's file: now more recently used than b's
    again.core.row_files.wait()
    _attribute(again, "c")
    again.core.row_files.wait()
    remaining = _files(cache)
    assert len(remaining) == 2 and of_a in remaining and of_b not in remaining


@pytest.mark.parametrize("kernel", ["bfloat16", "float32"])
@pytest.mark.parametrize("source_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_saved_rows_search_as_the_prepared_ones(tmp_path, kernel, source_dtype) -> None:
    rng = np.random.default_rng(3)
    rows = torch.from_numpy(rng.standard_normal((500, DIM)).astype(np.float32)).to(source_dtype)
    scales = rng.uniform(0.1, 3.0, 500).astype(np.float32)
    index = ExactIndex(device="cpu", block_rows=128, kernel=kernel)
    prepared = index.prepare(np.arange(500) * 3, rows, scales)
    torch.save(rows_state(prepared), tmp_path / "rows.pt")
    loaded = rows_from_state(torch.load(tmp_path / "rows.pt", mmap=True, weights_only=True), kernel, DIM, 500)
    for found, expected in zip(index.search(_queries(), loaded, K), index.search(_queries(), prepared, K)):
        np.testing.assert_array_equal(found, expected)


def test_saved_rows_that_do_not_fit_are_refused(tmp_path) -> None:
    rows = torch.randn(50, DIM)
    state = rows_state(ExactIndex(device="cpu", kernel="bfloat16").prepare(np.arange(50), rows))
    with pytest.raises(SavedRowsError, match="rows"):
        rows_from_state(state, "bfloat16", DIM, 51)
    with pytest.raises(SavedRowsError, match="rows"):
        rows_from_state(state, "bfloat16", DIM + 1, 50)
    with pytest.raises(SavedRowsError, match="kernel"):
        rows_from_state(state, "float32", DIM, 50)
    with pytest.raises(SavedRowsError, match="ids"):
        rows_from_state({**state, "blocks": [{**state["blocks"][0], "ids": torch.zeros(50)}]}, "bfloat16", DIM, 50)
    with pytest.raises(SavedRowsError, match="format"):
        rows_from_state([1, 2], "bfloat16", DIM, 50)
    float32_kernel = rows_state(ExactIndex(device="cpu", kernel="float32").prepare(np.arange(50), rows.half()))
    assert float32_kernel["blocks"][0]["rows"].dtype == torch.float16  # the rows as stored
    wide = {**float32_kernel["blocks"][0], "rows": torch.zeros(50, DIM, dtype=torch.float64)}
    with pytest.raises(SavedRowsError, match="rows"):
        rows_from_state({**float32_kernel, "blocks": [wide]}, "float32", DIM, 50)
    assert RowFiles(None).path("x") is None


def test_warming_an_index_leaves_the_row_file_for_the_next_process(tmp_path, no_lance_reads) -> None:
    cache = tmp_path / "cache"
    store = _open(tmp_path / "s", cache)
    _write(store, 200, seed=0)
    index = store.build_index("r", checkpoint="c", method="grad-dot")
    assert index.cached_rows() is None
    path = index.warm()
    assert path is not None and path.parent == cache and _files(cache) == [path]
    assert index.cached_rows() is not None
    assert store.build_index("r", checkpoint="c", method="cosine").warm() is None  # transformed rows: no file
    expected = _attribute(store)
    no_lance_reads()
    np.testing.assert_array_equal(_attribute(_open(tmp_path / "s", cache))[0], expected[0])


def _mapped_from(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory mapped from ``path``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path.resolve())):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_once_written_the_row_cache_holds_the_mapped_file(tmp_path) -> None:
    """The rows a first search prepared in memory give way to the mapped file once it is written (pages the
    system can drop and read again), and searches return the same."""
    cache = tmp_path / "cache"
    store = _open(tmp_path / "s", cache)
    _write(store, 300, seed=0)
    index = store.build_index("r", checkpoint="c", method="grad-dot")
    first = _attribute(store)
    store.core.row_files.wait()
    (path,) = _files(cache)
    block = index.cached_rows().blocks[0]
    searched = block.screen if isinstance(block, ScreenedBlock) else block[1]  # the bf16 screen, or the rows as stored
    assert any(start <= searched.data_ptr() < end for start, end in _mapped_from(path))
    again = _attribute(store)
    np.testing.assert_array_equal(again[0], first[0])
    np.testing.assert_array_equal(again[1], first[1])


def test_row_files_are_listed_and_cleared_from_the_command_line(tmp_path) -> None:
    from typer.testing import CliRunner

    from gradstore.cli import app

    cache = tmp_path / "cache"
    store = gradstore.open(tmp_path / "s", row_files=RowFiles(cache, budget_bytes=1 << 30, min_bytes=0))
    assert store.core.row_files.budget_bytes == 1 << 30
    _write(store, 200, seed=0)
    _attribute(store)
    store.core.row_files.wait()
    (path,) = _files(cache)
    (entry,) = store.core.row_files.entries()
    assert entry["name"] + ROW_FILE_SUFFIX == path.name and entry["bytes"] == path.stat().st_size
    runner = CliRunner()
    listed = runner.invoke(app, ["row-files", "--directory", str(cache)])
    assert listed.exit_code == 0 and "1 row files" in listed.output and entry["name"] in listed.output
    scans = store.core.scan_files.usage()[0]
    assert scans >= 4 and f"{scans} scan files" in listed.output  # runs, checkpoints, ids, example ids
    cleared = runner.invoke(app, ["row-files", "--directory", str(cache), "--clear"])
    assert cleared.exit_code == 0 and f"removed 1 row files and {scans} scan files" in cleared.output
    assert _files(cache) == [] and store.core.row_files.entries() == [] and store.core.scan_files.usage() == (0, 0)
    np.testing.assert_array_equal(_attribute(gradstore.open(tmp_path / "s", row_files=False))[0], _reference(store))


def test_processes_share_row_files(tmp_path) -> None:
    """Two processes searching a store for the first time at once both write its row file (one stays); a third
    process maps it and reads no row from Lance; all find the rows a search of the store finds."""
    import json
    import subprocess
    import sys

    cache = tmp_path / "cache"
    store = gradstore.open(tmp_path / "s", row_files=False)
    _write(store, 300, seed=0)
    job = [sys.executable, str(JOB), str(tmp_path / "s"), str(cache)]
    first = [subprocess.Popen(job, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=300)[0] for process in first]
    assert [process.returncode for process in first] == [0, 0]
    assert len(_files(cache)) == 1 and not list(cache.glob("*.tmp"))
    mapped = subprocess.run([*job, "--no-lance"], capture_output=True, text=True, timeout=300)
    assert mapped.returncode == 0, mapped.stderr
    expected = _reference(store).reshape(-1).tolist()
    assert all(json.loads(output) == expected for output in [*outputs, mapped.stdout])


def test_a_file_that_cannot_be_written_costs_nothing_but_the_file(tmp_path, disk_full, caplog) -> None:
    import gradstore.core.row_cache as row_cache

    disk_full(row_cache.torch, "save")
    cache = tmp_path / "cache"
    store = _open(tmp_path / "s", cache)
    _write(store, 200, seed=0)
    np.testing.assert_array_equal(_attribute(store)[0], _reference(store))
    store.core.row_files.wait()
    assert "not written" in caplog.text
    assert [path for path in cache.iterdir() if path.is_file()] == []  # no row file, no temporary left
    np.testing.assert_array_equal(_attribute(store)[0], _reference(store))
