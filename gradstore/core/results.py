"""Rows the store keeps beside its gradients: the ``examples`` table (upserted by id), result tables
(``scores``, ``self_influence``) and the tables of the layers above (``evaluations``, ...) (:class:`Results`)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from gradstore.core import commits
from gradstore.core import schema as S
from gradstore.core.gradient_tables import is_gradient_table
from gradstore.core.tables import Tables, writes
from gradstore.core.tabular import to_arrow_table
from gradstore.errors import InvalidNameError, SchemaMismatchError, StoreCorruptError


class Results:
    """The store's examples, results and other non-gradient tables, as rows are added to them."""

    def __init__(self, tables: Tables) -> None:
        self.tables = tables

    @writes("add examples")
    def add_examples(self, data: Any, id_column: str = "example_id") -> int:
        """Add or update training/query examples (any tabular input, see
        :func:`gradstore.core.tabular.to_arrow_table`).

        ``id_column`` names the column holding each example's id; it is stored as ``example_id`` (string).
        Examples are upserted by id: an id already stored gets the new row, and of several rows with one id
        the last wins, so the table holds each id once. Later additions must have the same columns.
        Returns the number of rows added or updated.
        """
        table = to_arrow_table(data)
        if id_column not in table.column_names:
            raise SchemaMismatchError(f"examples have no id column {id_column!r}; columns: {table.column_names}")
        ids = table.column(id_column).cast(pa.string())
        if ids.null_count:
            raise SchemaMismatchError(f"{ids.null_count} example(s) have no id in column {id_column!r}")
        table = table.drop_columns([id_column])
        if "example_id" in table.column_names:
            raise SchemaMismatchError("examples carry both an 'example_id' column and another id column")
        table = table.add_column(0, pa.field("example_id", pa.string(), nullable=False), ids)
        if not self.tables.has_table(S.EXAMPLES):
            self.tables.create(S.EXAMPLES, table.schema.with_metadata({S.FORMAT_KEY: S.FORMAT_VERSION}))
        existing = self.tables.table(S.EXAMPLES).schema
        if set(existing.names) != set(table.column_names):
            raise SchemaMismatchError(f"examples must have columns {existing.names}, got {table.column_names}")
        try:
            table = table.select(existing.names).cast(existing)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise SchemaMismatchError(f"examples do not match the stored schema: {error}") from None
        table = _last_row_per_id(table)
        commits.upsert(self.tables.table(S.EXAMPLES), table, ["example_id"], "add_examples")
        return table.num_rows

    @writes("append results (this call's results were computed but are not saved)")
    def append_results(self, name: str, table: pa.Table) -> str:
        """Append a result table (``scores``, ``self_influence``) stamped with the current time and, for
        ``scores``, a new call id (returned); a store made before a column existed gets it (nulls) first."""
        schema = S.FIXED_SCHEMAS[name]
        call_id = uuid.uuid4().hex
        now = pa.array([datetime.now(timezone.utc)] * table.num_rows, schema.field("created_at").type)
        table = table.append_column(schema.field("created_at"), now)
        if "call_id" in schema.names and "call_id" not in table.column_names:
            table = table.append_column(schema.field("call_id"), pa.array([call_id] * table.num_rows, pa.string()))
        self._add_missing_string_columns(name, schema)
        commits.append(self.tables.table(name), table.select(schema.names).cast(schema), f"{name} results")
        return call_id

    def _add_missing_string_columns(self, name: str, schema: pa.Schema) -> None:
        """Give a table made by an earlier version the (string) columns of ``schema`` it lacks, as nulls."""
        missing = [f.name for f in schema if f.name not in self.tables.table(name).schema.names]
        if missing:
            if any(schema.field(column).type != pa.string() for column in missing):
                raise StoreCorruptError(f"table {name!r} lacks columns {missing} that cannot be added")
            dataset = self.tables.table(name).to_lance()
            commits.retrying(
                lambda: dataset.add_columns({c: "CAST(NULL AS STRING)" for c in missing}), f"{name} columns"
            )
            self.tables.table(name).checkout_latest()

    @writes("append rows to a table")
    def append_table(self, name: str, rows: pa.Table) -> None:
        """Append ``rows`` to table ``name``, creating it with their schema on first use (for tables of the
        layers above, such as ``evaluations``); a table of :data:`~gradstore.core.schema.LAZY_SCHEMAS` made by an
        earlier version gets the string columns it lacks (nulls) first."""
        if is_gradient_table(name):
            raise InvalidNameError(f"table {name!r} is a gradient table's name; write gradients with store.writer")
        if not self.tables.has_table(name):
            self.tables.create(name, rows.schema.with_metadata({S.FORMAT_KEY: S.FORMAT_VERSION}))
        elif name in S.LAZY_SCHEMAS:
            strings = [field for field in S.LAZY_SCHEMAS[name] if field.type == pa.string()]
            self._add_missing_string_columns(name, pa.schema(strings))
        existing = self.tables.table(name).schema
        try:
            rows = rows.select(existing.names).cast(existing)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise SchemaMismatchError(f"rows for table {name!r} do not match its schema: {error}") from None
        commits.append(self.tables.table(name), rows, f"{name} rows")


def _last_row_per_id(table: pa.Table) -> pa.Table:
    """``table`` with only the last row of each ``example_id``."""
    last = {example_id: i for i, example_id in enumerate(table.column("example_id").to_pylist())}
    return table if len(last) == table.num_rows else table.take(sorted(last.values()))
