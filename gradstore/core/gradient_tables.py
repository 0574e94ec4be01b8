"""Which Lance table holds a run's gradients: one table per vector dimension.

The vector column is a fixed-size list (a variable-length list column measured 1.15-1.5x slower to scan
and 3x slower to write), so one table holds vectors of one dim. The first dim a store sees gets the table
``gradients`` (every store made while a store held one dim has just that table, unchanged); every other dim
``D`` gets ``gradients_D``. A run's dim is in the ``runs`` table, so a run's table follows from its dim and
the dim of ``gradients``.

Creation is safe when several processes create runs of different dims at once: a process that finds no
``gradients`` table creates it in Lance's ``create`` mode (the first version commits only if none exists)
and then reads its dim again; if another process won with another dim, it creates ``gradients_D`` instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from gradstore.core import schema as S
from gradstore.core.vectors import storage_dtype_of

_DIM_TABLE = re.compile(rf"{S.GRADIENTS}_([1-9][0-9]*)")


def is_gradient_table(name: str) -> bool:
    """Whether ``name`` is the name of a gradient table (``gradients`` or ``gradients_<dim>``)."""
    return name == S.GRADIENTS or _DIM_TABLE.fullmatch(name) is not None


def table_dim(schema: pa.Schema) -> int:
    """The vector dimension of a gradient table's schema."""
    return schema.field(S.VECTOR_COLUMN).type.list_size


def table_name_for_dim(dim: int, primary_dim: int | None) -> str:
    """The table holding ``dim``-dimensional vectors when the ``gradients`` table holds ``primary_dim``-dimensional
    ones (``None``: no ``gradients`` table yet, so ``dim`` will get it)."""
    return S.GRADIENTS if primary_dim is None or primary_dim == dim else f"{S.GRADIENTS}_{dim}"


class GradientTables:
    """The gradient tables of one store: their names by dim, and race-safe creation.

    ``has_table(name)``, ``open_table(name)`` and ``create_table(name, schema)`` are the store's own
    (a table counts once its first version is committed; creation is idempotent)."""

    def __init__(
        self,
        has_table: Callable[[str], bool],
        open_table: Callable[[str], Any],
        create_table: Callable[[str, pa.Schema], Any],
        list_tables: Callable[[], list[str]],
    ) -> None:
        self._has_table = has_table
        self._open_table = open_table
        self._create_table = create_table
        self._list_tables = list_tables
        self._primary_dim: int | None = None  # the dim of ``gradients``: fixed once the table exists

    def primary_dim(self) -> int | None:
        """The dim of the ``gradients`` table (``None`` while the store has none)."""
        if self._primary_dim is None and self._has_table(S.GRADIENTS):
            self._primary_dim = table_dim(self._open_table(S.GRADIENTS).schema)
        return self._primary_dim

    def name_for_dim(self, dim: int) -> str:
        """The name of the table that holds (or will hold) ``dim``-dimensional vectors."""
        return table_name_for_dim(dim, self.primary_dim())

    def ensure(self, dim: int, storage_dtype: str) -> str:
        """Create the table for ``dim``-dimensional vectors if the store has none; return its name.

        ``storage_dtype`` applies to a new store's first table; later tables take the dtype of ``gradients``
        (one storage dtype per store)."""
        if self.primary_dim() is None:  # another process may create it first, with another dim: re-read below
            self._create_table(S.GRADIENTS, S.gradients_schema(dim, storage_dtype))
        name = self.name_for_dim(dim)
        if not self._has_table(name):
            stored = storage_dtype_of(self._open_table(S.GRADIENTS).schema.field(S.VECTOR_COLUMN))
            self._create_table(name, S.gradients_schema(dim, stored))
        return name

    def by_dim(self) -> dict[int, str]:
        """``dim -> table name`` of every gradient table the store holds, by dim."""
        primary = self.primary_dim()
        if primary is None:
            return {}
        found = {primary: S.GRADIENTS}
        for name in self._list_tables():
            match = _DIM_TABLE.fullmatch(name)
            if match and int(match.group(1)) != primary and self._has_table(name):
                found[int(match.group(1))] = name
        return dict(sorted(found.items()))
