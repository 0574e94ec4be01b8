"""The store's core: one LanceDB database holding runs, checkpoints, gradients, examples and results.

:class:`StoreCore` is the data-access layer every higher module works on (tables, runs, checkpoints,
gradient I/O, examples, result tables, side files, SQL, maintenance). It imports nothing above
``gradstore.core``; the user-facing :class:`gradstore.GradStore` extends it with capture, attribution and
selection.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

import lance
import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from gradstore.core import commits, storage
from gradstore.core import schema as S
from gradstore.core import sql as store_sql
from gradstore.core.coverage import run_coverage
from gradstore.core.curvature_files import LayerCurvature, has_curvature, load_curvature, save_curvature
from gradstore.core.filters import StepRange, gradient_filter, sql_literal
from gradstore.core.gradient_tables import GradientTables, is_gradient_table, table_dim
from gradstore.core.index_cache import IndexCache
from gradstore.core.macros import macros_for
from gradstore.core.row_cache import SCANS_DIRECTORY, RowCache, RowFiles, ScanFiles, row_files_directory
from gradstore.core.sidefiles import SideFiles
from gradstore.core.tabular import to_arrow_table
from gradstore.core.vector_scanner import late_materialization, vector_scanner
from gradstore.core.vectors import DEFAULT_STORAGE_DTYPE, check_storage_dtype, decode, storage_dtype_of
from gradstore.core.verify import VerifyReport, verify_store
from gradstore.core.writer import GradientWriter, WriterConfig
from gradstore.errors import (
    GradstoreError,
    InvalidArgumentError,
    InvalidNameError,
    NotAStoreError,
    ProjectionMismatchError,
    SchemaMismatchError,
    StoreCorruptError,
    StorePermissionError,
    UnknownRunError,
)
from ingest import ProjectionMismatchError as LowerProjectionMismatchError
from ingest import ProjectionSpec

log = logging.getLogger(__name__)

#: Bytes the row cache counts for a run's rows' checkpoint labels (small metadata kept per table version beside the
#: prepared rows, so repeated calls on a run read no column again).
RUN_ROW_BYTES = 4096
#: The tables a :meth:`StoreCore.snapshot` block has read, ``(store uri, table name) -> Lance dataset`` at the version
#: its first read saw (``None`` outside a block). A context variable: a thread that runs its work in a copy of the
#: caller's context (``contextvars.copy_context().run``) shares the block's view.
_SNAPSHOT: contextvars.ContextVar[dict[tuple[str, str], lance.LanceDataset] | None] = contextvars.ContextVar(
    "gradstore_snapshot", default=None
)
_Call = TypeVar("_Call", bound=Callable[..., Any])


def one_snapshot(function: _Call) -> _Call:
    """Decorate ``function(store, ...)`` (a call on a :class:`StoreCore`) to run inside ``store.snapshot()``: all its
    reads see one version of each table. For calls that write, if at all, only after their last read."""

    @functools.wraps(function)
    def in_snapshot(store: StoreCore, *args: Any, **kwargs: Any) -> Any:
        with store.snapshot():
            return function(store, *args, **kwargs)

    return in_snapshot  # type: ignore[return-value]


def writes(what: str) -> Callable[[_Call], _Call]:
    """Decorate a :class:`StoreCore` method that writes the store (``what`` it does, for messages) to run inside
    ``store.writing(what)``: refused up front on a store this process may not write, ``StorePermissionError`` for a
    write the storage refuses."""

    def decorate(function: _Call) -> _Call:
        @functools.wraps(function)
        def writing(store: StoreCore, *args: Any, **kwargs: Any) -> Any:
            with store.writing(what):
                return function(store, *args, **kwargs)

        return writing  # type: ignore[return-value]

    return decorate


#: What Lance raises when a table's files cannot be read (translated to ``StoreCorruptError``).
_READ_ERRORS = (OSError, RuntimeError, pa.ArrowException)

Names = str | Sequence[str]


@dataclass
class GradientBlock:
    """A block of stored gradients: float32 vectors with their ``grad_id``s and metadata columns."""

    grad_ids: np.ndarray  # int64 [n]
    vectors: np.ndarray  # float32 [n, dim]
    metadata: pa.Table  # the requested metadata columns, row-aligned

    def __len__(self) -> int:
        return len(self.grad_ids)

    @classmethod
    def from_batch(cls, batch: pa.RecordBatch, metadata_columns: Sequence[str], storage_dtype: str) -> GradientBlock:
        """A block from a scanned record batch of ``grad_id``, metadata and the stored vector columns."""
        return cls(
            grad_ids=np.array(batch.column("grad_id").to_numpy()),
            vectors=decode(batch.column(S.VECTOR_COLUMN), batch.column(S.NORM_COLUMN), storage_dtype),
            metadata=pa.Table.from_batches([batch.select(list(metadata_columns))]),
        )

    def torch(self, device: str | None = None):
        """The vectors as a torch tensor (zero-copy on CPU)."""
        import torch

        return torch.from_numpy(self.vectors).to(device) if device else torch.from_numpy(self.vectors)


def as_core(store: Any) -> StoreCore:
    """The :class:`StoreCore` of ``store``: a facade's ``core``, or ``store`` itself."""
    return getattr(store, "core", store)


