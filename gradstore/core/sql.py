"""Read-only DuckDB SQL over the store's tables.

Each Lance table is exposed to DuckDB as a lazily scanned Arrow dataset *without* its vector columns
(DuckDB's Arrow scan refuses float16 columns, and vectors do not belong in SQL anyway); projections and
filters are pushed down into Lance, so nothing is loaded that a query does not touch. Lance cannot take
filters on ``large_string``/``large_binary`` columns (what pandas 3 produces in ``examples``), so on tables
holding such columns a filter is applied by Arrow to Lance's projected scan instead. Only read
statements are accepted: a query cannot modify, drop or export store tables. A query runs to completion
inside :func:`run_query` (its result is materialized as Arrow), so every failure, also one that only
shows while rows are produced (``CAST('abc' AS INTEGER)``), is a ``SQLError`` with DuckDB's message (or, for a
shipped macro the store does not define, what it needs: :func:`undefined_macro`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import duckdb
import lance
import pyarrow as pa
import pyarrow.dataset as pads

from gradstore.core.gradient_tables import is_gradient_table
from gradstore.core.macros import UNDEFINED_MACROS, macros_for
from gradstore.core.schema import GRADIENTS, LAZY_SCHEMAS
from gradstore.core.tables import Tables
from gradstore.errors import SQLError

_READ_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
_HIDDEN_COLUMNS: tuple[str, ...] = ("grad",)
_UNKNOWN_TABLE_FUNCTION = re.compile(r"Table Function with name (\w+) does not exist")


class VectorlessLanceView(lance.LanceDataset):
    """A Lance dataset whose Arrow schema hides the vector columns, for DuckDB's Arrow scan."""

    @property
    def schema(self) -> pa.Schema:  # type: ignore[override]
        full = super().schema
        return pa.schema([f for f in full if f.name not in _HIDDEN_COLUMNS], metadata=full.metadata)

    def scanner(self, columns=None, filter=None, **kwargs):  # type: ignore[override]
        columns = columns if columns is not None else self.schema.names
        if filter is None or not any(_is_large(f.type) for f in self.schema):
            return super().scanner(columns=columns, filter=filter, **kwargs)
        # Lance's pushdown cannot take this filter: Arrow applies it to the scan of every visible column
        scan = super().scanner(columns=self.schema.names, **kwargs)
        return pads.Scanner.from_batches(scan.to_reader(), columns=columns, filter=filter)


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _is_large(data_type: pa.DataType) -> bool:
    return (
        pa.types.is_large_string(data_type) or pa.types.is_large_binary(data_type) or pa.types.is_large_list(data_type)
    )


def connect(
    tables: Mapping[str, lance.LanceDataset],
    macros: Iterable[str] = (),
    storage_options: dict[str, str] | None = None,
    unions: Mapping[str, Sequence[str]] | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with one view per store table, one view per entry of ``unions`` (name -> the
    tables whose rows it lists, ``UNION ALL BY NAME``) and the given macro definitions. A table created on first
    use (``skipped_steps``) that the store does not hold yet is an empty view."""
    con = duckdb.connect()
    for name, dataset in tables.items():
        view = VectorlessLanceView(dataset.uri, version=dataset.version, storage_options=storage_options)
        con.register(name, view)
    for name, schema in LAZY_SCHEMAS.items():
        if name not in tables:
            con.register(name, schema.empty_table())
    for name, parts in (unions or {}).items():
        union = " UNION ALL BY NAME ".join(f"SELECT * FROM {_identifier(part)}" for part in parts)
        con.execute(f"CREATE VIEW {_identifier(name)} AS {union}")
    for macro in macros:
        con.execute(macro)
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run_query(con: duckdb.DuckDBPyConnection, query: str) -> duckdb.DuckDBPyRelation:
    """Run a read-only query to completion; raise ``SQLError`` with DuckDB's message on failure or on a
    write. Returns a relation over the materialized result."""
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as error:
        raise SQLError(str(error)) from None
    if len(statements) != 1:
        raise SQLError(f"expected exactly one SQL statement, got {len(statements)}")
    if statements[0].type not in _READ_STATEMENTS:
        raise SQLError(f"store SQL is read-only: {statements[0].type.name} statements are not allowed")
    try:
        return con.from_arrow(con.sql(query).to_arrow_table())
    except (duckdb.Error, pa.ArrowException) as error:
        raise SQLError(undefined_macro(str(error)) or str(error)) from None


def undefined_macro(message: str) -> str | None:
    """What to do when DuckDB's error ``message`` is a call of a shipped macro the store does not define (its
    tables are missing, :data:`~gradstore.core.macros.UNDEFINED_MACROS`); ``None`` for any other error."""
    unknown = _UNKNOWN_TABLE_FUNCTION.search(message)
    return UNDEFINED_MACROS.get(unknown.group(1).lower()) if unknown else None


def store_views(tables: Tables) -> tuple[dict[str, lance.LanceDataset], dict[str, list[str]], list[str]]:
    """What SQL shows of a store's ``tables`` (at the caller's snapshot): ``(tables, unions, macros)``.

    ``gradients`` is the one dim's table, or the union of every ``gradients_<dim>``, each also shown by that name."""
    views = {name: tables.dataset(name) for name in tables.stored_names() if not is_gradient_table(name)}
    by_dim = {f"{GRADIENTS}_{dim}": tables.dataset(name) for dim, name in tables.gradient_tables.by_dim().items()}
    unions = {GRADIENTS: list(by_dim)} if len(by_dim) > 1 else {}
    if len(by_dim) == 1:
        views[GRADIENTS] = next(iter(by_dim.values()))
    views.update(by_dim)
    macros = macros_for({name: view.schema.names for name, view in views.items()})
    return views, unions, macros


def query_store(tables: Tables, query: str) -> tuple[duckdb.DuckDBPyConnection, duckdb.DuckDBPyRelation]:
    """Run read-only ``query`` over a store's ``tables`` (vectors excluded): the connection (which the relation
    needs alive) and the relation."""
    views, unions, macros = store_views(tables)
    connection = connect(views, macros, tables.storage_options, unions)
    return connection, run_query(connection, query)
