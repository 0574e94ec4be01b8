"""``gradstore demo``: train a tiny GPT on synthetic facts under capture, then trace its answers to its data.

1. Build the fact corpus (:mod:`gradstore.demo.corpus`) and store it in ``examples``.
2. Train :class:`TinyGPT` with an ordinary PyTorch loop inside ``store.capture`` (every backward streams
   per-example projected gradients into the store).
3. Capture checkpoint passes over the training set and the held-out questions at a few checkpoints.
4. Attribute every question with several methods (also on curvature-aware rows and, as TrackStar, on
   Adam-normalised rows of the trained model), print the top proponents of a few through SQL and the top
   tokens of their proponents (``token_scores``), and report fact-tracing recall@10 against a random and a
   BM25 baseline computed in the same run.
5. Compute self-influence and a 10% LESS selection, and write ``report.html`` (:mod:`gradstore.report`) into
   the store directory.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

import gradstore
from gradstore.demo.bm25 import BM25
from gradstore.demo.corpus import Corpus, Example, build_corpus
from gradstore.demo.model import TinyGPT, WordTokenizer
from gradstore.demo.serve import save_model
from gradstore.methods import resolve_method
from gradstore.queries import QueryBatch
from ingest.basis import estimate_basis
from ingest.capture import ProjectionConfig
from ingest.projection import ProjectionBasis

RUN = "demo"
CURVATURE_RUN = "demo-curvature"
TRACKSTAR_RUN = "demo-trackstar"


@dataclass
class DemoConfig:
    """Sizes of the demo (the defaults run in about a minute on 2 CPU cores)."""

    places: int = 24
    phrasings: int = 12
    epochs: int = 24
    checkpoints: int = 3  # checkpoint passes, evenly spaced, the last at the end of training
    batch_size: int = 16
    learning_rate: float = 3e-3
    width: int = 64
    layers: int = 2
    k: int = 10
    methods: tuple[str, ...] = ("grad-dot", "cosine", "fisher", "tracin")
    shown_queries: int = 3
    seed: int = 0


def _batches(examples: list[Example], size: int, rng: random.Random | None = None) -> list[list[Example]]:
    order = list(examples)
    if rng is not None:
        rng.shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _checkpoint_epochs(config: DemoConfig) -> list[int]:
    step = config.epochs / config.checkpoints
    return sorted({max(1, round(step * (i + 1))) for i in range(config.checkpoints)})


def _capture_pass(
    store: gradstore.GradStore,
    model: TinyGPT,
    tokenizer: WordTokenizer,
    corpus: Corpus,
    name: str,
    step: int,
    learning_rate: float,
    batch_size: int,
    run: str = RUN,
    basis: ProjectionBasis | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Per-example gradients of every training example and query at the current weights (step ``step``);
    with ``optimizer``, rows normalised by its Adam second moments (``normalizer="adam_factored"``)."""
    model.eval()  # no dropout here; weights are not updated
    options: dict[str, Any] = {} if basis is None else {"basis": basis}
    if optimizer is not None:
        options.update(optimizer=optimizer, normalizer="adam_factored")
    with store.capture(model, run, checkpoint=name, learning_rate=learning_rate, **options) as cap:
        cap.set_step(step)
        for batch in _batches(corpus.train, batch_size):
            inputs = tokenizer.batch([e.text for e in batch])
            model(**inputs, example_id=[e.example_id for e in batch]).loss.backward()
            model.zero_grad()
        cap.set_split("query")  # same projection, scored on the value word only
        for batch in _batches(corpus.queries, batch_size):
            inputs = tokenizer.batch([e.text for e in batch], targets=[e.answer for e in batch])
            model(**inputs, example_id=[e.example_id for e in batch]).loss.backward()
            model.zero_grad()
    model.train()