def check_run_name(run_id: str) -> str:
    """A run id must be a non-empty string (it is never used as a path: side files hash it)."""
    if not isinstance(run_id, str) or not run_id.strip():
        raise InvalidNameError(f"a run id must be a non-empty string, got {run_id!r}")
    return run_id


class StoreCore:
    """Tables, runs, checkpoints, gradient I/O, examples, results, side files and SQL of one store."""

    def __init__(
        self,
        uri: str,
        db: lancedb.DBConnection,
        storage_dtype: str,
        storage_options: dict[str, str] | None = None,
        row_files: RowFiles | None = None,
    ) -> None:
        self.uri = uri
        self.db = db
        self._storage_dtype = storage_dtype
        self.storage_options = storage_options
        self._tables: dict[str, Any] = {}
        self._run_dims: dict[str, int] = {}  # a run's dim never changes
        self.files = SideFiles(uri, storage_options)
        self.gradient_tables = GradientTables(self.has_table, self.table, self._create_table, self._list_tables)
        self.row_cache = RowCache()  # rows prepared for search, by gradients version and selection
        self.index_cache = IndexCache()  # loaded FAISS indexes, by name and manifest (gradstore.core.index_cache)
        self.row_files = row_files or RowFiles(None)  # the same, on local disk between processes
        scans = None if self.row_files.directory is None else self.row_files.directory / SCANS_DIRECTORY
        self.scan_files = ScanFiles(scans)  # small reads (runs, checkpoints, a selection's ids), the same
        self._writable: bool | None = None  # see writable
        self._stand_ins: tempfile.TemporaryDirectory | None = None  # see _ensure_fixed_tables

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

    @property
    def location(self) -> str:
        """The store's URI, a local path made absolute (what names the store in cache files)."""
        return self.uri if "://" in self.uri else str(Path(self.uri).resolve())

    # ------------------------------------------------------------------ tables
    def has_table(self, name: str) -> bool:
        """Whether the store holds table ``name`` (a table whose creation never committed does not count)."""
        return name in self._tables or (name in self.db.list_tables().tables and self._committed(name))

    def _list_tables(self) -> list[str]:
        names = list(self.db.list_tables().tables)
        return names + [name for name in S.FIXED_SCHEMAS if name in self._tables and name not in names]

    def table_names(self) -> list[str]:
        """The store's tables with every gradient table (one per dim) named ``gradients``, as SQL's union
        view and :meth:`count` see them."""
        names = {S.GRADIENTS if is_gradient_table(name) else name for name in self._list_tables()}
        return sorted(name for name in names if name != S.GRADIENTS or self.dims)

    def _committed(self, name: str) -> bool:
        """Whether table ``name`` has a committed version (a process killed while creating it leaves none)."""
        selector = pafs.FileSelector(f"{self.files.store_path}/{name}.lance/_versions", allow_not_found=True)
        try:
            listing = self.files.filesystem.get_file_info(selector)
        except FileNotFoundError:  # another process created the folder while it was listed: nothing committed then
            return False
        return any(info.base_name.endswith(".manifest") for info in listing)

    def table(self, name: str):
        """The LanceDB table ``name`` (``StoreCorruptError`` if it cannot be opened, ``KeyError`` if absent)."""
        if name not in self._tables:
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
            self._tables[name] = table
        return self._tables[name]

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
            return self.table(name).to_lance()
        key = (self.uri, name)
        dataset = pins.get(key)
        if dataset is None:
            dataset = pins.setdefault(key, self.table(name).to_lance())
        return dataset

    def scan(
        self, name: str, columns: Sequence[str] | None = None, where: str | None = None, row_address: bool = False
    ) -> pa.Table:
        """Table ``name``'s ``columns`` (all: ``None``) of the rows matching ``where`` (with ``_rowaddr`` when
        ``row_address``), as :meth:`dataset` gives the table. For small metadata reads: kept per table version in
        the row cache and, for the next process, in a scan file (:mod:`gradstore.core.row_cache`)."""
        dataset = self.dataset(name)
        columns = None if columns is None else list(columns)
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
        except _READ_ERRORS as error:
            raise self._unreadable(name, error) from error

    def _unreadable(self, name: str, error: BaseException) -> GradstoreError:
        refused = storage.permission_error(error, self.uri, f"read table {name!r}")
        if refused is not None:
            return refused
        return StoreCorruptError(
            f"table {name!r} of store {self.uri} cannot be read: {error} (`gradstore verify` reports what is damaged)"
        )

    def _create_table(self, name: str, schema: pa.Schema):
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

    def _ensure_fixed_tables(self) -> None:
        """Create the fixed tables the store lacks; on a store this process may not write (a store made by an
        earlier version, opened read-only), each one missing is read as empty: an empty table in a scratch database
        of this process, never in the store."""
        missing = {name: schema for name, schema in S.FIXED_SCHEMAS.items() if not self.has_table(name)}
        if not missing:
            return
        if self.writable:
            for name, schema in missing.items():
                # the runs table records the dtype the store is created with (the first creator's, in a race)
                self._create_table(name, S.runs_schema_of_new_store(self._storage_dtype) if name == S.RUNS else schema)
            return
        log.debug("store %s is read-only for this process: tables %s read as empty", self.uri, sorted(missing))
        self._stand_ins = tempfile.TemporaryDirectory(prefix="gradstore-empty-tables-")
        scratch = lancedb.connect(self._stand_ins.name)
        for name, schema in missing.items():
            self._tables[name] = scratch.create_table(name, schema=schema)

    # ------------------------------------------------------------------ runs and their gradient tables
    @property
    def dims(self) -> list[int]:
        """The vector dimensions the store holds (one gradient table each), ascending."""
        return list(self.gradient_tables.by_dim())

    @property
    def dim(self) -> int | None:
        """Dimension of the stored vectors: ``None`` until the first run is created; a store holding runs of
        several dims raises ``InvalidArgumentError`` (ask :meth:`run_dim` for a run's dim)."""
        dims = self.dims
        if len(dims) > 1:
            raise InvalidArgumentError(
                f"store {self.uri} holds runs of several dims {dims}: use store.run_dim(run) for a run's dim"
            )
        return dims[0] if dims else None

    def run_dim(self, run_id: str) -> int:
        """The dim of run ``run_id``'s vectors (raises ``UnknownRunError``)."""
        if run_id not in self._run_dims:
            self._run_dims[run_id] = int(self.run(run_id)["dim"])
        return self._run_dims[run_id]

    def gradient_table_name(self, run_id: str) -> str:
        """The name of the table holding run ``run_id``'s rows (see :mod:`gradstore.core.gradient_tables`)."""
        return self.gradient_tables.name_for_dim(self.run_dim(run_id))

    def gradient_table(self, run_id: str):
        """The LanceDB table holding run ``run_id``'s rows."""
        return self.table(self.gradient_table_name(run_id))

    def gradient_dataset(self, run_id: str) -> lance.LanceDataset:
        """The Lance dataset of run ``run_id``'s rows (as :meth:`dataset` gives it: pinned inside a snapshot)."""
        return self.dataset(self.gradient_table_name(run_id))

    def other_gradient_tables(self, run_id: str) -> list[Any]:
        """The gradient tables of the dims other than run ``run_id``'s (a writer keeps its ``grad_id``s unique
        across them too)."""
        own = self.gradient_table_name(run_id)
        return [self.table(name) for name in self.gradient_tables.by_dim().values() if name != own]

    @property
    def storage_dtype(self) -> str:
        """Storage dtype of the vector column (see :mod:`gradstore.core.vectors`); one per store, fixed when the
        store is created (:meth:`created_storage_dtype`)."""
        if self.gradient_tables.primary_dim() is not None:
            return storage_dtype_of(self.dataset(S.GRADIENTS).schema.field(S.VECTOR_COLUMN))
        return self._storage_dtype

    def created_storage_dtype(self) -> str | None:
        """The dtype recorded in the ``runs`` table's schema metadata when the store was created (``None``: a store
        made before it was recorded)."""
        if not self.has_table(S.RUNS):
            return None
        recorded = (self.table(S.RUNS).schema.metadata or {}).get(S.STORAGE_DTYPE_KEY)
        if recorded is None:
            return None
        try:
            return check_storage_dtype(recorded.decode())
        except (InvalidArgumentError, UnicodeDecodeError) as error:
            raise StoreCorruptError(f"store {self.uri} records an unknown storage dtype {recorded!r}") from error

    @writes("create a run")
    def create_run(
        self,
        run_id: str,
        *,
        dim: int,
        projection: dict | None = None,
        model_fingerprint: str | None = None,
        config: dict | None = None,
        exist_ok: bool = False,
    ) -> dict:
        """Register a capture run of ``dim``-dimensional vectors with its projection spec.

        Re-creating an existing run with ``exist_ok=True`` checks that the projection spec is the same.
        """
        check_run_name(run_id)
        if dim <= 0:
            raise InvalidArgumentError(f"dim must be positive, got {dim}")
        projection_json = json.dumps(projection, sort_keys=True) if projection is not None else None
        existing = self.run(run_id) if self.has_run(run_id) else None
        if existing is not None:
            if not exist_ok:
                raise InvalidArgumentError(f"run {run_id!r} already exists (pass exist_ok=True to append to it)")
            if existing["projection"] != projection_json or existing["dim"] != dim:
                raise SchemaMismatchError(f"run {run_id!r} exists with a different projection spec or dim")
            return existing
        self.gradient_tables.ensure(dim, self._storage_dtype)  # before the run: its rows need the table
        row = {
            "run_id": run_id,
            "created_at": datetime.now(timezone.utc),
            "model_fingerprint": model_fingerprint,
            "projection": projection_json,
            "projection_fingerprint": (projection or {}).get("fingerprint"),
            "dim": dim,
            "config": json.dumps(config or {}, sort_keys=True, default=str),
        }
        commits.append(self.table(S.RUNS), pa.Table.from_pylist([row], schema=S.RUNS_SCHEMA), "run creation")
        winner = self.run(run_id)  # another process may have created the run since has_run: the first commit wins
        if self._is_row(winner, row):
            return row
        commits.retrying(lambda: self._delete_run_row(row), "run creation")
        if winner["projection"] != projection_json or winner["dim"] != dim:
            raise SchemaMismatchError(
                f"run {run_id!r} was created at the same time by another process with a different projection spec "
                "or dim; this capture's spec was withdrawn"
            )
        if not exist_ok:
            raise InvalidArgumentError(f"run {run_id!r} already exists (pass exist_ok=True to append to it)")
        return winner

    @staticmethod
    def _is_row(stored: dict, row: dict) -> bool:
        return all(stored[key] == row[key] for key in ("created_at", "projection", "dim", "config"))

    def _run_rows(self, run_id: str) -> list[dict]:
        """The ``runs`` rows of ``run_id`` in commit order (Lance assigns fragment ids, hence row addresses,
        in commit order; compaction keeps the order), each with its ``_rowaddr``. A :meth:`scan`: repeated calls
        on the same version of the ``runs`` table read nothing, a new process reads its scan file."""
        rows = self.scan(S.RUNS, where=f"run_id = {sql_literal(run_id)}", row_address=True)
        return rows.sort_by("_rowaddr").to_pylist()

    def _delete_run_row(self, row: dict) -> None:
        """Withdraw a run row this process committed and lost (found again on every attempt: compaction moves it)."""
        for stored in self._run_rows(row["run_id"]):
            if self._is_row(stored, row):
                self.table(S.RUNS).to_lance().delete(f"_rowaddr = {int(stored['_rowaddr'])}")
                return

    def run(self, run_id: str) -> dict:
        """The ``runs`` row of ``run_id`` as a dict (raises ``UnknownRunError``); the first committed one if
        two processes created the run at once."""
        rows = self._run_rows(run_id)
        if not rows:
            known = self.table(S.RUNS).to_arrow().column("run_id").to_pylist()
            raise UnknownRunError(f"unknown run {run_id!r}; the store holds runs {known}")
        winner = rows[0]  # runs created at once by two processes: the first commit is the run
        del winner["_rowaddr"]
        return winner

    def has_run(self, run_id: str) -> bool:
        """Whether the store holds run ``run_id``."""
        return self.table(S.RUNS).count_rows(f"run_id = {sql_literal(run_id)}") > 0

    def runs(self) -> pa.Table:
        """All runs as an Arrow table."""
        return self.table(S.RUNS).to_arrow()

    def run_config(self, run_id: str) -> dict:
        """The JSON config a run was created with (capture options, notes)."""
        return json.loads(self.run(run_id)["config"] or "{}")

    def run_projection(self, run_id: str) -> dict | None:
        """The projection spec a run was captured with as a dict (``None`` for a run created without one)."""
        spec = self.run(run_id)["projection"]
        return json.loads(spec) if spec else None

    def run_spec(self, run_id: str, needed_for: str | None = None) -> ProjectionSpec:
        """The run's projection spec; a run created without one (vectors written by hand) raises
        ``SchemaMismatchError`` saying what needed it (``needed_for``)."""
        stored = self.run_projection(run_id)
        if stored is None:
            raise SchemaMismatchError(
                f"run {run_id!r} has no projection spec (its vectors were written without capture)"
                + (f", and {needed_for} needs one" if needed_for else "")
                + ": such vectors are used as they are (grad-dot, cosine, diagonal, fisher with blocks='full', "
                "trackstar, tracin); layer blocks, kfac/ekfac and captured queries need a projection"
            )
        return ProjectionSpec.from_dict(stored)

    def ensure_run(
        self, run_id: str, spec: ProjectionSpec, model_fingerprint: str | None = None, config: dict | None = None
    ) -> None:
        """Create run ``run_id`` for vectors of projection ``spec``, or check that the existing run was
        captured with the same spec (raises ``ProjectionMismatchError`` naming what differs)."""
        if self.has_run(run_id):
            check_spec(self.run_spec(run_id), spec)
            return
        projection = {**spec.to_dict(), "fingerprint": spec.fingerprint()}
        self.create_run(run_id, dim=spec.dim, projection=projection, model_fingerprint=model_fingerprint, config=config)

    # ------------------------------------------------------------------ checkpoints
    @writes("record a checkpoint")
    def record_checkpoint(
        self,
        run_id: str,
        checkpoint: str,
        *,
        step: int | None = None,
        epoch: int | None = None,
        learning_rate: float | None = None,
    ) -> None:
        """Record (or update) a checkpoint of a run with its step, epoch and learning rate."""
        self.run(run_id)
        row = pa.Table.from_pylist(
            [
                {
                    "run_id": run_id,
                    "checkpoint": checkpoint,
                    "step": step,
                    "epoch": epoch,
                    "learning_rate": learning_rate,
                    "created_at": datetime.now(timezone.utc),
                }
            ],
            schema=S.CHECKPOINTS_SCHEMA,
        )
        commits.upsert(self.table(S.CHECKPOINTS), row, ["run_id", "checkpoint"], "checkpoint record")

    def checkpoints(self, run_id: str | None = None) -> pa.Table:
        """Checkpoints (of one run, or all), ordered by step. A :meth:`scan`, so repeated calls (every call that
        defaults its checkpoint) on the same version of the ``checkpoints`` table read nothing."""
        where = None if run_id is None else f"run_id = {sql_literal(run_id)}"
        return self.scan(S.CHECKPOINTS, where=where).sort_by([("run_id", "ascending"), ("step", "ascending")])

    def default_checkpoint(self, run_id: str) -> str | None:
        """The checkpoint a call on run ``run_id`` uses when given none: the run's latest recorded checkpoint
        (by step, then recording time); for a run with none recorded (vectors written by hand), the checkpoint
        label its rows carry (``None`` if they carry none: every row of the run), ``"train"`` when it has no
        rows. Rows carrying several labels and no recorded checkpoint raise ``InvalidArgumentError``."""
        self.run(run_id)
        checkpoints = self.checkpoints(run_id).sort_by([("step", "ascending"), ("created_at", "ascending")])
        if checkpoints.num_rows:
            return checkpoints.column("checkpoint")[checkpoints.num_rows - 1].as_py()
        labels = self._row_checkpoints(run_id)
        if len(labels) > 1:
            raise InvalidArgumentError(
                f"run {run_id!r} records no checkpoint and its rows carry several checkpoint labels "
                f"{sorted(labels, key=str)}: pass checkpoint=..."
            )
        return labels.pop() if labels else S.DEFAULT_CHECKPOINT

    def _row_checkpoints(self, run_id: str) -> set[str | None]:
        """The distinct ``checkpoint`` values of run ``run_id``'s rows (one column streamed once per version of
        the run's gradient table, then kept in the row cache)."""
        name = self.gradient_table_name(run_id)
        with self.reading(name):
            dataset = self.dataset(name)

            def read() -> frozenset[str | None]:
                labels: set[str | None] = set()
                scanner = dataset.scanner(columns=["checkpoint"], filter=gradient_filter(run_id))
                for batch in scanner.to_batches():
                    labels.update(batch.column(0).unique().to_pylist())
                return frozenset(labels)

            return set(self.row_cache.memo((dataset.version, name, "checkpoint labels", run_id), read, RUN_ROW_BYTES))

    @writes("save curvature statistics")
    def save_curvature(self, run_id: str, checkpoint: str, stats: LayerCurvature, split: str = "train") -> None:
        """Save per-layer Kronecker curvature statistics of a run's checkpoint over its rows of ``split``
        (``"train"`` or ``"true-fisher"``, one side file each)."""
        self.run(run_id)
        save_curvature(self.files, run_id, checkpoint, stats, split)

    def load_curvature(self, run_id: str, checkpoint: str, split: str = "train") -> LayerCurvature:
        """Per layer ``(A, S, count)`` of the checkpoint's rows of ``split`` saved by a capture with
        ``curvature=True`` (``MissingCurvatureError`` if none was)."""
        return load_curvature(self.files, run_id, checkpoint, split)

    def has_curvature(self, run_id: str, checkpoint: str, split: str = "train") -> bool:
        """Whether a capture with ``curvature=True`` saved statistics of the checkpoint's rows of ``split``."""
        return has_curvature(self.files, run_id, checkpoint, split)

    # ------------------------------------------------------------------ writing and reading gradients
    @writes("write gradients")
    def writer(self, run_id: str, config: WriterConfig | None = None, **thresholds: Any) -> GradientWriter:
        """A streaming writer for ``run_id`` (see :class:`gradstore.core.writer.GradientWriter`) into the run's
        own gradient table. Keyword arguments override :class:`~gradstore.core.writer.WriterConfig` fields.
        """
        if thresholds:
            config = WriterConfig(**{**(config or WriterConfig()).__dict__, **thresholds})
        return GradientWriter(
            commits.InertTable(self.gradient_table(run_id)),
            run_id=run_id,
            dim=self.run_dim(run_id),
            storage_dtype=self.storage_dtype,
            config=config,
            id_tables=self.other_gradient_tables(run_id),  # grad_ids unique across the store, not one table
        )

    def iter_gradients(
        self,
        run: Names | None = None,
        *,
        checkpoint: Names | None = None,
        split: Names | None = None,
        steps: StepRange | None = None,
        where: str | None = None,
        columns: Sequence[str] = ("example_id",),
        block_rows: int = 65536,
        selected_rows: int | None = None,
    ) -> Iterator[GradientBlock]:
        """Stream matching gradient rows as float32 blocks of at most ``block_rows`` rows.

        Filters combine with AND; ``where`` is a SQL filter on metadata columns. Only one block is
        in memory at a time. The rows come from one gradient table: ``run`` may be omitted only while the
        store holds one dim, and runs of several dims raise ``InvalidArgumentError`` (a block never mixes dims).
        ``selected_rows``, when the caller knows how many rows match, lets a scan that keeps most of the table
        read every row's vector instead of taking the matching ones
        (:func:`~gradstore.core.vector_scanner.late_materialization`).
        """
        name = self._table_of_runs(run)
        if name is None:
            return
        wanted = ["grad_id", *[c for c in columns if c != "grad_id"], S.VECTOR_COLUMN, S.NORM_COLUMN]
        dataset = self.dataset(name)
        unknown = set(wanted) - set(dataset.schema.names)
        if unknown:
            raise SchemaMismatchError(f"gradients table has no column(s) {sorted(unknown)}")
        late = selected_rows is None or late_materialization(selected_rows, dataset.count_rows())
        scanner = vector_scanner(
            dataset, wanted, gradient_filter(run, checkpoint, split, steps, where), block_rows, late
        )
        dtype = self.storage_dtype
        metadata_columns = wanted[1:-2]

        def read() -> Iterator[pa.RecordBatch]:  # opens the reader on the first next(), inside the try below
            yield from _rebatch(scanner.to_reader(), block_rows)

        batches = read()
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except _READ_ERRORS as error:
                raise self._unreadable(name, error) from error
            yield GradientBlock.from_batch(batch, metadata_columns, dtype)

    def _table_of_runs(self, run: Names | None) -> str | None:
        """The one gradient table holding ``run``'s rows (every gradient's, for ``None``); ``None`` if the store
        has no gradient table yet."""
        runs = [run] if isinstance(run, str) else list(run or [])
        if not runs:
            tables = self.gradient_tables.by_dim()
            if len(tables) > 1:
                raise InvalidArgumentError(
                    f"store {self.uri} holds runs of several dims {list(tables)}: pass run=... "
                    "(the rows of one read share one dim)"
                )
            return next(iter(tables.values()), None)
        names = {self.gradient_table_name(name) for name in runs}
        if len(names) > 1:
            dims = {name: self.run_dim(name) for name in runs}
            raise InvalidArgumentError(f"runs of several dims {dims} cannot be read together: read one dim at a time")
        return names.pop()

    def read_gradients(
        self,
        run: Names | None = None,
        *,
        checkpoint: Names | None = None,
        split: Names | None = None,
        steps: StepRange | None = None,
        where: str | None = None,
        columns: Sequence[str] = ("example_id",),
    ) -> GradientBlock:
        """All matching rows in one block (for small selections; prefer :meth:`iter_gradients`)."""
        blocks = list(
            self.iter_gradients(run, checkpoint=checkpoint, split=split, steps=steps, where=where, columns=columns)
        )
        if not blocks:
            name = self._table_of_runs(run)
            names = [c for c in columns if c != "grad_id"]
            schema = self.table(name).schema if name is not None else None
            empty = pa.schema([schema.field(c) for c in names]).empty_table() if schema is not None else pa.table({})
            dim = table_dim(schema) if schema is not None else 0
            return GradientBlock(np.empty(0, np.int64), np.empty((0, dim), np.float32), empty)
        return GradientBlock(
            np.concatenate([b.grad_ids for b in blocks]),
            np.concatenate([b.vectors for b in blocks]),
            pa.concat_tables([b.metadata for b in blocks]),
        )

    def count(self, table: str = S.GRADIENTS, where: str | None = None) -> int:
        """Row count of a table (0 if it does not exist yet); ``gradients`` counts the rows of every dim."""
        names = list(self.gradient_tables.by_dim().values()) if table == S.GRADIENTS else [table]
        total = 0
        for name in names:
            if self.has_table(name):
                with self.reading(name):
                    total += self.dataset(name).count_rows(where)
        return total

    def example_ids_for(self, grad_ids: np.ndarray, run: str | None = None) -> dict[int, str]:
        """``grad_id -> example_id`` for the given ids of run ``run`` (``None``: looked up in every gradient
        table); one filtered scan of two int/string columns per table."""
        unique = np.unique(grad_ids)
        if len(unique) == 0:
            return {}
        names = [self.gradient_table_name(run)] if run is not None else self.gradient_tables.by_dim().values()
        found: dict[int, str] = {}
        for name in names:
            with self.reading(name):
                table = self.dataset(name).to_table(
                    columns=["grad_id", "example_id"],
                    filter=f"grad_id IN ({', '.join(str(int(g)) for g in unique)})",
                )
            found.update(zip(table.column("grad_id").to_pylist(), table.column("example_id").to_pylist()))
        return found

    # ------------------------------------------------------------------ examples and results
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
        if not self.has_table(S.EXAMPLES):
            self._create_table(S.EXAMPLES, table.schema.with_metadata({S.FORMAT_KEY: S.FORMAT_VERSION}))
        existing = self.table(S.EXAMPLES).schema
        if set(existing.names) != set(table.column_names):
            raise SchemaMismatchError(f"examples must have columns {existing.names}, got {table.column_names}")
        try:
            table = table.select(existing.names).cast(existing)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise SchemaMismatchError(f"examples do not match the stored schema: {error}") from None
        table = _last_row_per_id(table)
        commits.upsert(self.table(S.EXAMPLES), table, ["example_id"], "add_examples")
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
        commits.append(self.table(name), table.select(schema.names).cast(schema), f"{name} results")
        return call_id

    def _add_missing_string_columns(self, name: str, schema: pa.Schema) -> None:
        """Give a table made by an earlier version the (string) columns of ``schema`` it lacks, as nulls."""
        missing = [f.name for f in schema if f.name not in self.table(name).schema.names]
        if missing:
            if any(schema.field(column).type != pa.string() for column in missing):
                raise StoreCorruptError(f"table {name!r} lacks columns {missing} that cannot be added")
            dataset = self.table(name).to_lance()
            commits.retrying(
                lambda: dataset.add_columns({c: "CAST(NULL AS STRING)" for c in missing}), f"{name} columns"
            )
            self.table(name).checkout_latest()

    @writes("append rows to a table")
    def append_table(self, name: str, rows: pa.Table) -> None:
        """Append ``rows`` to table ``name``, creating it with their schema on first use (for tables of the
        layers above, such as ``evaluations``)."""
        if is_gradient_table(name):
            raise InvalidNameError(f"table {name!r} is a gradient table's name; write gradients with store.writer")
        if not self.has_table(name):
            self._create_table(name, rows.schema.with_metadata({S.FORMAT_KEY: S.FORMAT_VERSION}))
        existing = self.table(name).schema
        try:
            rows = rows.select(existing.names).cast(existing)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise SchemaMismatchError(f"rows for table {name!r} do not match its schema: {error}") from None
        commits.append(self.table(name), rows, f"{name} rows")

    # ------------------------------------------------------------------ SQL
    def sql(self, query: str):
        """Run read-only DuckDB SQL over every table (vectors excluded); returns a DuckDB relation.

        ``gradients`` holds the rows of every run of every dim; ``gradients_<dim>`` those of one dim."""
        tables = {name: self.dataset(name) for name in self._list_tables() if not is_gradient_table(name)}
        by_dim = {f"{S.GRADIENTS}_{dim}": self.dataset(name) for dim, name in self.gradient_tables.by_dim().items()}
        unions = {S.GRADIENTS: list(by_dim)} if len(by_dim) > 1 else {}
        if len(by_dim) == 1:
            tables[S.GRADIENTS] = next(iter(by_dim.values()))
        tables.update(by_dim)
        columns = {name: table.schema.names for name, table in tables.items()}
        self._sql_connection = store_sql.connect(
            tables,
            macros_for(columns),  # lives with its relation
            self.storage_options,
            unions,
        )
        return store_sql.run_query(self._sql_connection, query)

    # ------------------------------------------------------------------ maintenance
    @writes("compact the tables")
    def compact(self, cleanup_older_than: timedelta | None = None) -> dict[str, int]:
        """Compact every table's fragments; optionally delete versions older than ``cleanup_older_than``.

        Returns the fragment count of each table after compaction.
        """
        counts = {}
        for name in self.db.list_tables().tables:
            if len(self.table(name).to_lance().get_fragments()) > 1:
                commits.compact(self.table(name), f"compaction of {name!r}")
            if cleanup_older_than is not None:
                self.table(name).to_lance().cleanup_old_versions(older_than=cleanup_older_than)
            counts[name] = len(self.table(name).to_lance().get_fragments())
        return counts

    def verify(self) -> VerifyReport:
        """Read every table and side file and report what is damaged (see :mod:`gradstore.core.verify`)."""
        return verify_store(self)

    def info(self) -> dict[str, Any]:
        """A summary: tables with rows, fragments and versions, runs with their dims, dims, dtype, bytes on disk,
        and each run's capture coverage (:func:`gradstore.core.coverage.run_coverage`).

        ``dim`` is the store's one dim, or ``None`` while it holds none or several (see ``dims``)."""
        tables = {}
        for name in sorted(self._list_tables()):
            dataset = self.table(name).to_lance()
            tables[name] = {
                "rows": dataset.count_rows(),
                "fragments": len(dataset.get_fragments()),
                "version": dataset.version,
            }
        size = self.files.bytes_under_store()
        runs = self.runs() if self.has_table(S.RUNS) else S.RUNS_SCHEMA.empty_table()
        dims = self.dims
        return {
            "uri": self.uri,
            "dim": dims[0] if len(dims) == 1 else None,
            "dims": dims,
            "storage_dtype": self.storage_dtype,
            "runs": runs.column("run_id").to_pylist(),
            "run_dims": dict(zip(runs.column("run_id").to_pylist(), runs.column("dim").to_pylist())),
            "tables": tables,
            "bytes_on_disk": size,
            "coverage": run_coverage(self),
        }


