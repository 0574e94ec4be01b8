"""W-scale, real gradients: two-stage search (FAISS candidates + exact re-rank) against exact search on
gradients captured from a real model on real data.

The demo's tiny GPT (:mod:`gradstore.demo`: its bundled fact corpus, nothing downloaded) is trained for
``--epochs`` epochs inside ``store.capture``, so the store holds the per-example projected gradients of every
training example at every step of an ordinary training loop (checkpoint ``train``: epochs x examples rows),
and a checkpoint pass at the end captures the held-out questions (split ``query``). A per-layer Fisher index
over the ``train`` rows is searched with the questions, exactly and in two stages (``IVF<nlist>,SQ8`` over
the prepared rows, ``nlist`` about the square root of the rows, ``nprobe`` 1/32 of the lists, then the
``10 k`` best candidates re-scored exactly from the store): recall@10 of the two-stage and FAISS-alone lists
against exact search, and the two-stage time against a streaming exact scan (alternated). The store is
cached under the temp directory (``gradstore-ann-real-<places>x<epochs>``).

Ends with ``RESULT ann_recall_real=<recall@10> target>=0.95 PASS|MISS``; ``bench/scale.py`` prints the same
figures above its own RESULT line.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import gradstore
from gradstore.demo.corpus import build_corpus
from gradstore.demo.run import RUN, DemoConfig, train_under_capture
from gradstore.engine import LocalEngine
from gradstore.index import INDEXES
from gradstore.scans import top_k
from indexers import recall_at_k

K, RERANK = 10, 10


@dataclass(frozen=True)
class TwoStage:
    """Two-stage search against exact search over the same rows and queries."""

    kind: str
    nprobe: int
    rows: int
    queries: int
    recall: float  # two-stage recall@10 against exact
    alone: float  # FAISS-alone recall@10 against exact
    seconds: float  # two-stage search, median
    exact_seconds: float  # streaming exact scan, median (alternated with the two-stage search)
    build_seconds: float
    sweep: tuple[tuple[int, float], ...] = ()  # (nprobe, two-stage recall@10) at more lists probed

    def line(self, label: str) -> str:
        """One printed line."""
        return (
            f"two-stage on {label}: {self.rows:,} rows, {self.queries} queries, {self.kind} (nprobe {self.nprobe}) "
            f"+ exact re-rank of {RERANK * K} candidates: recall@10 {self.recall:.3f} (FAISS alone "
            f"{self.alone:.3f}); {self.seconds:.2f} s vs exact scan {self.exact_seconds:.2f} s: "
            f"{self.seconds / self.exact_seconds:.2f}; index build {self.build_seconds:.1f} s"
            + "".join(f"\n  two-stage recall@10 at nprobe {nprobe}: {recall:.3f}" for nprobe, recall in self.sweep)
        )


def ivf_kind(rows: int) -> tuple[str, int]:
    """``IVF<nlist>,SQ8`` with ``nlist`` the power of two nearest ``sqrt(rows)`` within [16, 256], and its
    nprobe (1/32 of the lists, at least 4). 256 lists at most: k-means of more centroids over thousands of
    dims (trained on ``64 nlist`` rows) takes many minutes on this 2-core machine."""
    nlist = min(256, max(16, 2 ** round(np.log2(np.sqrt(rows)))))
    return f"IVF{nlist},SQ8", max(4, nlist // 32)


def two_stage(
    store: gradstore.GradStore,
    run: str,
    checkpoint: str,
    queries: np.ndarray,
    rounds: int = 3,
    engine=None,
    kind: tuple[str, int] | None = None,
    sweep: bool = False,
) -> TwoStage:
    """Build the fisher two-stage index over ``run``/``checkpoint``'s training rows afresh (adding rows on
    ``engine``; ``kind``: factory and nprobe, default :func:`ivf_kind`) and time its search against a streaming
    exact top-k scan, alternated for ``rounds`` rounds; with ``sweep``, also the recall probing 4x and 16x
    the lists, and all of them."""
    rows = store.count(where=f"run_id = '{run}' AND checkpoint = '{checkpoint}' AND split = 'train'")
    factory, nprobe = kind or ivf_kind(rows)
    name = f"bench-two-stage-{factory.replace(',', '-')}"
    store.files.remove(INDEXES, name)  # built afresh (the fisher fit is reused when the store has it)
    start = time.perf_counter()
    ann = store.build_index(run, checkpoint=checkpoint, method="fisher", kind=factory, name=name, engine=engine)
    build = time.perf_counter() - start
    ann.faiss_index.nprobe = nprobe
    space, prepared = ann.space, ann.space.queries(queries)
    shards = ann.selection.shards(store, 1)
    exact_times, ann_times = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        exact_ids = top_k(LocalEngine(), shards, space, prepared, K)[True][1]
        exact_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        _, ann_ids = ann.search(queries, K, rerank=RERANK)
        ann_times.append(time.perf_counter() - start)
    probes = sorted({min(n, ann.faiss_index.nlist) for n in (4 * nprobe, 16 * nprobe, ann.faiss_index.nlist)})
    recalls = []
    for more in probes if sweep else ():
        ann.faiss_index.nprobe = more
        recalls.append((more, recall_at_k(ann.search(queries, K, rerank=RERANK)[1], exact_ids)))
    ann.faiss_index.nprobe = nprobe
    return TwoStage(
        kind=factory,
        nprobe=nprobe,
        rows=rows,
        queries=len(queries),
        recall=recall_at_k(ann_ids, exact_ids),
        alone=recall_at_k(ann.search(queries, K)[1], exact_ids),
        seconds=statistics.median(ann_times),
        exact_seconds=statistics.median(exact_times),
        build_seconds=build,
        sweep=tuple(recalls),
    )


def captured_store(places: int, epochs: int) -> tuple[gradstore.GradStore, str, np.ndarray]:
    """The cached store of the demo model's gradients (trained and captured on first use), the checkpoint
    holding the rows captured during training, and the held-out questions' gradients at the end."""
    path = Path(tempfile.gettempdir()) / f"gradstore-ann-real-{places}x{epochs}"
    config = DemoConfig(places=places, epochs=epochs, checkpoints=1)
    final = f"epoch-{epochs}"
    if not (path / "complete").exists():
        print(f"capturing the demo model's gradients ({places} places, {epochs} epochs) into {path}", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)  # an interrupted capture
        store = gradstore.open(path)
        corpus = build_corpus(config.places, config.phrasings, config.seed)
        examples = [{"example_id": e.example_id, "text": e.text} for e in corpus.train + corpus.queries]
        store.add_examples(pd.DataFrame(examples))
        train_under_capture(store, corpus, config, lambda message: print(message, file=sys.stderr))
        (path / "complete").write_text("ok")
    store = gradstore.open(path, create=False)
    return store, "train", store.read_gradients(RUN, checkpoint=final, split="query").vectors


def real_gradients(places: int = 64, epochs: int = 16, rounds: int = 3, engine=None) -> TwoStage:
    """The two-stage figures on the demo model's captured gradients."""
    store, checkpoint, queries = captured_store(places, epochs)
    return two_stage(store, RUN, checkpoint, queries, rounds, engine, sweep=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--places", type=int, default=64, help="demo corpus size (2 facts per place)")
    parser.add_argument("--epochs", type=int, default=16, help="training epochs captured")
    parser.add_argument("--rounds", type=int, default=3, help="alternated timing rounds")
    args = parser.parse_args()
    torch.set_num_threads(2)
    result = real_gradients(args.places, args.epochs, args.rounds)
    print(result.line("the demo model's captured gradients"))
    print(f"RESULT ann_recall_real={result.recall:.3f} target>=0.95 {'PASS' if result.recall >= 0.95 else 'MISS'}")


if __name__ == "__main__":
    main()
