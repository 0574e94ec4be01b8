"""SQL for a server's clients: the store's tables and macros as ``store.sql`` shows them, in a DuckDB sandbox with
bounded memory, disk and time.

- One DuckDB database for the process, configured once and locked (``lock_configuration``): ``memory_limit``,
  ``max_temp_directory_size``, ``threads``, and a temp directory private to the server (a fresh ``0700`` directory,
  removed at exit), no external access (files, network, extensions), no Python replacement scans. Each request
  works on its own cursor (its own connection to that database: views, macros and result are its own), so
  queries run side by side and never behind a lookup.
- A statement is checked before it runs: one ``SELECT``, reading only the store's tables (and its own ``WITH``
  names), calling only the store's macros and ``range``/``generate_series``/``unnest``/``repeat``/``json_each``/
  ``json_tree`` as table functions, no ``current_setting`` and no ``duckdb_*``/``pragma_*`` function: settings,
  paths and DuckDB's temp files (which ``enable_external_access=false`` still lets SQL read) stay hidden.
- The result is streamed (``to_arrow_reader``) and reading stops at ``Limits.max_result_rows`` rows or
  ``Limits.max_result_bytes`` bytes (``RequestTooLargeError``, 413): an oversized result is never built whole.
- A watchdog thread interrupts (``con.interrupt()``) a statement past ``Limits.sql_timeout_s``
  (``QueryTimeoutError``) or whose client went away (``QueryCancelledError``)."""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from gradstore.core.macros import UNDEFINED_MACROS
from gradstore.core.schema import LAZY_SCHEMAS
from gradstore.core.sql import VectorlessLanceView
from gradstore.errors import GradstoreError, InvalidArgumentError, SQLError
from gradstore.serve.errors import QueryCancelledError, QueryTimeoutError, RequestTooLargeError

#: Table functions a statement may call besides the store's macros (no file, catalog or settings access).
TABLE_FUNCTIONS = frozenset({"range", "generate_series", "unnest", "repeat", "json_each", "json_tree"})
#: Scalar functions that would disclose the server's settings or write its log.
DENIED_FUNCTIONS = frozenset({"current_setting", "write_log", "getvariable"})
DENIED_PREFIXES = ("duckdb_", "pragma_")
BATCH_ROWS = 8192


class _Watch:
    __slots__ = ("cancelled", "cursor", "deadline", "reason")

    def __init__(self, cursor: Any, deadline: float, cancelled: Callable[[], bool] | None) -> None:
        self.cursor = cursor
        self.deadline = deadline
        self.cancelled = cancelled
        self.reason: str | None = None


