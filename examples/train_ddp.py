"""Capture under DistributedDataParallel: 2 CPU ranks (gloo), one store, rows committed together.

    python examples/train_ddp.py [STORE]                       # spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/train_ddp.py STORE    # or let torchrun start them

Every rank captures its own share of each global batch; a rank writes its rows as Lance data files and rank 0
commits every rank's files in one transaction every ``commit_every`` optimizer steps and at the end.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradstore
from gradstore.distributed import distributed_capture

STEPS, GLOBAL_BATCH = 8, 16


def train(rank: int, world: int, store_path: str) -> None:
    torch.manual_seed(0)  # same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(STEPS * GLOBAL_BATCH, 16, generator=gen),
        torch.randint(0, 4, (STEPS * GLOBAL_BATCH,), generator=gen),
    )
    store = gradstore.open(store_path)
    share = GLOBAL_BATCH // world
    with distributed_capture(store, model, "ddp-demo", optimizer=opt, commit_every=4) as cap:
        for step in range(STEPS):
            lo = step * GLOBAL_BATCH + rank * share
            cap.set_ids([f"ex{i}" for i in range(lo, lo + share)])
            nn.functional.cross_entropy(model(x[lo : lo + share]), y[lo : lo + share]).backward()
            opt.step()
            opt.zero_grad()
    if rank == 0:
        print(
            store.sql(
                "SELECT rank, count(*) AS rows, min(step) AS first, max(step) AS last FROM gradients "
                "GROUP BY rank ORDER BY rank"
            )
            .df()
            .to_string(index=False)
        )
        print("versions of the gradients table:", len(store.core.table("gradients").to_lance().versions()))


def spawned(rank: int, world: int, port: int, store_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, store_path)
    finally:
        dist.destroy_process_group()


def main() -> None:
    store_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "store")
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), store_path)
        dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(2, port, store_path), nprocs=2)


if __name__ == "__main__":
    main()
