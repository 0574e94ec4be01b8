"""The demo's fact-tracing table: recall@k per row, on validation and test halves of the questions.

Every row says what it computed (method, checkpoints, dims, rows). Anything the demo chooses (a damping, the
best method) is chosen on the *validation* half of the questions and reported on the *test* half: the places
are split in two (even / odd index), so each half holds both facts (capital, language) of its places.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Recall columns of every row: all questions, the validation half (choices), the test half (reported).
SPLITS = ("all", "validation", "test")
#: The label of the lexical baseline's row, the denominator of the RESULT line.
BM25_LABEL = "bm25 (lexical baseline)"
#: The target of ``RESULT demo_best_vs_bm25``: the best method's test recall over BM25's (issue 29).
TARGET_VS_BM25 = 2.0


@dataclass(frozen=True)
class Row:
    """One row of the table: its label (what was computed), the registry method (``None`` for a baseline)
    and its recall on each of :data:`SPLITS`."""

    label: str
    method: str | None
    recall: dict[str, float]
    written: bool = False  # its scores are in the store's ``scores`` table (the SQL macros read them)


def query_halves(place_of: dict[str, str]) -> dict[str, set[str]]:
    """The question ids of each of :data:`SPLITS`, from each question's place: the places in order of first
    appearance, even ones validation, odd ones test."""
    places = list(dict.fromkeys(place_of.values()))
    validation = {q for q, p in place_of.items() if places.index(p) % 2 == 0}
    return {"all": set(place_of), "validation": validation, "test": set(place_of) - validation}


def fact_recall(top: dict[str, list[str]], fact_of: dict[str, str | None], query_fact: dict[str, str]) -> float:
    """Mean over queries of the share of their top list that states the queried fact."""
    shares = [np.mean([fact_of[e] == query_fact[q] for e in ids]) for q, ids in top.items() if ids]
    return float(np.mean(shares))


@dataclass(frozen=True)
class FactTracing:
    """What a top list is judged against: each training example's fact, each question's, the halves."""

    fact_of: dict[str, str | None]
    query_fact: dict[str, str]
    halves: dict[str, set[str]]

    def recalls(self, top: dict[str, list[str]]) -> dict[str, float]:
        """:func:`fact_recall` of ``top`` (question id -> ranked example ids) on each of :data:`SPLITS`."""
        return {
            split: fact_recall({q: top[q] for q in self.halves[split]}, self.fact_of, self.query_fact)
            for split in SPLITS
        }


def best_row(rows: list[Row], written: bool = False) -> Row:
    """The attribution row (a registry method; ``written``: one whose scores are in the store) with the best
    validation recall (first one on ties)."""
    candidates = [row for row in rows if row.method is not None and (row.written or not written)]
    return max(candidates, key=lambda row: row.recall["validation"])


def render(rows: list[Row], k: int, halves: dict[str, set[str]]) -> list[str]:
    """The printed table: one line per row, recall@k on all questions and on each half."""
    sizes = {split: len(halves[split]) for split in SPLITS}
    lines = [
        f"fact-tracing recall@{k} (share of a question's top-{k} that state its fact) on all {sizes['all']} "
        f"questions, the validation half ({sizes['validation']}, used for every choice) and the test half "
        f"({sizes['test']}):",
        "     all    val   test  row",
    ]
    for row in rows:
        lines.append("  " + " ".join(f"{row.recall[split]:6.3f}" for split in SPLITS) + f"  {row.label}")
    return lines


def result_line(rows: list[Row]) -> tuple[float, str]:
    """``RESULT demo_best_vs_bm25=<test recall of the best row / BM25's> target>=2 PASS|MISS`` and its value;
    the best row is chosen on validation recall (:func:`best_row`), BM25's row is :data:`BM25_LABEL`."""
    best, bm25 = best_row(rows), next(row for row in rows if row.label == BM25_LABEL)
    value = best.recall["test"] / bm25.recall["test"]
    verdict = "PASS" if value >= TARGET_VS_BM25 else "MISS"
    line = (
        f"best on the validation half: {best.label} (test recall {best.recall['test']:.3f}, BM25 "
        f"{bm25.recall['test']:.3f})\nRESULT demo_best_vs_bm25={value:.3f} target>={TARGET_VS_BM25:g} {verdict}"
    )
    return value, line
