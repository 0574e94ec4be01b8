"""Report at scale: `store.report` on a synthetic store of 100,000 training examples and 1,000 queries.

The store is built through the public API: 100k training rows and 1k query rows of random 16-dim vectors (``--side 4``),
examples with a ~100-character text and a ``source`` column, top-10 proponents and opponents of every query
(20k score rows), grad-dot self-influence of every training row and a 5% selection. Then the report (every
query listed) is written once and timed. Prints the gather/render split, then two RESULT lines: the file
size (target < 20 MB) and, last, the generation time (target < 30 s).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

import gradstore
from gradstore.answers.report import ReportOptions, gather, render
from ingest.projection import LayerSlot, ProjectionSpec

RUN = "bench"
WORDS = [
    "gradient",
    "store",
    "query",
    "model",
    "token",
    "river",
    "capital",
    "language",
    "city",
    "north",
    "wind",
    "grain",
    "wool",
    "market",
    "school",
    "book",
    "paper",
    "green",
    "rocky",
    "quiet",
]
SOURCES = ["web", "books", "code", "wiki", "forum", "news", "papers", "chat"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def texts(rng: np.random.Generator, n: int, words: int = 14) -> list[str]:
    picks = rng.integers(0, len(WORDS), size=(n, words))
    return [" ".join(WORDS[i] for i in row) for row in picks]


def build_store(path: Path, examples: int, queries: int, side: int, seed: int) -> gradstore.GradStore:
    """A store whose run holds random ``side**2``-dim rows (one exact linear layer, ``side`` outputs)."""
    rng = np.random.default_rng(seed)
    store = gradstore.open(path)
    dim = side * side
    layer = LayerSlot(
        name="fc",
        kind="linear",
        d_in=side - 1,
        d_out=side,
        k_in=None,
        k_out=None,
        mode="exact",
        offset=0,
        size=side * side,
        has_bias=True,
    )
    store.core.catalog.ensure_run(RUN, ProjectionSpec(seed=seed, kind="none", layers=(layer,)))
    store.record_checkpoint(RUN, "final", step=1, learning_rate=1e-3)
    train_ids = [f"ex-{i:06d}" for i in range(examples)]
    query_ids = [f"q-{i:04d}" for i in range(queries)]
    with store.writer(RUN) as writer:
        for start in range(0, examples, 20_000):
            ids = train_ids[start : start + 20_000]
            writer.append(
                rng.standard_normal((len(ids), dim), dtype=np.float32), ids, checkpoint="final", split="train"
            )
        writer.append(
            rng.standard_normal((queries, dim), dtype=np.float32), query_ids, checkpoint="final", split="query"
        )
    sources = rng.integers(0, len(SOURCES), examples + queries)
    store.add_examples(
        pd.DataFrame(
            {
                "example_id": train_ids + query_ids,
                "text": texts(rng, examples + queries),
                "source": [SOURCES[i] for i in sources],
            }
        )
    )
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1_000)
    parser.add_argument("--side", type=int, default=4, help="vectors have side**2 dimensions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="also copy the report here (to open it in a browser)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log(f"building a store of {args.examples} examples and {args.queries} queries")
        store = build_store(Path(tmp, "store"), args.examples, args.queries, args.side, args.seed)
        store.attribute(run=RUN, k=10, opponents=True, method="grad-dot")
        store.self_influence(run=RUN, method="grad-dot")
        selection = store.select(run=RUN, budget=0.05)
        log(
            f"scores {store.count('scores')} rows, self_influence {store.count('self_influence')} rows, "
            f"selection {selection.num_rows} rows"
        )
        out = Path(tmp, "report.html")
        start = time.perf_counter()
        data = gather(store, ReportOptions(run=RUN, max_queries=args.queries), selection)
        gathered = time.perf_counter()
        out.write_text(render(data), encoding="utf-8")
        seconds = time.perf_counter() - start
        size_mb = out.stat().st_size / 1e6
        if args.keep is not None:
            shutil.copyfile(out, args.keep)
    print(f"queries listed {len(data.queries)} of {data.queries_total}; texts {len(data.texts)}")
    print(f"gather {gathered - start:.2f} s, render+write {seconds - (gathered - start):.2f} s")
    print(f"report file {size_mb:.2f} MB (target < 20: {'PASS' if size_mb < 20 else 'MISS'})")
    passed = seconds < 30 and size_mb < 20
    print(f"RESULT report_seconds={seconds:.2f} target<30 {'PASS' if passed else 'MISS'}")


if __name__ == "__main__":
    main()
