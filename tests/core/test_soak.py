"""A concurrent soak: 4 writer processes (each to its own run and all to one shared run) and 2 reader
processes (SQL; streamed rows and attribution) on one store for ``GRADSTORE_SOAK_SECONDS`` (default 30) of
wall time, with one ``compact()`` of the store in the middle.

The duration only bounds the loops; the assertions do not depend on it: no process fails, no reader ever
sees an error, a duplicated or partial row or a count that goes down, and afterwards every acknowledged
row is stored exactly once and the store verifies.
"""

from __future__ import annotations

import os
import time

import pytest
from store_workload import (
    DIM,
    Acknowledged,
    Zygote,
    append_more,
    check_queries,
    check_rows,
    progress_lines,
)

import gradstore

WRITERS = 4
READERS = ("soak_sql_reader", "soak_vector_reader")


@pytest.mark.slow
def test_four_writers_two_readers_and_a_compaction_at_once(tmp_path):
    seconds = float(os.environ.get("GRADSTORE_SOAK_SECONDS", "30"))
    storage_dtype = "float16"
    store = gradstore.open(tmp_path / "stores" / "s0", storage_dtype=storage_dtype)
    tags = [f"t{k}" for k in range(WRITERS)]
    for run in [*(f"own-{tag}" for tag in tags), "shared"]:
        store.create_run(run, dim=DIM)
    stop = tmp_path / "stop"
    common = {"root": str(tmp_path / "stores"), "storage_dtype": storage_dtype, "stop": str(stop)}
    zygote = Zygote()
    jobs = {}  # pid -> (job, progress file, log)
    try:
        for k, tag in enumerate(tags):
            progress, log = tmp_path / f"writer-{k}", tmp_path / f"writer-{k}.log"
            pid = zygote.start("soak_writer", log, progress=str(progress), seed=k, tag=tag, **common)
            jobs[pid] = ("soak_writer", progress, log)
        for k, reader in enumerate(READERS):
            progress, log = tmp_path / f"reader-{k}", tmp_path / f"reader-{k}.log"
            jobs[zygote.start(reader, log, progress=str(progress), seed=100 + k, **common)] = (reader, progress, log)
        time.sleep(seconds / 2)
        store.compact()  # rewrites the fragments under the writers and readers
        time.sleep(seconds / 2)
        stop.touch()
        statuses = {pid: zygote.wait(pid) for pid in jobs}
    finally:
        stop.touch()
        zygote.close()
    failed = {jobs[pid][0]: jobs[pid][2].read_text() for pid, status in statuses.items() if status != 0}
    assert not failed, failed
    for job, progress, _ in jobs.values():
        if job != "soak_writer":
            assert [words[0] for words in progress_lines(progress)][-1:] == ["read"]

    acknowledged = Acknowledged()
    for _, progress, _ in jobs.values():
        for run, ids in Acknowledged.read(progress).rows["s0"].items():
            assert not ids & acknowledged.rows["s0"][run]  # every writer writes its own ids
            acknowledged.rows["s0"][run] |= ids
    store = gradstore.open(tmp_path / "stores" / "s0", create=False)
    report = store.verify()
    assert report.ok, report.problems
    runs = store.runs().column("run_id").to_pylist()
    assert sorted(acknowledged.rows["s0"]) == sorted(runs)
    stored = {run: check_rows(store, run, acknowledged.rows["s0"][run], storage_dtype) for run in runs}
    for run, ids in stored.items():  # a writer flushes before it closes: every row it appended is acknowledged
        assert sorted(ids) == sorted(acknowledged.rows["s0"][run])
    check_queries(store, stored)
    append_more(store, "shared", storage_dtype)