def check_spec(expected: ProjectionSpec, found: ProjectionSpec) -> None:
    """``expected.check_matches(found)`` raising gradstore's ``ProjectionMismatchError``."""
    try:
        expected.check_matches(found)
    except LowerProjectionMismatchError as error:
        raise ProjectionMismatchError(*error.args) from error


def _last_row_per_id(table: pa.Table) -> pa.Table:
    """``table`` with only the last row of each ``example_id``."""
    last = {example_id: i for i, example_id in enumerate(table.column("example_id").to_pylist())}
    return table if len(last) == table.num_rows else table.take(sorted(last.values()))


def _rebatch(reader: pa.RecordBatchReader, rows: int) -> Iterator[pa.RecordBatch]:
    """Regroup a stream of record batches into batches of ``rows`` rows (the last may be shorter)."""
    pending: list[pa.RecordBatch] = []
    count = 0
    for batch in reader:
        pending.append(batch)
        count += batch.num_rows
        while count >= rows:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, rows).combine_chunks().to_batches()[0]
            rest = table.slice(rows)
            pending, count = rest.combine_chunks().to_batches() if rest.num_rows else [], rest.num_rows
    if count:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]


def connect(
    uri: str | Path,
    store_class: type[StoreCore] = StoreCore,
    *,
    create: bool = True,
    storage_dtype: str | None = None,
    read_consistency: timedelta = timedelta(0),
    storage_options: dict[str, str] | None = None,
    row_files: bool | str | Path | RowFiles = True,
) -> StoreCore:
    """Create or open the store at ``uri`` as an instance of ``store_class`` (see :func:`gradstore.open`)."""
    uri = str(uri)
    options = storage.storage_options(uri, storage_options)
    if storage_dtype is not None:
        check_storage_dtype(storage_dtype)
    if "://" not in uri:
        path = Path(uri)
        try:
            if path.exists() and not path.is_dir():
                raise NotAStoreError(f"{uri} is a file, not a gradstore store (a directory)")
            is_new = not path.exists() or not any(path.iterdir())
            if not is_new and not (path / f"{S.RUNS}.lance").exists():
                raise NotAStoreError(f"{uri} exists but is not a gradstore store (no '{S.RUNS}' table)")
        except GradstoreError:
            raise
        except OSError as error:
            raise _open_error(error, uri) from error
        if is_new and not create:
            raise NotAStoreError(f"no gradstore store at {uri} (pass create=True to make one)")
    try:
        db = lancedb.connect(uri, read_consistency_interval=read_consistency, storage_options=options)
        files = row_files if isinstance(row_files, RowFiles) else RowFiles(row_files_directory(row_files))
        store = store_class(uri, db, storage_dtype or DEFAULT_STORAGE_DTYPE, options, files)
        exists = store.has_table(S.RUNS)
    except GradstoreError:
        raise
    except Exception as error:
        raise _open_error(error, uri) from error
    if exists:
        runs_schema = store.table(S.RUNS).schema
        if (runs_schema.metadata or {}).get(S.FORMAT_KEY) != S.FORMAT_VERSION:
            raise NotAStoreError(f"{uri} holds a '{S.RUNS}' table that gradstore did not write")
    elif not create:
        raise NotAStoreError(f"no gradstore store at {uri}")
    elif not store.writable:
        raise StorePermissionError(
            f"cannot create a store at {uri}: this process may not write there; {storage.PERMISSION_ADVICE}"
        )
    try:
        store._ensure_fixed_tables()
    except GradstoreError:
        raise
    except Exception as error:
        refused = storage.permission_error(error, uri, "create the fixed tables")
        if refused is None:
            raise
        raise refused from error
    # with rows, the gradient table's dtype (read only to check one asked for: a store whose rows this version cannot
    # decode still opens); before any run, the dtype recorded when the store was created
    has_rows = store.gradient_tables.primary_dim() is not None
    fixed = (store.storage_dtype if storage_dtype is not None else None) if has_rows else store.created_storage_dtype()
    if fixed is not None:
        if storage_dtype is not None and fixed != storage_dtype:
            raise SchemaMismatchError(
                f"store {uri} stores {fixed} vectors, not {storage_dtype}: a store's storage_dtype is fixed when it is "
                f"created; open it without storage_dtype (or with storage_dtype={fixed!r}), or create a new store"
            )
        store._storage_dtype = fixed  # what its runs' new gradient tables are created with
    return store


def _open_error(error: BaseException, uri: str) -> GradstoreError:
    """What a failure to open the store at ``uri`` is: storage refusing access (``StorePermissionError``), no store
    there (``NotAStoreError``), else unreadable data (``StoreCorruptError``)."""
    refused = storage.permission_error(error, uri, "open")
    if refused is not None:
        return refused
    if storage.is_missing_error(error):
        return NotAStoreError(f"no gradstore store at {uri}: {error}")
    return StoreCorruptError(f"cannot open store {uri}: {error}")
