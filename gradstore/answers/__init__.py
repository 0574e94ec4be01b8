"""Answers: what a user asks of the store, composed from methods and search: attribution (top-k proponents and
opponents, score matrices, self-influence), data selection, evaluation (LDS, QLD), per-token scores and the HTML
report."""