class Watchdog:
    """Interrupts the statements it watches past their deadline or once their client is gone (checked every
    ``period_s``); its thread runs only while something is watched."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self._watched: set[_Watch] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, cursor: Any, timeout_s: float, cancelled: Callable[[], bool] | None) -> _Watch:
        entry = _Watch(cursor, time.monotonic() + timeout_s, cancelled)
        with self._lock:
            self._watched.add(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gradstore-sql-watchdog", daemon=True)
                self._thread.start()
        return entry

    def forget(self, entry: _Watch) -> None:
        with self._lock:  # the interrupt below holds it too: a forgotten cursor is never interrupted
            self._watched.discard(entry)

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
                now = time.monotonic()
                for entry in self._watched:
                    if entry.reason is None:
                        if now > entry.deadline:
                            entry.reason = "timeout"
                        elif entry.cancelled is not None and _safe(entry.cancelled):
                            entry.reason = "cancelled"
                    if entry.reason is not None:  # again each tick: an interrupt before the query started is lost
                        with contextlib.suppress(duckdb.Error):
                            entry.cursor.interrupt()


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _macro_name(definition: str) -> str:
    return definition.split("MACRO", 1)[1].split("(", 1)[0].strip().lower()


class SQLSandbox:
    """The process's DuckDB database for served SQL (see the module docstring). ``run`` answers one statement."""

    def __init__(
        self,
        *,
        memory_bytes: int,
        temp_bytes: int,
        threads: int,
        timeout_s: float,
        max_rows: int,
        max_bytes: int,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self._temp = tempfile.mkdtemp(prefix="gradstore-serve-sql-")  # mode 0700: this user's only
        atexit.register(shutil.rmtree, self._temp, True)
        self._db = duckdb.connect(
            ":memory:",
            config={
                "memory_limit": f"{int(memory_bytes)}B",
                "max_temp_directory_size": f"{int(temp_bytes)}B",
                "temp_directory": self._temp,
                "threads": max(1, int(threads)),
                "python_enable_replacements": False,
                "autoinstall_known_extensions": False,
                "autoload_known_extensions": False,
            },
        )
        self._system = {
            str(name).lower()
            for (name,) in self._db.execute(
                "SELECT view_name FROM duckdb_views() WHERE internal UNION "
                "SELECT function_name FROM duckdb_functions() WHERE function_type IN ('table', 'table_macro')"
            ).fetchall()
        }
        self._db.execute("SET enable_external_access = false")
        self._db.execute("SET lock_configuration = true")
        self.watchdog = Watchdog()

    def close(self) -> None:
        self._db.close()
        shutil.rmtree(self._temp, ignore_errors=True)

    # ------------------------------------------------------------------ one statement
    def run(
        self,
        query: Any,
        tables: Mapping[str, Any],
        unions: Mapping[str, Sequence[str]],
        macros: Sequence[str],
        storage_options: dict[str, str] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> pa.Table:
        """``query``'s result over ``tables`` (name -> Lance dataset), ``unions`` and ``macros`` (as
        :func:`gradstore.core.sql.store_views` gives them), checked, bounded and streamed; ``cancelled()`` true
        interrupts it."""
        if not isinstance(query, str):
            raise InvalidArgumentError("sql needs a query (a string)")
        names = set(tables) | set(LAZY_SCHEMAS) | set(unions)
        functions = TABLE_FUNCTIONS | {_macro_name(macro) for macro in macros}
        cursor = self._db.cursor()
        try:
            self._check(cursor, query, {name.lower() for name in names}, functions)
            for name, dataset in tables.items():
                view = VectorlessLanceView(dataset.uri, version=dataset.version, storage_options=storage_options)
                cursor.register(name, view)
            for name, schema in LAZY_SCHEMAS.items():
                if name not in tables:
                    cursor.register(name, schema.empty_table())
            for name, parts in unions.items():
                union = " UNION ALL BY NAME ".join(f"SELECT * FROM {_identifier(part)}" for part in parts)
                cursor.execute(f"CREATE TEMP VIEW {_identifier(name)} AS {union}")
            for macro in macros:
                cursor.execute(macro.replace("CREATE MACRO", "CREATE TEMP MACRO", 1))
            return self._stream(cursor, query, cancelled)
        except GradstoreError:
            raise
        except (duckdb.Error, pa.ArrowException) as error:
            raise SQLError(_first_line(error)) from None
        finally:
            cursor.close()

    def _check(self, cursor: Any, query: str, tables: set[str], functions: frozenset[str] | set[str]) -> None:
        try:
            statements = cursor.extract_statements(query)
        except duckdb.Error as error:
            raise SQLError(_first_line(error)) from None
        if len(statements) != 1:
            raise SQLError(f"expected exactly one SQL statement, got {len(statements)}")
        if statements[0].type != duckdb.StatementType.SELECT:
            raise SQLError(f"served SQL is one SELECT statement: {statements[0].type.name} statements are not allowed")
        try:
            (serialized,) = cursor.execute("SELECT json_serialize_sql(?)", [query]).fetchall()[0]
            tree = json.loads(serialized)
        except (duckdb.Error, ValueError, RecursionError) as error:
            raise SQLError(f"the statement cannot be read: {_first_line(error)}") from None
        if tree.get("error"):
            raise SQLError(str(tree.get("error_message") or "the statement cannot be read"))
        _check_tree(tree.get("statements", []), tables, functions, self._system)

    def _stream(self, cursor: Any, query: str, cancelled: Callable[[], bool] | None) -> pa.Table:
        watch = self.watchdog.watch(cursor, self.timeout_s, cancelled)
        try:
            relation = cursor.sql(query)
            if relation is None:
                return pa.table({})
            reader = relation.to_arrow_reader(BATCH_ROWS)
            batches, rows, size = [], 0, 0
            for batch in reader:
                rows += batch.num_rows
                size += batch.get_total_buffer_size()
                if rows > self.max_rows or size > self.max_bytes:
                    raise RequestTooLargeError(
                        f"the result has more than {self.max_rows} rows or {self.max_bytes} bytes: narrow it "
                        "(LIMIT, fewer columns, a WHERE)"
                    )
                batches.append(batch)
            return pa.Table.from_batches(batches, schema=reader.schema)
        except duckdb.InterruptException:
            if watch.reason == "cancelled":
                raise QueryCancelledError("the client went away: the statement was interrupted") from None
            raise QueryTimeoutError(
                f"the statement ran longer than this server's limit of {self.timeout_s:g} s and was interrupted"
            ) from None
        finally:
            self.watchdog.forget(watch)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_tree(tree: Any, tables: set[str], functions: frozenset[str] | set[str], system: set[str]) -> None:
    """Refuse a parsed statement (``json_serialize_sql``) that names anything but the store's tables, its own
    ``WITH`` names and the allowed functions."""
    ctes: set[str] = set()
    references: list[tuple[str, str, str]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        cte_map = node.get("cte_map")
        if isinstance(cte_map, dict):
            ctes.update(str(item.get("key", "")).lower() for item in cte_map.get("map", []) if isinstance(item, dict))
        if node.get("class") == "FUNCTION":
            name = str(node.get("function_name", "")).lower()
            if name in DENIED_FUNCTIONS or name.startswith(DENIED_PREFIXES):
                raise SQLError(f"function {name}() is not available in served SQL")
        elif node.get("type") == "TABLE_FUNCTION":
            function = node.get("function") or {}
            name = str(function.get("function_name", "")).lower() if isinstance(function, dict) else ""
            if name not in functions:
                raise SQLError(
                    UNDEFINED_MACROS.get(name)
                    or f"table function {name}() is not available in served SQL: use the store's tables, its macros, "
                    f"or {sorted(TABLE_FUNCTIONS)}"
                )
        elif node.get("type") in ("BASE_TABLE", "SHOW_REF"):
            references.append(
                (
                    str(node.get("table_name", "")).lower(),
                    str(node.get("schema_name", "") or ""),
                    str(node.get("catalog_name", "") or ""),
                )
            )
        stack.extend(node.values())
    shadowing = sorted(ctes & system)
    if shadowing:
        raise SQLError(f"a WITH name may not be a system name: {shadowing[0]!r}")
    for name, schema, catalog in references:
        if schema or catalog or (name not in tables and name not in ctes):
            shown = ".".join(part for part in (catalog, schema, name) if part)
            raise SQLError(f"served SQL reads the store's tables only: {shown!r} is not one of {sorted(tables)}")
