"""The small store the serve tests (and tests/store/test_store_api.py) serve: 80 training rows and 6 queries of dim 16
in run ``r``, examples with text and source, one attribution; the tokens they serve it with."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

import gradstore

RUN, DIM, N_TRAIN, N_QUERIES = "r", 16, 80, 6
READ = "read-token-0123456789abcdef"
WRITE = "write-token-0123456789abcdef"


def make_store(path):
    """The store at ``path`` (a new directory): a copy of the one this process built first."""
    global _BUILT
    if _BUILT is None:
        _BUILT = Path(tempfile.mkdtemp(prefix="gradstore-served-")) / "store"
        atexit.register(shutil.rmtree, _BUILT.parent, ignore_errors=True)
        _build(_BUILT)
    shutil.copytree(_BUILT, path)
    return gradstore.open(path)


_BUILT: Path | None = None


def _build(path) -> None:
    rng = np.random.default_rng(0)
    store = gradstore.open(path)
    store.create_run(RUN, dim=DIM)
    store.record_checkpoint(RUN, "final", step=1, learning_rate=0.1)
    train = [f"t-{i:03d}" for i in range(N_TRAIN)]
    queries = [f"q-{i}" for i in range(N_QUERIES)]
    with store.writer(RUN) as writer:
        writer.append(rng.standard_normal((N_TRAIN, DIM), dtype=np.float32), train, checkpoint="final", split="train")
        writer.append(
            rng.standard_normal((N_QUERIES, DIM), dtype=np.float32), queries, checkpoint="final", split="query"
        )
    store.add_examples(
        pd.DataFrame(
            {
                "example_id": train + queries,
                "text": [f"sentence {i}" for i in range(N_TRAIN)] + [f"question {i}" for i in range(N_QUERIES)],
                "source": ["web" if i % 3 else "books" for i in range(N_TRAIN)] + ["q"] * N_QUERIES,
            }
        )
    )
    store.attribute(run=RUN, k=5, method="grad-dot")


def same_table(remote: pa.Table, expected: pa.Table, sort=None) -> None:
    left, right = remote.to_pandas(), expected.to_pandas()
    if sort:
        left, right = left.sort_values(sort, ignore_index=True), right.sort_values(sort, ignore_index=True)
    pd.testing.assert_frame_equal(left, right)
