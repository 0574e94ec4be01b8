"""Store creation is idempotent and crash-safe: whatever a killed first open left behind opens again."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import gradstore
from gradstore.core import schema as S


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("complete") / "store"
    gradstore.open(path)
    return path


def _partial(complete: Path, target: Path, tables: dict[str, str]) -> Path:
    """A store directory as a kill during creation leaves it: some tables whole, some with only the files
    written before their first version was committed."""
    target.mkdir(parents=True)
    for name, part in tables.items():
        source = complete / f"{name}.lance"
        if part == "whole":
            shutil.copytree(source, target / f"{name}.lance")
        else:
            shutil.copytree(source / part, target / f"{name}.lance" / part)
    return target


def _works(path: Path) -> None:
    store = gradstore.open(path)
    assert set(S.FIXED_SCHEMAS) <= set(store.core.db.list_tables().tables)
    store.create_run("r", dim=3)
    with store.writer("r") as writer:
        writer.append(np.eye(3), ["a", "b", "c"], checkpoint="c", split="train")
    store.record_checkpoint("r", "c", step=1)
    assert store.count() == 3 and store.checkpoints("r").num_rows == 1
    assert store.sql("select count(*) from runs").fetchall() == [(1,)]


@pytest.mark.parametrize(
    "tables",
    [
        {"runs": "_transactions"},
        {"runs": "whole", "checkpoints": "_transactions"},
        {"runs": "_transactions", "checkpoints": "whole", "scores": "whole"},
        {"runs": "whole", "checkpoints": "whole", "scores": "whole", "self_influence": "_transactions"},
    ],
)
def test_an_interrupted_creation_is_completed_by_the_next_open(complete, tmp_path, tables):
    path = _partial(complete, tmp_path / "store", tables)
    if tables["runs"] != "whole":  # not a store yet; with its runs table it is one
        with pytest.raises(gradstore.NotAStoreError):
            gradstore.open(path, create=False)
    _works(path)


def test_an_interrupted_gradients_table_is_created_by_the_next_run(complete, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(complete, path)
    source = gradstore.open(tmp_path / "other")
    source.create_run("x", dim=3)
    part = Path("gradients.lance") / "_transactions"
    shutil.copytree(tmp_path / "other" / part, path / part)
    store = gradstore.open(path)
    assert store.dim is None
    assert store.verify().ok  # not damage: the table is absent until its creation commits
    _works(path)


_OPEN_SCRIPT = textwrap.dedent("""
    import sys, gradstore
    for i in range(1000):
        gradstore.open(f"{sys.argv[1]}/s{i}")
        print(i, flush=True)
""")


def test_stores_killed_while_being_created_open_afterwards(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _OPEN_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    for _ in range(3):
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)  # somewhere inside the creation of a later store
    proc.wait()
    for path in sorted(tmp_path.iterdir()):
        _works(path)


def test_a_store_with_a_read_consistency_interval_sees_its_own_writes(store_path):
    """Rows are committed through Lance, not the LanceDB handle: the handle is moved to the new version."""
    store = gradstore.open(store_path, read_consistency=timedelta(minutes=10))
    store.create_run("r", dim=2)
    assert store.run("r")["dim"] == 2
    with store.writer("r") as writer:
        writer.append(np.ones((2, 2)), ["a", "b"], checkpoint="c", split="train")
    store.record_checkpoint("r", "c", step=3)
    store.add_examples([{"example_id": "a", "text": "x"}])
    assert (store.count(), store.count("examples"), store.checkpoints("r").num_rows) == (2, 1, 1)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"row_files": 5}, "row_files must be True .*, got 5"),
        ({"row_files": None}, "row_files must be True"),
        ({"read_consistency": 5}, "read_consistency must be a datetime.timedelta"),
        ({"storage_options": "s3"}, "storage_options must be a dict"),
    ],
)
def test_open_refuses_arguments_of_a_type_it_cannot_use(store_path, arguments, message):
    """Before: ``row_files=5`` was a StoreCorruptError ("cannot open store"), naming no argument."""
    gradstore.open(store_path)
    with pytest.raises(gradstore.InvalidArgumentError, match=message):
        gradstore.open(store_path, **arguments)
    with pytest.raises(gradstore.InvalidArgumentError, match="uri must be a local directory"):
        gradstore.open(5)
    assert not Path("5").exists()


@pytest.mark.parametrize("dim", [2.5, 0, -3, True, "8", None])
def test_create_run_refuses_a_dim_that_is_not_a_positive_whole_number(store_path, dim):
    """Before: ``dim=2.5`` was a SchemaMismatchError about another process creating the run."""
    store = gradstore.open(store_path)
    with pytest.raises(gradstore.InvalidArgumentError, match=r"dim must be a positive whole number .*, got "):
        store.create_run("z", dim=dim)
    assert not store.core.has_run("z")
    assert store.create_run("z", dim=np.int64(8))["dim"] == 8 and type(store.run("z")["dim"]) is int


def _create_gradients_table(path: str, dim: int, barrier, results) -> None:
    store = gradstore.open(path)
    barrier.wait()
    try:
        store.core.tables.create(S.GRADIENTS, S.gradients_schema(dim, "float16"))
        results.put(("ok", dim))
    except Exception as error:  # reported to the test
        results.put(("error", repr(error)))


def test_two_processes_creating_one_table_commit_exactly_one_first_version(tmp_path):
    """Lance's ``create`` mode let a process that lost the race overwrite the winner's table as version 2
    (5-7 of 40 races); creation must leave the first version alone and both creators must see one table."""
    context = mp.get_context("spawn")  # forking a process that runs Lance's async runtime may deadlock
    for trial in range(8):
        path = str(tmp_path / f"store{trial}")
        gradstore.open(path)
        barrier, results = context.Barrier(2), context.Queue()
        processes = [
            context.Process(target=_create_gradients_table, args=(path, dim, barrier, results)) for dim in (8, 16)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        outcomes = [results.get(timeout=10) for _ in processes]
        assert all(kind == "ok" for kind, _ in outcomes), outcomes
        dataset = gradstore.open(path).core.table(S.GRADIENTS).to_lance()
        assert dataset.version == 1, f"trial {trial}: the first version was overwritten"
