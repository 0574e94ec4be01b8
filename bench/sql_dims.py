"""SQL over a store of several dims: the ``gradients`` view (``UNION ALL BY NAME`` of one table per dim) vs
one table holding the same number of rows.

Store ``one`` holds one run of ``rows`` 64-dim rows; store ``two`` holds a 64-dim and a 32-dim run of
``rows / 2`` each (two gradient tables). Typical queries (a filtered count, a group-by, a point lookup by
example id, the distinct checkpoints of a run's query rows) run against both, alternating (paired); prints
the median milliseconds of each and their ratio. Target: the union costs at most 1.2x the single table for
every query (DuckDB pushes projections and filters into each table's scan). The ratio is the median of the
per-round ratios; the arms' order alternates between rounds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import gradstore

QUERIES = {
    "filtered count": "select count(*) from gradients where split = 'query'",
    "group by": "select run_id, split, count(*), avg(grad_norm) from gradients group by 1, 2",
    "point lookup": "select example_id, step from gradients where example_id = 'a-1234'",
    "run's checkpoints": "select distinct checkpoint from gradients where run_id = 'a' and split = 'query'",
}
TARGET = 1.2


def _store(path: Path, runs: list[tuple[str, int, int]]):
    store = gradstore.open(path)
    rng = np.random.default_rng(0)
    for run, dim, n in runs:
        store.create_run(run, dim=dim)
        with store.writer(run, commit_rows=50_000) as writer:
            for start in range(0, n, 50_000):
                m = min(50_000, n - start)
                ids = [f"{run}-{i}" for i in range(start, start + m)]
                vectors = rng.standard_normal((m, dim), dtype=np.float32)
                writer.append(vectors, ids, split=["train"] * (m - 100) + ["query"] * 100, step=start // 1000)
    store.compact()
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gradstore-sql-dims-") as scratch:
        one = _store(Path(scratch) / "one", [("a", 64, args.rows)])
        two = _store(Path(scratch) / "two", [("a", 64, args.rows // 2), ("b", 32, args.rows // 2)])
        worst = 0.0
        for name, query in QUERIES.items():
            one.sql(query), two.sql(query)  # warm-up
            seconds: dict[str, list[float]] = {"one": [], "two": []}
            for round_ in range(args.rounds):
                arms = (("one", one), ("two", two)) if round_ % 2 == 0 else (("two", two), ("one", one))
                for arm, store in arms:
                    start = time.perf_counter()
                    store.sql(query).fetchall()
                    seconds[arm].append(time.perf_counter() - start)
            single, union = np.median(seconds["one"]), np.median(seconds["two"])
            ratio = float(np.median(np.array(seconds["two"]) / np.array(seconds["one"])))  # per round: paired
            worst = max(worst, ratio)
            print(f"{name:18s} one table {single * 1e3:7.1f} ms   two dims {union * 1e3:7.1f} ms   {ratio:.2f}x")
    verdict = "PASS" if worst <= TARGET else "MISS"
    print(f"RESULT sql_union_over_dims_ratio={worst:.2f} target<={TARGET} {verdict}")


if __name__ == "__main__":
    main()
