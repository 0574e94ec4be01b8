"""A process that searches a store once (``tests/core/test_rowfiles.py``): ``python rowfile_job.py STORE CACHE
[--no-lance]`` prints the top-k ``grad_id``s as JSON; ``--no-lance`` fails any read of stored rows for search
(what a search served from a row file never does)."""

from __future__ import annotations

import json
import sys

import numpy as np

import gradstore
import gradstore.search.index
from gradstore.core.row_cache import RowFiles


def refuse(*args, **kwargs):
    raise AssertionError("the stored rows were read from Lance")


if __name__ == "__main__":
    store_path, cache = sys.argv[1], sys.argv[2]
    if "--no-lance" in sys.argv:
        gradstore.search.index.stored_blocks = refuse
    store = gradstore.open(store_path, row_files=RowFiles(cache, min_bytes=0))
    queries = np.random.default_rng(99).standard_normal((4, 40)).astype(np.float32)
    table = store.attribute(queries, run="r", k=6, write=False, method="grad-dot")
    print(json.dumps(table.column("grad_id").to_pylist()))
