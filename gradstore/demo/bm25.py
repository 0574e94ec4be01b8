"""Okapi BM25 over whitespace tokens: the lexical baseline the demo compares attribution with."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


class BM25:
    """BM25 scores of documents for a query (``k1`` term saturation, ``b`` length normalisation)."""

    def __init__(self, documents: list[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.terms = [Counter(doc.split()) for doc in documents]
        self.lengths = np.array([sum(t.values()) for t in self.terms], dtype=np.float64)
        self.mean_length = float(self.lengths.mean())
        frequency = Counter(term for terms in self.terms for term in terms)
        n = len(documents)
        self.idf = {term: math.log(1 + (n - df + 0.5) / (df + 0.5)) for term, df in frequency.items()}

    def scores(self, query: str) -> np.ndarray:
        """The BM25 score of every document for ``query``."""
        scores = np.zeros(len(self.terms))
        norm = self.k1 * (1 - self.b + self.b * self.lengths / self.mean_length)
        for term in set(query.split()):
            if term not in self.idf:
                continue
            tf = np.array([terms.get(term, 0) for terms in self.terms], dtype=np.float64)
            scores += self.idf[term] * tf * (self.k1 + 1) / (tf + norm)
        return scores
