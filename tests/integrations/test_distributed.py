"""Two-process gloo runs on CPU: DDP and FSDP2 capture equals a single-process reference, row for row;
ranks commit together (few commits); a rank killed mid-run leaves exactly the committed rows."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import GLOBAL_BATCH, OPTIONS, STEPS, WORLD, free_port, make_model, reference_rows, rows_by_key, train
from torch import nn

import gradstore
from gradstore.distributed import distributed_capture


def _worker(rank: int, port: int, store_path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LANCE_LOG="error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    store = gradstore.open(store_path, storage_dtype="float32")
    stats = {}
    for run in ("ddp", "fsdp"):  # one spawn for both (process start-up dominates on a small CPU)
        wrapped = wrap(make_model(), run)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        with distributed_capture(store, wrapped, run, optimizer=opt, commit_every=2, **OPTIONS) as cap:
            train(wrapped, cap, opt, rank, WORLD, STEPS)
        stats[run] = {"commits": cap._committer.commits, "rows": cap.rows_committed}
    if rank == 0:
        Path(out).write_text(json.dumps(stats))
    die_mid_run(rank, store)


def die_mid_run(rank: int, store) -> None:
    """Run "killed": rows of steps 0-1 are committed after the second step, then both ranks stage step 2's
    rows as data files and rank 1 is SIGKILLed (the spawner then tears the job down, as torchrun would)."""
    wrapped = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    with distributed_capture(store, wrapped, "killed", optimizer=opt, commit_every=2, **OPTIONS) as cap:

        def die_after_staging(step: int) -> None:
            if step == 2:
                cap.capture.flush()
                cap._writer.flush()  # step 2's rows are now data files that no version references
                dist.barrier()
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.barrier()  # never returns: the job is torn down

        train(wrapped, cap, opt, rank, WORLD, 3, on_backward=die_after_staging)


def wrap(model: nn.Module, how: str) -> nn.Module:
    """DDP, or FSDP2 with every Linear and the root sharded."""
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One 2-rank job (process start-up dominates on a small CPU): runs "ddp" and "fsdp", then "killed"."""
    tmp_path = tmp_path_factory.mktemp("distributed")
    store_path, out = tmp_path / "store", tmp_path / "out.json"
    with pytest.raises(mp.ProcessExitedException):
        mp.spawn(_worker, args=(free_port(), str(store_path), str(out)), nprocs=WORLD, join=True)
    return tmp_path, store_path, json.loads(out.read_text())


def test_ddp_and_fsdp2_ranks_write_exactly_the_single_process_rows(job):
    tmp_path, store_path, stats = job
    reference = reference_rows(tmp_path)
    store = gradstore.open(store_path)
    for run in ("ddp", "fsdp"):
        got = rows_by_key(store, run)
        assert set(got) == set(reference) and len(got) == STEPS * GLOBAL_BATCH
        for key, vector in reference.items():
            assert np.linalg.norm(got[key] - vector) <= 1e-5 * np.linalg.norm(vector), (run, key)
        ranks = store.sql(
            f"SELECT rank, count(*) AS n FROM gradients WHERE run_id = '{run}' GROUP BY rank ORDER BY rank"
        ).fetchall()
        assert ranks == [(0, STEPS * GLOBAL_BATCH // 2), (1, STEPS * GLOBAL_BATCH // 2)]
        # both ranks' rows went in through one commit per flush point: after steps 2 and 4 (none at exit)
        assert stats[run] == {"commits": 2, "rows": STEPS * GLOBAL_BATCH}
    versions = store.core.table("gradients").to_lance().versions()
    assert len(versions) == 1 + 2 + 2 + 1  # creation, two collective commits per run, one before the kill


def test_a_killed_rank_leaves_exactly_the_committed_rows(job):
    _, store_path, _ = job
    store = gradstore.open(store_path)
    got = rows_by_key(store, "killed")
    assert sorted(got) == sorted((f"ex{i}", s) for s in (0, 1) for i in range(s * 8 % 16, s * 8 % 16 + 8))
    # step 2's rows were written as data files by both ranks, but never committed
    data_files = list((store_path / "gradients.lance" / "data").glob("*.lance"))
    referenced = {
        f.path for frag in store.core.table("gradients").to_lance().get_fragments() for f in frag.metadata.files
    }
    assert len(data_files) > len(referenced)


def _s3_worker(rank: int, port: int, uri: str, storage_options: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LANCE_LOG="error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    store = gradstore.open(uri, storage_dtype="float32", storage_options=storage_options)
    wrapped = wrap(make_model(), "ddp")
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    options = {**OPTIONS, "curvature": True, "checkpoint": "c0"}
    with distributed_capture(store, wrapped, "s3", optimizer=opt, commit_every=2, **options) as cap:
        train(wrapped, cap, opt, rank, WORLD, STEPS)
    dist.destroy_process_group()


def test_ranks_capture_into_a_store_on_object_storage(s3_bucket, tmp_path, monkeypatch):
    bucket, storage_options = s3_bucket
    monkeypatch.chdir(tmp_path)  # nothing may land on local disk under a relative "s3:" path
    uri = f"s3://{bucket}/store"
    mp.spawn(_s3_worker, args=(free_port(), uri, storage_options), nprocs=WORLD, join=True)
    reference = reference_rows(tmp_path)
    store = gradstore.open(uri, storage_options=storage_options)
    got = rows_by_key(store, "s3")  # every row exactly once
    assert set(got) == set(reference) and len(got) == STEPS * GLOBAL_BATCH
    for key, vector in reference.items():
        assert np.linalg.norm(got[key] - vector) <= 1e-5 * np.linalg.norm(vector), key
    assert len(store.core.table("gradients").to_lance().versions()) == 1 + 2  # creation, one commit per flush point
    assert store.core.load_curvature("s3", "c0")  # the ranks' pooled statistics, saved to the bucket
    assert os.listdir(tmp_path) == ["reference"]
