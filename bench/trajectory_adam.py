"""Trajectory-aware attribution under Adam: raw rows against rows in Adam's geometry (``normalizer="adam_sqrt"``).

Protocol (everything on CPU, nothing downloaded): the fact-tracing task of ``gradstore demo`` (its corpus, tiny
GPT, tokenizer and AdamW training: 24 places, 12 phrasings, 24 epochs, batch 16, lr 3e-3, seed 0). The model is
trained twice, identically, each time under ``store.capture`` of every step (in-loop rows) with checkpoint
passes (training rows and the held-out questions) after epochs 8, 16 and 24: once with raw rows, once with
``normalizer="adam_sqrt"`` on every capture (rows divided by the factored Adam second moment to the power 1/4,
the coordinates where an Adam step is a gradient step at the learning rate, which is what ``source`` and
``dvemb`` model). For each variant and method (``tracin-steps`` also with final-model queries only):
fact-tracing recall@10 (the share of a question's top-10 training sentences that state its fact; all 48
questions), with BM25 on the same questions for reference.
Nothing is chosen: every method runs at its defaults, so there is no validation split to choose on.

Ends with ``RESULT tracin_steps_adam_sqrt_vs_raw=<recall ratio> target>=1.1 PASS|MISS``: whether capturing in
Adam's geometry makes TracIn over the training steps a better attributor than on raw rows.

Run: ``python bench/trajectory_adam.py`` (``--epochs 12`` for a quicker look).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import gradstore
from gradstore.demo.bm25 import BM25
from gradstore.demo.corpus import Corpus, Example, build_corpus
from gradstore.demo.model import TinyGPT, WordTokenizer
from gradstore.demo.table import fact_recall
from gradstore.errors import UnstableRecursionError

RUN = "facts"
METHODS = {  # label -> (method, options)
    "fisher": ("fisher", {"checkpoint": "final"}),
    "tracin": ("tracin", {}),
    "tracin-steps": ("tracin-steps", {}),
    "tracin-steps, final q": ("tracin-steps", {"query_checkpoint": "final"}),
    "source": ("source", {}),
    "dvemb": ("dvemb", {}),
}
TARGET = 1.1


def batches(examples: list[Example], size: int, rng: random.Random | None = None) -> list[list[Example]]:
    """``examples`` in batches of ``size`` (shuffled by ``rng`` when given)."""
    order = list(examples)
    if rng is not None:
        rng.shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def train(store: gradstore.GradStore, corpus: Corpus, epochs: int, normalizer: str | None) -> float:
    """The demo's training under capture of every step, with checkpoint passes at a third, two thirds and the
    end (the last named ``final``); returns the seconds it took."""
    began = time.perf_counter()
    torch.manual_seed(0)
    tokenizer = WordTokenizer([e.text for e in corpus.train + corpus.queries])
    model = TinyGPT(len(tokenizer.vocab), width=64, layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    options = {"normalizer": normalizer} if normalizer else {}
    rng = random.Random(0)
    passes = {round(epochs * i / 3): f"epoch-{round(epochs * i / 3)}" for i in (1, 2)} | {epochs: "final"}
    step = 0
    for epoch in range(1, epochs + 1):
        with store.capture(model, RUN, optimizer=optimizer, checkpoint="train", **options) as cap:
            cap.set_step(step)
            for batch in batches(corpus.train, 16, rng):
                inputs = tokenizer.batch([e.text for e in batch])
                model(**inputs, example_id=[e.example_id for e in batch]).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            step = cap.step
        if epoch in passes:
            model.eval()
            with store.capture(
                model, RUN, optimizer=optimizer, checkpoint=passes[epoch], learning_rate=3e-3, **options
            ) as cap:
                cap.set_step(step)
                for batch in batches(corpus.train, 16):
                    inputs = tokenizer.batch([e.text for e in batch])
                    model(**inputs, example_id=[e.example_id for e in batch]).loss.backward()
                    model.zero_grad()
                cap.set_split("query")
                for batch in batches(corpus.queries, 16):
                    inputs = tokenizer.batch([e.text for e in batch], targets=[e.answer for e in batch])
                    model(**inputs, example_id=[e.example_id for e in batch]).loss.backward()
                    model.zero_grad()
            model.train()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    corpus = build_corpus(24, 12, 0)
    fact_of = {e.example_id: e.fact_id for e in corpus.train}
    query_fact = {q.example_id: q.fact_id for q in corpus.queries}
    bm25 = BM25([e.text for e in corpus.train])
    lexical = {
        q.example_id: [corpus.train[i].example_id for i in np.argsort(-bm25.scores(q.text), kind="stable")[:10]]
        for q in corpus.queries
    }
    recalls: dict[tuple[str, str], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="gradstore-trajectory-adam-") as workdir:
        for normalizer in (None, "adam_sqrt"):
            name = normalizer or "raw"
            store = gradstore.open(Path(workdir) / name)
            seconds = train(store, corpus, args.epochs, normalizer)
            print(f"{name}: trained and captured in {seconds:.0f} s, {store.count()} rows", flush=True)
            for label, (method, options) in METHODS.items():
                began = time.perf_counter()
                try:
                    table = store.attribute(run=RUN, k=10, method=method, write=False, **options).to_pandas()
                except UnstableRecursionError as error:  # reported in the table, not a crash of the bench
                    print(f"{name} {label}: {error}", flush=True)
                    recalls[(name, label)] = (float("nan"), time.perf_counter() - began)
                    continue
                top = table.sort_values(["query_id", "rank"]).groupby("query_id").example_id.apply(list).to_dict()
                recalls[(name, label)] = (fact_recall(top, fact_of, query_fact), time.perf_counter() - began)
    print(f"\nfact-tracing recall@10, {len(corpus.queries)} questions (seconds to attribute all)")
    print(f"{'method':<22} {'raw rows':>16} {'adam_sqrt rows':>16}   (nan: the recursion overflowed, see above)")
    for label in METHODS:
        cells = [f"{recalls[(v, label)][0]:.3f} ({recalls[(v, label)][1]:.1f} s)" for v in ("raw", "adam_sqrt")]
        print(f"{label:<22} {cells[0]:>16} {cells[1]:>16}")
    print(f"{'bm25':<22} {fact_recall(lexical, fact_of, query_fact):>16.3f}")
    ratio = recalls[("adam_sqrt", "tracin-steps")][0] / max(recalls[("raw", "tracin-steps")][0], 1e-9)
    print(f"RESULT tracin_steps_adam_sqrt_vs_raw={ratio:.2f} target>={TARGET} {'PASS' if ratio >= TARGET else 'MISS'}")


if __name__ == "__main__":
    main()
