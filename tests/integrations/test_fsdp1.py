"""FSDP1 (``FullyShardedDataParallel``) on 2 gloo ranks on CPU, with and without ``use_orig_params``: layer names
lose FSDP's ``_fsdp_wrapped_module.`` components, so the projection spec (and its seeds) and every row equal a
single-process run's; normalizer= and fused=True (which read per-layer weights) are refused."""

from __future__ import annotations

import json
import os
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

pytestmark = pytest.mark.slow
RUNS = {"fsdp1-orig": True, "fsdp1-flat": False}  # run -> use_orig_params


def wrap_fsdp1(model: nn.Module, use_orig_params: bool) -> nn.Module:
    """FSDP1 with every Linear and the root wrapped (each Linear's parameters sharded over the ranks)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )


def _worker(rank: int, port: int, store_path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LANCE_LOG="error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    store = gradstore.open(store_path, storage_dtype="float32")
    stats = {}
    wrapped = wrap_fsdp1(make_model(), False)
    opt = torch.optim.Adam(wrapped.parameters())
    for options in ({"normalizer": "adam_factored"}, {"fused": True}):  # need per-layer weights: refused
        with pytest.raises(gradstore.GradstoreError, match="normalizer=None and fused=False"):
            distributed_capture(store, wrapped, "refused", optimizer=opt, **OPTIONS, **options)
    for run, use_orig_params in RUNS.items():
        wrapped = wrap_fsdp1(make_model(), use_orig_params)
        names = [n for n, _ in wrapped.named_modules()]
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        with distributed_capture(store, wrapped, run, optimizer=opt, commit_every=2, **OPTIONS) as cap:
            train(wrapped, cap, opt, rank, WORLD, STEPS)
        stats[run] = {"rows": cap.rows_committed, "wrapped_names": names}
    if rank == 0:
        Path(out).write_text(json.dumps(stats))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fsdp1")
    store_path, out = tmp_path / "store", tmp_path / "out.json"
    mp.spawn(_worker, args=(free_port(), str(store_path), str(out)), nprocs=WORLD, join=True)
    return tmp_path, store_path, json.loads(out.read_text())


def test_fsdp1_ranks_write_exactly_the_single_process_rows(job):
    tmp_path, store_path, stats = job
    reference = reference_rows(tmp_path)
    ref_store = gradstore.open(tmp_path / "reference")
    store = gradstore.open(store_path)
    for run in RUNS:
        assert any("_fsdp_wrapped_module" in n for n in stats[run]["wrapped_names"])  # FSDP1 did rename them
        spec = store.core.run_spec(run)
        assert spec == ref_store.core.run_spec("ref")  # names "0" and "2", the same seeds and sizes
        assert [slot.name for slot in spec.layers] == ["0", "2"]
        got = rows_by_key(store, run)
        assert set(got) == set(reference) and len(got) == STEPS * GLOBAL_BATCH == stats[run]["rows"]
        for key, vector in reference.items():
            assert np.linalg.norm(got[key] - vector) <= 1e-5 * np.linalg.norm(vector), (run, key)
