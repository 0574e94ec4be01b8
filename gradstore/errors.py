"""Errors raised by the store. Each names what was wrong and what to do about it."""

from __future__ import annotations


class GradstoreError(Exception):
    """Base class of every error gradstore raises on purpose."""


class NotAStoreError(GradstoreError, FileNotFoundError):
    """The path exists but is not a gradstore store (or does not exist and creation was not allowed)."""


class StoreCorruptError(GradstoreError):
    """A store table exists but cannot be read (damaged files, foreign schema)."""


class SchemaMismatchError(GradstoreError, ValueError):
    """Appended data does not match the table's schema (missing columns, wrong types or dimensions)."""


class NonFiniteGradientError(GradstoreError, ValueError):
    """A gradient row holds NaN or Inf. The rows are rejected; nothing of the batch is written."""


class UnknownRunError(GradstoreError, KeyError):
    """A run id that the store does not hold."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class MissingIdsError(GradstoreError, KeyError):
    """Example or query ids that the store does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SQLError(GradstoreError, ValueError):
    """A SQL query failed (DuckDB's message) or tried to modify the store."""


class WriterClosedError(GradstoreError, RuntimeError):
    """Rows appended to a writer that was closed, or whose background commit failed."""