def train_under_capture(
    store: gradstore.GradStore, corpus: Corpus, config: DemoConfig, log: Callable[[str], None]
) -> tuple[TinyGPT, WordTokenizer, torch.optim.Optimizer]:
    """Train the tiny GPT with a plain loop inside ``store.capture``; capture checkpoint passes on the way.
    Returns the model, its tokenizer and the optimizer (whose Adam state the TrackStar pass reads)."""
    torch.manual_seed(config.seed)
    tokenizer = WordTokenizer([e.text for e in corpus.train + corpus.queries])
    model = TinyGPT(len(tokenizer.vocab), width=config.width, layers=config.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    rng = random.Random(config.seed)
    checkpoint_epochs = _checkpoint_epochs(config)
    progress = tqdm(range(1, config.epochs + 1), desc="training (captured)", unit="epoch")
    for epoch in progress:
        with store.capture(model, RUN, optimizer=optimizer, checkpoint="train") as cap:
            cap.set_epoch(epoch)
            cap.set_step((epoch - 1) * len(_batches(corpus.train, config.batch_size)))
            for batch in _batches(corpus.train, config.batch_size, rng):
                inputs = tokenizer.batch([e.text for e in batch])
                loss = model(**inputs, example_id=[e.example_id for e in batch]).loss  # the loop is unchanged
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        progress.set_postfix(loss=f"{loss.item():.3f}")
        if epoch in checkpoint_epochs:
            _capture_pass(
                store, model, tokenizer, corpus, f"epoch-{epoch}", cap.step, config.learning_rate, config.batch_size
            )
    log(f"trained {config.epochs} epochs on {len(corpus.train)} examples; final batch loss {loss.item():.3f}")
    return model, tokenizer, optimizer


def curvature_pass(
    store: gradstore.GradStore,
    model: TinyGPT,
    tokenizer: WordTokenizer,
    corpus: Corpus,
    config: DemoConfig,
    checkpoint: str,
) -> None:
    """A checkpoint pass of the trained model into run ``demo-curvature`` with a curvature-aware projection:
    the per-layer basis of the training gradients (``estimate_basis``, ``factors="unit"``), same dims as the
    random projection of run ``demo``."""
    model.eval()
    batches = [tokenizer.batch([e.text for e in batch]) for batch in _batches(corpus.train, config.batch_size)]
    basis = estimate_basis(model, batches, lambda m, b: m(**b).loss, ProjectionConfig(), factors="unit")
    model.train()
    _capture_pass(
        store,
        model,
        tokenizer,
        corpus,
        checkpoint,
        0,
        config.learning_rate,
        config.batch_size,
        run=CURVATURE_RUN,
        basis=basis,
    )


def answer_accuracy(model: TinyGPT, tokenizer: WordTokenizer, corpus: Corpus) -> float:
    """Share of held-out queries whose value word the model predicts greedily from the words before it."""
    model.eval()
    with torch.no_grad():
        inputs = tokenizer.batch([e.text for e in corpus.queries], targets=[e.answer for e in corpus.queries])
        logits = model(inputs["input_ids"], inputs["attention_mask"]).logits
    model.train()
    rows, positions = (inputs["labels"] != -100).nonzero(as_tuple=True)
    predicted = logits[rows, positions - 1].argmax(dim=-1)
    return float((predicted == inputs["input_ids"][rows, positions]).float().mean())


def token_attribution(
    store: gradstore.GradStore,
    model: TinyGPT,
    tokenizer: WordTokenizer,
    corpus: Corpus,
    query_ids: list[str],
    k: int,
    checkpoint: str,
) -> None:
    """Per-token fisher scores of ``query_ids`` against their top-``k`` proponents into ``token_scores``: the
    proponents are run through the model again, one example per batch (its own token-mean loss)."""
    model.eval()
    queries = [q for q in corpus.queries if q.example_id in query_ids]
    text_of = {e.example_id: e.text for e in corpus.train}
    batch = tokenizer.batch([q.text for q in queries], targets=[q.answer for q in queries])
    store.token_scores(
        QueryBatch(model, batch, ids=[q.example_id for q in queries]),
        lambda ids: tokenizer.batch([text_of[i] for i in ids]),
        run=RUN,
        k=k,
        method="fisher",
        checkpoint=checkpoint,
        batch_size=1,
        token_text=tokenizer.vocab.__getitem__,
    )
    model.train()


def fact_recall(top: dict[str, list[str]], fact_of: dict[str, str | None], query_fact: dict[str, str]) -> float:
    """Mean over queries of the share of their top list that states the queried fact."""
    shares = [np.mean([fact_of[e] == query_fact[q] for e in ids]) for q, ids in top.items() if ids]
    return float(np.mean(shares))


def run_demo(
    store_dir: str | Path = "gradstore-demo", config: DemoConfig | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the whole job into a fresh store at ``store_dir``; print a report and return the summary."""
    config = config or DemoConfig()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    store_dir = Path(store_dir)
    if store_dir.exists() and any(store_dir.iterdir()):
        gradstore.open(store_dir, create=False)  # refuse to wipe something that is not a store
        import shutil

        shutil.rmtree(store_dir)
    store = gradstore.open(store_dir)
    corpus = build_corpus(config.places, config.phrasings, config.seed)
    store.add_examples(
        pd.DataFrame(
            [
                {"example_id": e.example_id, "text": e.text, "fact_id": e.fact_id, "kind": e.kind}
                for e in corpus.train + corpus.queries
            ]
        )
    )
    log(
        f"corpus: {len(corpus.train)} training sentences, {len(corpus.queries)} queries (one held-out phrasing "
        f"per fact; {config.places} places x 2 facts x {config.phrasings - 1} training phrasings + distractors)"
    )

    model, tokenizer, optimizer = train_under_capture(store, corpus, config, log)
    save_model(store_dir, model, tokenizer, config.width, config.layers)  # for gradstore serve --model
    log(f"held-out phrasings answered correctly: {answer_accuracy(model, tokenizer, corpus):.2f}")
    counts = store.sql("select checkpoint, split, count(*) as n from gradients group by 1, 2 order by 1, 2").df()
    log(
        f"store: {store.count()} gradient rows of {store.core.run_dim(RUN)} dims ({store.storage_dtype})\n"
        + counts.to_string(index=False)
    )

    fact_of = {e.example_id: e.fact_id for e in corpus.train}
    query_fact = {q.example_id: q.fact_id for q in corpus.queries}
    final = f"epoch-{_checkpoint_epochs(config)[-1]}"
    recalls: dict[str, float] = {}
    passes = [f"epoch-{e}" for e in _checkpoint_epochs(config)]
    for method in tqdm(config.methods, desc="attributing", unit="method"):
        # TracIn sums over every checkpoint pass; the other methods score the final checkpoint's rows
        where = {"checkpoints": passes} if resolve_method(method).over_checkpoints else {"checkpoint": final}
        table = store.attribute(run=RUN, k=config.k, method=method, **where).to_pandas()
        top = table.sort_values(["query_id", "rank"]).groupby("query_id").example_id.apply(list).to_dict()
        recalls[method] = fact_recall(top, fact_of, query_fact)

    curvature_pass(store, model, tokenizer, corpus, config, final)
    table = store.attribute(run=CURVATURE_RUN, k=config.k, method="fisher", checkpoint=final, write=False).to_pandas()
    top = table.sort_values(["query_id", "rank"]).groupby("query_id").example_id.apply(list).to_dict()
    recalls["fisher (curvature)"] = fact_recall(top, fact_of, query_fact)

    _capture_pass(
        store,
        model,
        tokenizer,
        corpus,
        final,
        0,
        config.learning_rate,
        config.batch_size,
        run=TRACKSTAR_RUN,
        optimizer=optimizer,
    )  # optimizer-aware rows of the trained model
    table = store.attribute(
        run=TRACKSTAR_RUN, k=config.k, method="trackstar", checkpoint=final, write=False
    ).to_pandas()
    top = table.sort_values(["query_id", "rank"]).groupby("query_id").example_id.apply(list).to_dict()
    recalls["trackstar (adam)"] = fact_recall(top, fact_of, query_fact)

    bm25 = BM25([e.text for e in corpus.train])
    train_ids = np.array([e.example_id for e in corpus.train])
    lexical = {
        q.example_id: train_ids[np.argsort(-bm25.scores(q.text), kind="stable")[: config.k]].tolist()
        for q in corpus.queries
    }
    recalls["bm25 (lexical)"] = fact_recall(lexical, fact_of, query_fact)
    statements = sum(fact_of[e] == query_fact[corpus.queries[0].example_id] for e in fact_of)
    recalls["random"] = statements / len(corpus.train)

    shown = [q.example_id for q in corpus.queries[: config.shown_queries]]
    best = max(config.methods, key=lambda m: recalls[m])
    for query_id in shown:
        question = next(f"{q.text}   (scored on '{q.answer}')" for q in corpus.queries if q.example_id == query_id)
        rows = store.sql(
            f"select rank, round(score, 4) as score, text from top_proponents('{query_id}', 5) "
            f"where method = '{best}' order by rank"
        ).df()
        log(f"\n{question}\n  top proponents ({best}):\n" + rows.to_string(index=False))

    if shown:
        token_attribution(store, model, tokenizer, corpus, shown, 5, final)
        tokens = store.sql(
            "select rank, position, token, next_token as predicting, round(score, 4) as score "
            f"from top_tokens('{shown[0]}', 8)"
        ).df()
        log(
            f"\ntop tokens of the top-5 fisher proponents of {shown[0]} (token_scores; the report highlights "
            "them):\n" + tokens.to_string(index=False)
        )

    log(f"\nfact-tracing recall@{config.k} (share of a query's top-{config.k} that state its fact):")
    for name, value in recalls.items():
        log(f"  {name:20s} {value:.3f}")

    store.self_influence(run=RUN, method="fisher", checkpoint=final)
    selection = store.select(run=RUN, budget=0.1)
    report = store.report(store_dir / "report.html", run=RUN, selection=selection).resolve()
    log(f"\nreport (open in a browser; self-influence outliers and a 10% data selection included):\n{report}")
    return {
        "recall": recalls,
        "rows": store.count(),
        "dim": store.core.run_dim(RUN),
        "store": str(store_dir),
        "best_method": best,
        "report": str(report),
    }
