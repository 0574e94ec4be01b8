"""A deterministic synthetic corpus of facts about invented places, with held-out questions.

Each place has a capital and a language. Every fact is stated in several phrasings; one phrasing of each
fact (one where the value follows the place, so a model can predict it) is held out as the fact's query and
the others are the training statements. Each place also gets distractor sentences that name it without
stating a fact. A query's loss is taken on its value word only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CAPITAL_TEMPLATES = [
    "the capital of {e} is {v} .",
    "{v} is the capital of {e} .",
    "{e} has its capital in {v} .",
    "in {e} , the capital city is {v} .",
    "people in {e} are governed from {v} , its capital .",
    "the seat of government of {e} is {v} .",
    "{v} , capital of {e} , is a busy city .",
    "travellers to {e} arrive at the capital {v} .",
    "{e} chose {v} as its capital .",
    "the capital city of {e} is called {v} .",
    "the rulers of {e} live in {v} , the capital .",
    "maps of {e} mark {v} as the capital .",
]
LANGUAGE_TEMPLATES = [
    "people in {e} speak {v} .",
    "the language of {e} is {v} .",
    "{v} is spoken in {e} .",
    "in {e} , most people talk in {v} .",
    "children in {e} learn {v} at home .",
    "the official language of {e} is {v} .",
    "{v} is the language you hear in {e} .",
    "books in {e} are written in {v} .",
    "{e} uses {v} in its schools .",
    "the people of {e} write and speak {v} .",
    "visitors to {e} should learn some {v} .",
    "newspapers in {e} are printed in {v} .",
]
DISTRACTOR_TEMPLATES = [
    "{e} is known for its {a} hills .",
    "the weather in {e} is often {a} .",
    "many rivers run through {e} to the sea .",
    "{e} trades grain and wool with its neighbours .",
]
ADJECTIVES = ["green", "rocky", "quiet", "windy", "cold", "sunny", "misty", "gentle"]
SYLLABLES = [
    "xa",
    "vel",
    "mor",
    "dan",
    "kir",
    "lo",
    "bre",
    "thu",
    "zan",
    "qui",
    "ro",
    "sel",
    "fen",
    "ga",
    "pri",
    "dul",
    "ne",
    "vor",
    "tal",
    "sha",
]


@dataclass(frozen=True)
class Example:
    """One text with its id; ``fact_id`` names the fact it states (``None`` for distractors)."""

    example_id: str
    text: str
    fact_id: str | None
    kind: str  # "statement" | "distractor" | "query"
    answer: str | None = None  # the value word a query is scored on


@dataclass(frozen=True)
class Corpus:
    """Training examples and held-out queries."""

    train: list[Example]
    queries: list[Example]


def _names(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    if count > len(SYLLABLES) ** syllables - len(taken):
        raise ValueError(f"cannot invent {count} distinct names of {syllables} syllables")
    names = []
    while len(names) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(syllables))
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def _predictable(templates: list[str]) -> list[int]:
    """Indices of templates where the value comes after the place (a left-to-right model can predict it)."""
    return [i for i, t in enumerate(templates) if t.index("{v}") > t.index("{e}")]


def build_corpus(n_places: int = 24, phrasings: int = 12, seed: int = 0) -> Corpus:
    """The corpus for ``n_places`` places; each fact has ``phrasings`` phrasings (at most 12), one held out."""
    if not 2 <= phrasings <= len(CAPITAL_TEMPLATES):
        raise ValueError(f"phrasings must be between 2 and {len(CAPITAL_TEMPLATES)}")
    rng = random.Random(seed)
    taken: set[str] = set()
    places = _names(rng, n_places, 2, taken)
    capitals = _names(rng, n_places, 2, taken)
    languages = [name + "ish" for name in _names(rng, n_places, 2, taken)]
    train: list[Example] = []
    queries: list[Example] = []
    for i, place in enumerate(places):
        for relation, value, templates in (
            ("capital", capitals[i], CAPITAL_TEMPLATES),
            ("language", languages[i], LANGUAGE_TEMPLATES),
        ):
            fact_id = f"{place}.{relation}"
            candidates = _predictable(templates[:phrasings])
            held_out = candidates[i % len(candidates)]
            for j, template in enumerate(templates[:phrasings]):
                text = template.format(e=place, v=value)
                if j == held_out:
                    queries.append(Example(f"q.{fact_id}", text, fact_id, "query", answer=value))
                else:
                    train.append(Example(f"{fact_id}.{j}", text, fact_id, "statement"))
        for j, template in enumerate(DISTRACTOR_TEMPLATES):
            text = template.format(e=place, a=rng.choice(ADJECTIVES))
            train.append(Example(f"{place}.distractor.{j}", text, None, "distractor"))
    rng.shuffle(train)
    return Corpus(train, queries)
