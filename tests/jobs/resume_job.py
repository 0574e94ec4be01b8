"""A training job for tests/capture/test_resume.py: 9 steps under capture, a checkpoint every 3 steps, and on demand
a SIGKILL of itself after the rows of some step are committed, or a resume from the last checkpoint.

Usage: ``python resume_job.py STORE WORKDIR (full|crash-after-STEP|resume|rerun)``; ``rerun`` resumes
without ``resume=True`` (the duplicates the option exists to avoid).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import gradstore

STEPS, EVERY, BATCH = 9, 3, 4


def main(store_path: str, workdir: str, mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(STEPS * BATCH, 5, generator=generator),
        torch.randint(0, 3, (STEPS * BATCH,), generator=generator),
    )
    checkpoint_file = Path(workdir) / "checkpoint.pt"
    start = 0
    if mode in ("resume", "rerun"):
        state = torch.load(checkpoint_file)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    crash_after = int(mode.split("-")[-1]) if mode.startswith("crash-after-") else None
    store = gradstore.open(store_path)
    with store.capture(
        model,
        "run",
        optimizer=optimizer,
        k_in=2,
        k_out=2,
        resume=mode == "resume",
        writer=gradstore.WriterConfig(commit_rows=2),
    ) as cap:
        cap.set_step(start)
        for step in range(start, STEPS):
            if step % EVERY == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, checkpoint_file
                )
            rows = slice(step * BATCH, (step + 1) * BATCH)
            cap.set_ids([f"ex{i % 10}" for i in range(rows.start, rows.stop)])  # ids repeat across steps
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == crash_after:
                cap.flush()
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:])
