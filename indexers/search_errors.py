"""Errors raised by the search layer (``gradstore.errors`` re-raises them as its own ``IndexMismatchError``
and ``NotFittedError``, each also an instance of the class here)."""

from __future__ import annotations


class IndexMismatchError(ValueError):
    """A saved index or preconditioner was built from different data than the caller expects.

    ``differences`` maps each differing manifest key to ``(expected, found)``.
    """

    def __init__(self, differences: dict[str, tuple[object, object]]):
        self.differences = differences
        detail = "; ".join(f"{key}: expected {exp!r}, found {got!r}" for key, (exp, got) in differences.items())
        super().__init__(f"index manifest does not match the store ({', '.join(differences)}): {detail}")


class NotFittedError(RuntimeError):
    """A preconditioner was applied or saved before ``fit``."""
