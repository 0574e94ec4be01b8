"""The store's tables: one LanceDB database, its tables opened once, read at one version per call, created safely.

:class:`Tables` is the part of :class:`~gradstore.core.StoreCore` every other part reads and writes through: it
opens tables (refusing any whose metadata LanceDB would act on), pins the versions a :meth:`Tables.snapshot` block
reads, scans small metadata (kept in the row cache and scan files), creates tables race-safely, knows whether this
process may write the store, and turns storage failures into ``StoreCorruptError``/``StorePermissionError``.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lance
import lancedb
import pyarrow as pa
import pyarrow.fs as pafs

from gradstore.core import commits, storage
from gradstore.core import schema as S
from gradstore.core.gradient_tables import GradientTables, is_gradient_table
from gradstore.core.row_cache import RowCache, ScanFiles
from gradstore.core.sidefiles import SideFiles
from gradstore.errors import GradstoreError, StoreCorruptError, StorePermissionError

log = logging.getLogger(__name__)

#: The tables a :meth:`Tables.snapshot` block has read, ``(store uri, table name) -> Lance dataset`` at the version
#: its first read saw (``None`` outside a block). A context variable: a thread that runs its work in a copy of the
#: caller's context (``contextvars.copy_context().run``) shares the block's view.
_SNAPSHOT: contextvars.ContextVar[dict[tuple[str, str], lance.LanceDataset] | None] = contextvars.ContextVar(
    "gradstore_snapshot", default=None
)
#: What Lance raises when a table's files cannot be read (translated to ``StoreCorruptError``).
READ_ERRORS = (OSError, RuntimeError, pa.ArrowException)
_Call = TypeVar("_Call", bound=Callable[..., Any])


def writes(what: str) -> Callable[[_Call], _Call]:
    """Decorate a method of a part of the store (an object whose ``tables`` is the store's :class:`Tables`) that
    writes the store (``what`` it does, for messages) to run inside ``tables.writing(what)``: refused up front on a
    store this process may not write, ``StorePermissionError`` for a write the storage refuses."""

    def decorate(function: _Call) -> _Call:
        @functools.wraps(function)
        def writing(part: Any, *args: Any, **kwargs: Any) -> Any:
            with part.tables.writing(what):
                return function(part, *args, **kwargs)

        return writing  # type: ignore[return-value]

    return decorate


class Tables:
    """The tables of one store's LanceDB database (``db``), with the store's side files, row cache and scan files."""

    def __init__(
        self,
        uri: str,
        db: lancedb.DBConnection,
        storage_options: dict[str, str] | None,
        files: SideFiles,
        row_cache: RowCache,
        scan_files: ScanFiles,
    ) -> None:
        self.uri = uri
        #: The store's URI, a local path made absolute when opened (what names the store in cache files).
        self.location = uri if "://" in uri else str(Path(uri).resolve())
        self.db = db
        self.storage_options = storage_options
        self.files = files
        self.row_cache = row_cache
        self.scan_files = scan_files
        self._opened: dict[str, Any] = {}
        self._datasets: dict[str, lance.LanceDataset] = {}  # see _latest
        self.gradient_tables = GradientTables(self.has_table, self.table, self.create, self.stored_names)
        self._writable: bool | None = None  # see writable
        self._stand_ins: tempfile.TemporaryDirectory | None = None  # see ensure_fixed

    @property
    def writable(self) -> bool:
        """Whether this process may write the store, found once without writing: for a local store, by the modes
        (and mount) of its directories; an object store is taken as writable, and a write it refuses raises
        ``StorePermissionError``. On a store it may not write, reads work as usual; fits and indexes are kept in
        memory instead of in side files, and writes asked for raise ``StorePermissionError``."""
        if self._writable is None:
            self._writable = storage.is_remote(self.uri) or storage.local_writable(self.uri)
        return self._writable

    def require_writable(self, what: str) -> None:
        """Raise ``StorePermissionError`` if this process may not write the store (``what``: the write asked for)."""
        if not self.writable:
            raise StorePermissionError(f"cannot {what}: {storage.READ_ONLY} (store {self.uri})")

    @contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """A write of the store (``what`` it does): refused at once on a store this process may not write, and one
        the storage refuses (file modes, a read-only mount, object-store credentials) raises ``StorePermissionError``
        naming what to do."""
        self.require_writable(what)
        try:
            yield
        except GradstoreError:
            raise
        except Exception as error:
            refused = storage.permission_error(error, self.uri, what)
            if refused is None:
                raise
            raise refused from error

    # ------------------------------------------------------------------ tables
    def has_table(self, name: str) -> bool:
        """Whether the store holds table ``name`` (a table whose creation never committed does not count)."""
        return name in self._opened or (name in self.db.list_tables().tables and self.committed(name))

    def stored_names(self) -> list[str]:
        names = list(self.db.list_tables().tables)
        return names + [name for name in S.FIXED_SCHEMAS if name in self._opened and name not in names]

    def table_names(self) -> list[str]:
        """The store's tables with every gradient table (one per dim) named ``gradients``, as SQL's union
        view and ``StoreCore.count`` see them."""
        names = {S.GRADIENTS if is_gradient_table(name) else name for name in self.stored_names()}
        return sorted(name for name in names if name != S.GRADIENTS or self.gradient_tables.by_dim())

    def count(self, table: str = S.GRADIENTS, where: str | None = None) -> int:
        """Row count of a table (0 if it does not exist yet); ``gradients`` counts the rows of every dim."""
        names = list(self.gradient_tables.by_dim().values()) if table == S.GRADIENTS else [table]
        total = 0
        for name in names:
            if self.has_table(name):
                with self.reading(name):
                    total += self.dataset(name).count_rows(where)
        return total

    def committed(self, name: str) -> bool:
        """Whether table ``name`` has a committed version (a process killed while creating it leaves none)."""
        selector = pafs.FileSelector(f"{self.files.store_path}/{name}.lance/_versions", allow_not_found=True)
        try:
            listing = self.files.filesystem.get_file_info(selector)
        except FileNotFoundError:  # another process created the folder while it was listed: nothing committed then
            return False
        return any(info.base_name.endswith(".manifest") for info in listing)

    def table(self, name: str):
        """The LanceDB table ``name`` (``StoreCorruptError`` if it cannot be opened, ``KeyError`` if absent)."""
        if name not in self._opened:
            if not self.has_table(name):
                raise KeyError(f"the store has no table {name!r} yet")
            try:
                table = self.db.open_table(name)
                schema = table.schema
            except Exception as error:
                refused = storage.permission_error(error, self.uri, f"open table {name!r}")
                if refused is not None:
                    raise refused from error
                raise StoreCorruptError(f"table {name!r} of store {self.uri} cannot be opened: {error}") from error
            commits.check_inert(schema, f"table {name!r} of store {self.uri}")
            self._opened[name] = table
        return self._opened[name]

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """Reads inside this block see every table at the version its first read in the block saw: one
        consistent view for a whole call (rows appended meanwhile by another writer are not half seen), and one
        look-up of a table's latest version instead of one per read. For reads only: a write inside the block
        is not seen by the block's later reads. Nested blocks share the outermost one's view."""
        if _SNAPSHOT.get() is not None:
            yield
            return
        token = _SNAPSHOT.set({})
        try:
            yield
        finally:
            _SNAPSHOT.reset(token)

    @contextmanager
    def past_snapshot(self) -> Iterator[None]:
        """A step that writes and then reads inside a :meth:`snapshot` call (a derived run built on first use): its
        reads see the latest versions, and the enclosing block takes its view again afterwards, so its later reads
        see what the step wrote."""
        pins = _SNAPSHOT.get()
        token = _SNAPSHOT.set(None)
        try:
            yield
        finally:
            _SNAPSHOT.reset(token)
            if pins is not None:
                pins.clear()

    def dataset(self, name: str) -> lance.LanceDataset:
        """Table ``name``'s Lance dataset: at its latest version, or inside a :meth:`snapshot` block at the version
        the block saw first."""
        pins = _SNAPSHOT.get()
        if pins is None:
            return self._latest(name)
        key = (self.uri, name)
        dataset = pins.get(key)
        if dataset is None:
            dataset = pins.setdefault(key, self._latest(name))
        return dataset

    def _latest(self, name: str) -> lance.LanceDataset:
        """Table ``name``'s Lance dataset at its latest version: the one this process opened last while nobody has
        committed since (one look at the version listing: ~5 us on a local store against ~0.4 ms to open the
        dataset anew, a fixed cost of every call on the store)."""
        known = self._datasets.get(name)
        if known is not None and known.latest_version == known.version:
            return known
        dataset = self.table(name).to_lance()
        self._datasets[name] = dataset
        return dataset

    def scan(
        self,
        name: str,
        columns: Sequence[str] | None = None,
        where: str | None = None,
        row_address: bool = False,
        *,
        cache: bool = True,
    ) -> pa.Table:
        """Table ``name``'s ``columns`` (all: ``None``) of the rows matching ``where`` (with ``_rowaddr`` when
        ``row_address``), as :meth:`dataset` gives the table. For small metadata reads: kept per table version in
        the row cache and, for the next process, in a scan file (:mod:`gradstore.core.row_cache`); ``cache=False``
        for a read that streams over a table a part at a time and will not repeat (kept, such parts would add up
        to the whole table in memory)."""
        dataset = self.dataset(name)
        columns = None if columns is None else list(columns)
        if not cache:
            with self.reading(name):
                return dataset.to_table(columns=columns, filter=where, with_row_address=row_address)
        identity = {
            "store": self.location,
            "table": name,
            "columns": columns,
            "where": where,
            "row_address": row_address,
        }
        key = (dataset.version, "scan", name, json.dumps(identity, sort_keys=True))
        found = self.row_cache.get(key)
        if found is not None:
            return found
        schema = dataset.schema if columns is None else pa.schema([dataset.schema.field(c) for c in columns])
        if row_address:
            schema = schema.append(pa.field("_rowaddr", pa.uint64()))

        def read() -> pa.Table:
            with self.reading(name):
                return dataset.to_table(columns=columns, filter=where, with_row_address=row_address)

        table = self.scan_files.read(dataset, identity, read, schema)
        self.row_cache.put(key, table, table.nbytes)
        return table

    @contextmanager
    def reading(self, name: str) -> Iterator[None]:
        """Reads of table ``name`` inside this block that fail in Lance (a data file missing or unreadable)
        raise ``StoreCorruptError`` naming the table and the file."""
        try:
            yield
        except READ_ERRORS as error:
            raise self.unreadable(name, error) from error

    def unreadable(self, name: str, error: BaseException) -> GradstoreError:
        refused = storage.permission_error(error, self.uri, f"read table {name!r}")
        if refused is not None:
            return refused
        return StoreCorruptError(
            f"table {name!r} of store {self.uri} cannot be read: {error} (`gradstore verify` reports what is damaged)"
        )

    def create(self, name: str, schema: pa.Schema):
        """Create an empty table, or complete one whose creation was interrupted; idempotent and safe when
        several processes create it at once: exactly one first version commits.

        ``lance.write_dataset(mode="create")`` is not exclusive: a process that lost the race could commit its
        table as version 2 over the winner's (an overwrite, measured in 5-7 of 40 two-process races). An
        ``Overwrite`` commit with no retries fails instead of rebasing when another first version exists."""
        try:
            lance.LanceDataset.commit(
                f"{self.uri.rstrip('/')}/{name}.lance",
                lance.LanceOperation.Overwrite(schema, []),
                storage_options=self.storage_options,
                max_retries=0,
            )
        except OSError as error:
            if not self.has_table(name):  # not a lost race: the table is still missing
                refused = storage.permission_error(error, self.uri, f"create table {name!r}")
                if refused is not None:
                    raise refused from error
                raise
        return self.table(name)

    def ensure_fixed(self, storage_dtype: str) -> None:
        """Create the fixed tables the store lacks (``runs`` records ``storage_dtype``, the dtype the store is created
        with); on a store this process may not write (a store made by an
        earlier version, opened read-only), each one missing is read as empty: an empty table in a scratch database
        of this process, never in the store."""
        missing = {name: schema for name, schema in S.FIXED_SCHEMAS.items() if not self.has_table(name)}
        if not missing:
            return
        if self.writable:
            for name, schema in missing.items():
                # the runs table records the dtype the store is created with (the first creator's, in a race)
                self.create(name, S.runs_schema_of_new_store(storage_dtype) if name == S.RUNS else schema)
            return
        log.debug("store %s is read-only for this process: tables %s read as empty", self.uri, sorted(missing))
        self._stand_ins = tempfile.TemporaryDirectory(prefix="gradstore-empty-tables-")
        scratch = lancedb.connect(self._stand_ins.name)
        for name, schema in missing.items():
            self._opened[name] = scratch.create_table(name, schema=schema)
