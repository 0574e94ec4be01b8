"""A process that attributes against a store once (``tests/core/test_concurrent_side_files.py``): ``python
attribute_job.py STORE METHOD KIND`` prints the top-k ``grad_id``s as JSON."""

from __future__ import annotations

import json
import sys

import numpy as np

import gradstore

if __name__ == "__main__":
    store_path, method, kind = sys.argv[1:4]
    store = gradstore.open(store_path, row_files=False)
    queries = np.random.default_rng(99).standard_normal((4, 40)).astype(np.float32)
    table = store.attribute(queries, run="r", k=6, method=method, kind=kind, write=False)
    print(json.dumps(table.column("grad_id").to_pylist()))
