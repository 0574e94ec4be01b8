"""Two processes creating the same new run at once: exactly one projection spec per run, always."""

from __future__ import annotations

import multiprocessing

import pytest

import gradstore
from gradstore.core import StoreCore
from gradstore.core import schema as S
from gradstore.core.catalog import RunCatalog
from gradstore.errors import InvalidArgumentError, SchemaMismatchError

SPEC_A = {"kind": "a", "fingerprint": "a"}
SPEC_B = {"kind": "b", "fingerprint": "b"}


def _rival_commits_first(monkeypatch, store: StoreCore, **rival: object) -> None:
    """Make the next ``create_run`` miss a rival's run row: the rival commits right after ``has_run`` said no."""
    original = RunCatalog.has_run

    def has_run_then_rival(self: RunCatalog, run_id: str) -> bool:
        monkeypatch.setattr(RunCatalog, "has_run", original)
        found = original(self, run_id)
        gradstore.open(store.uri).create_run(run_id, **rival)
        return found

    monkeypatch.setattr(RunCatalog, "has_run", has_run_then_rival)


def test_the_first_committed_spec_is_the_run_and_the_other_creation_fails(monkeypatch, tmp_path):
    store = gradstore.open(tmp_path / "store")
    _rival_commits_first(monkeypatch, store, dim=8, projection=SPEC_A)
    with pytest.raises(SchemaMismatchError, match="same time"):
        store.create_run("r", dim=8, projection=SPEC_B)
    assert store.core.run_projection("r") == SPEC_A
    assert store.runs().column("run_id").to_pylist() == ["r"]  # the losing row was withdrawn


def test_a_rival_of_another_dim_wins_too(monkeypatch, tmp_path):
    store = gradstore.open(tmp_path / "store")
    _rival_commits_first(monkeypatch, store, dim=16, projection=SPEC_A)
    with pytest.raises(SchemaMismatchError):
        store.create_run("r", dim=8, projection=SPEC_A)
    assert store.core.run_dim("r") == 16
    assert store.runs().num_rows == 1


def test_the_same_spec_created_at_once_is_one_run(monkeypatch, tmp_path):
    store = gradstore.open(tmp_path / "store")
    _rival_commits_first(monkeypatch, store, dim=8, projection=SPEC_A)
    assert store.create_run("r", dim=8, projection=SPEC_A, exist_ok=True)["projection"] is not None
    assert store.runs().num_rows == 1
    _rival_commits_first(monkeypatch, store, dim=8, projection=SPEC_A)
    with pytest.raises(InvalidArgumentError, match="already exists"):
        store.create_run("s", dim=8, projection=SPEC_A)
    assert store.runs().column("run_id").to_pylist().count("s") == 1


def _create(uri: str, dim: int, spec: dict, start, results) -> None:
    start.wait()
    try:
        gradstore.open(uri).create_run("r", dim=dim, projection=spec)
        results.put(("created", spec["kind"]))
    except (SchemaMismatchError, InvalidArgumentError) as error:
        results.put(("refused", type(error).__name__))


def test_two_processes_creating_one_run_leave_exactly_one_spec(tmp_path):
    uri = str(tmp_path / "store")
    gradstore.open(uri)
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_create, args=(uri, 8, spec, start, results)) for spec in (SPEC_A, SPEC_B)]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join(timeout=300)
        assert worker.exitcode == 0
    created = [kind for outcome, kind in outcomes if outcome == "created"]
    assert len(created) == 1  # whatever the interleaving: one creation succeeds, the other is refused
    store = gradstore.open(uri)
    assert store.runs().num_rows == 1
    assert store.core.run_projection("r")["kind"] == created[0]
    assert store.core.table(S.RUNS).count_rows() == 1
