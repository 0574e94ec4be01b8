"""``gradstore demo``: train a tiny GPT on synthetic facts under capture, then trace its answers to its data.

1. Build the fact corpus (:mod:`gradstore.demo.corpus`) and store it in ``examples``.
2. Train :class:`TinyGPT` with an ordinary PyTorch loop inside ``store.capture`` (every backward streams
   per-example projected gradients into the store).
3. Capture checkpoint passes over the training set and the held-out questions at a few checkpoints.
4. Attribute every question with several methods (single-checkpoint, over checkpoint passes, over the
   in-loop training steps; also on curvature-aware rows and, as TrackStar, on Adam-normalised rows of the
   trained model), print the top proponents of a few through SQL and the top tokens of their proponents
   (``token_scores``), and report fact-tracing recall@10 against a random and a BM25 baseline computed in the
   same run (:mod:`gradstore.demo.table`: every row names its method, checkpoints and dims; dampings and the
   best method are chosen on a validation half of the questions and reported on the other half).
5. Compute self-influence and a 10% LESS selection, and write ``report.html`` (:mod:`gradstore.answers.report`) into
   the store directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from gradstore.demo.bm25 import BM25
from gradstore.demo.corpus import Corpus, Example, build_corpus
from gradstore.demo.model import TinyGPT, WordTokenizer
from gradstore.demo.serve import save_model
from gradstore.demo.table import (
    BM25_LABEL,
    SPLITS,
    FactTracing,
    Row,
    best_row,
    query_halves,
    render,
    result_line,
)
from gradstore.methods import Method, resolve_method
from gradstore.methods.queries import QueryBatch
from gradstore.store import GradStore, open_store
from ingest.basis import estimate_basis, random_rows
from ingest.capture import ProjectionConfig
from ingest.projection import ProjectionBasis

RUN = "demo"
CURVATURE_RUN = "demo-curvature"
TRACKSTAR_RUN = "demo-trackstar"
TRAIN_CHECKPOINT = "train"  # the label of the rows captured in the training loop
DAMPINGS = (0.1, 0.01, 0.001)  # a damped method's grid; the damping is chosen on the validation half


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
    methods: tuple[str, ...] = ("grad-dot", "cosine", "fisher", "tracin", "tracin-steps", "dvemb", "source")
    shown_queries: int = 3
    seed: int = 0
    storage_dtype: str = "float16"  # the store's encoding (gradstore.core.vectors)


def _batches(examples: list[Example], size: int, rng: random.Random | None = None) -> list[list[Example]]:
    order = list(examples)
    if rng is not None:
        rng.shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _checkpoint_epochs(config: DemoConfig) -> list[int]:
    step = config.epochs / config.checkpoints
    return sorted({max(1, round(step * (i + 1))) for i in range(config.checkpoints)})


def _capture_pass(
    store: GradStore,
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
    store: GradStore, corpus: Corpus, config: DemoConfig, log: Callable[[str], None]
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
        with store.capture(model, RUN, optimizer=optimizer, checkpoint=TRAIN_CHECKPOINT) as cap:
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
    store: GradStore,
    model: TinyGPT,
    tokenizer: WordTokenizer,
    corpus: Corpus,
    config: DemoConfig,
    checkpoint: str,
) -> ProjectionBasis:
    """A checkpoint pass of the trained model into run ``demo-curvature`` with a curvature-aware projection:
    the per-layer basis of the training gradients (``estimate_basis``, ``factors="unit"``, its default
    ``layers`` and ``select``), same dims as the random projection of run ``demo``. Returns the basis."""
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
    return basis


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
    store: GradStore,
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


def eigen_sides(basis: ProjectionBasis, seed: int) -> int:
    """How many layer sides of ``basis`` hold eigenvectors (the others keep the seeded random rows)."""
    return sum(
        not np.array_equal(p, random_rows(seed, name, side, *p.shape))
        for name, pair in basis.matrices.items()
        for side, p in zip(("in", "out"), pair)
    )


def _where(method: Method, final: str, passes: list[str]) -> dict[str, Any]:
    """The checkpoint arguments of ``method``: every checkpoint pass (TracIn, SOURCE's segments), the in-loop
    rows (step TracIn, data value embeddings), the final checkpoint (the single-checkpoint methods) or none (an exact
    replay: the rows it replayed)."""
    if not method.reads_history:
        return {"checkpoint": final}
    if "checkpoints" in method.uses:
        return {"checkpoints": passes}
    return {"checkpoint": TRAIN_CHECKPOINT} if "checkpoint" in method.uses else {}  # replay: what it replayed


def _top(table: Any) -> dict[str, list[str]]:
    """Question id -> ranked example ids of an attribution table."""
    frame = table.to_pandas().sort_values(["query_id", "rank"])
    return frame.groupby("query_id").example_id.apply(list).to_dict()


def release_freed_memory() -> None:
    """Collect garbage and hand the memory freed since back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).
    Each attribution reads and fits hundreds of MB and frees them; glibc keeps freed blocks mapped in the arenas of
    the threads that freed them (Lance's, DuckDB's, torch's), so without this the job's peak RSS climbs ~20 MB an
    attribution (docs/benchmarks.md). Changes no allocator setting of the host process."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL(None).malloc_trim(0)


def attribution_row(
    store: GradStore,
    run: str,
    method_name: str,
    where: dict[str, Any],
    rows_note: str,
    judge: FactTracing,
    k: int,
    write: bool,
) -> Row:
    """Attribute every question with ``method_name`` on ``run`` and judge the top-``k`` lists. A damped method
    runs every damping of :data:`DAMPINGS` and keeps the one with the best validation recall (first on ties);
    ``write``: that choice's scores go to the ``scores`` table. The label names the method, the checkpoints,
    the dims and ``rows_note`` (what the rows are)."""
    method = resolve_method(method_name)
    grid: tuple[float | None, ...] = DAMPINGS if "damping" in method.uses else (None,)
    results = {}
    for damping in grid:
        options = {} if damping is None else {"damping": damping}
        results[damping] = judge.recalls(
            _top(store.attribute(run=run, k=k, method=method_name, write=False, **where, **options))
        )
        release_freed_memory()
    chosen = max(grid, key=lambda d: results[d]["validation"])
    if write:
        store.attribute(run=run, k=k, method=method_name, **where, **({} if chosen is None else {"damping": chosen}))
    if "checkpoints" in where:
        checkpoints = " + ".join(where["checkpoints"])
    elif where["checkpoint"] == TRAIN_CHECKPOINT:
        steps = store.sql(
            f"select count(distinct step) from gradients where run_id = '{run}' and checkpoint = '{TRAIN_CHECKPOINT}'"
        ).fetchall()[0][0]
        checkpoints = f"{steps} training steps (in-loop rows)"
    else:
        checkpoints = where["checkpoint"]
    label = f"{method_name} @ {checkpoints}, {store.core.run_dim(run):,} dims ({rows_note})"
    if chosen is not None:
        label += f", damping {chosen:g} (val)"
    return Row(label, method_name, results[chosen], written=write)


def recall_table(
    store: GradStore,
    model: TinyGPT,
    tokenizer: WordTokenizer,
    optimizer: torch.optim.Optimizer,
    corpus: Corpus,
    config: DemoConfig,
    halves: dict[str, set[str]],
) -> list[Row]:
    """The fact-tracing table: ``config.methods`` on run ``demo`` (scores written), fisher on a
    curvature-aware pass, TrackStar on an Adam-normalised pass (written), then BM25 and chance; recalls on
    the question ``halves`` (:func:`gradstore.demo.table.query_halves`)."""
    judge = FactTracing(
        {e.example_id: e.fact_id for e in corpus.train}, {q.example_id: q.fact_id for q in corpus.queries}, halves
    )
    final = f"epoch-{_checkpoint_epochs(config)[-1]}"
    passes = [f"epoch-{e}" for e in _checkpoint_epochs(config)]
    projection = ProjectionConfig()
    random_note = f"random LoGra {projection.k_in}x{projection.k_out}"
    rows: list[Row] = []
    for name in tqdm(config.methods, desc="attributing", unit="method"):
        where = _where(resolve_method(name), final, passes)
        rows.append(attribution_row(store, RUN, name, where, random_note, judge, config.k, write=True))

    basis = curvature_pass(store, model, tokenizer, corpus, config, final)
    curvature_note = (
        f"curvature-aware basis: eigenvectors on {eigen_sides(basis, projection.seed)} of "
        f"{2 * len(basis.matrices)} layer sides, random LoGra rows on the others"
    )
    where = {"checkpoint": final}
    rows.append(attribution_row(store, CURVATURE_RUN, "fisher", where, curvature_note, judge, config.k, write=False))

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
    note = f"{random_note}, Adam-normalised rows"
    rows.append(attribution_row(store, TRACKSTAR_RUN, "trackstar", where, note, judge, config.k, write=True))

    bm25 = BM25([e.text for e in corpus.train])
    train_ids = np.array([e.example_id for e in corpus.train])
    lexical = {
        q.example_id: train_ids[np.argsort(-bm25.scores(q.text), kind="stable")[: config.k]].tolist()
        for q in corpus.queries
    }
    statements = sum(fact == corpus.queries[0].fact_id for fact in judge.fact_of.values())
    chance = dict.fromkeys(SPLITS, statements / len(corpus.train))
    return [*rows, Row(BM25_LABEL, None, judge.recalls(lexical)), Row("random (chance)", None, chance)]


def run_demo(
    store_dir: str | Path = "gradstore-demo", config: DemoConfig | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the whole job into a fresh store at ``store_dir``; print a report and return the summary."""
    config = config or DemoConfig()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    store_dir = Path(store_dir)
    if store_dir.exists() and any(store_dir.iterdir()):
        open_store(store_dir, create=False)  # refuse to wipe something that is not a store
        import shutil

        shutil.rmtree(store_dir)
    store = open_store(store_dir, storage_dtype=config.storage_dtype)
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
    release_freed_memory()
    save_model(store_dir, model, tokenizer, config.width, config.layers)  # for gradstore serve --model
    log(f"held-out phrasings answered correctly: {answer_accuracy(model, tokenizer, corpus):.2f}")
    counts = store.sql("select checkpoint, split, count(*) as n from gradients group by 1, 2 order by 1, 2").df()
    log(
        f"store: {store.count()} gradient rows of {store.core.run_dim(RUN)} dims ({store.storage_dtype})\n"
        + counts.to_string(index=False)
    )

    final = f"epoch-{_checkpoint_epochs(config)[-1]}"
    halves = query_halves({q.example_id: q.fact_id.split(".")[0] for q in corpus.queries})  # by place
    rows = recall_table(store, model, tokenizer, optimizer, corpus, config, halves)
    shown = [q.example_id for q in corpus.queries[: config.shown_queries]]
    best = best_row(rows, written=True)  # the scores table holds one row set per method
    for query_id in shown:
        question = next(f"{q.text}   (scored on '{q.answer}')" for q in corpus.queries if q.example_id == query_id)
        proponents = store.sql(
            f"select rank, round(score, 4) as score, text from top_proponents('{query_id}', 5) "
            f"where method = '{best.method}' order by rank"
        ).df()
        log(f"\n{question}\n  top proponents ({best.label}):\n" + proponents.to_string(index=False))

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

    log("\n" + "\n".join(render(rows, config.k, halves)))
    ratio, result = result_line(rows)
    log(result)

    store.self_influence(run=RUN, method="fisher", checkpoint=final)
    selection = store.select(run=RUN, budget=0.1)
    report = store.report(store_dir / "report.html", run=RUN, selection=selection).resolve()
    log(f"\nreport (open in a browser; self-influence outliers and a 10% data selection included):\n{report}")
    return {
        "table": rows,
        "best_vs_bm25": ratio,
        "rows": store.count(),
        "dim": store.core.run_dim(RUN),
        "store": str(store_dir),
        "best_method": best_row(rows).method,
        "report": str(report),
    }
