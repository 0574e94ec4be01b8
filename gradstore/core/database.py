"""The store's core: one LanceDB database holding runs, checkpoints, gradients, examples and results.

:class:`StoreCore` is the data-access layer every higher module works on. It holds one part per job, each in its
own module of ``gradstore.core``:

- ``tables`` (:class:`~gradstore.core.tables.Tables`): opening, snapshotting, scanning and creating tables, counts,
  write permission;
- ``catalog`` (:class:`~gradstore.core.catalog.RunCatalog`): runs, checkpoints, dims and each run's gradient table;
- ``curvature`` (:class:`~gradstore.core.curvature_files.Curvature`): Kronecker statistics of checkpoints;
- ``gradients`` (:class:`~gradstore.core.gradient_io.GradientIO`): writers and reads of gradient rows;
- ``results`` (:class:`~gradstore.core.results.Results`): examples, result tables and other tables;
- ``maintenance`` (:class:`~gradstore.core.maintenance.Maintenance`): compaction, verification, the summary;
- ``files`` (:class:`~gradstore.core.sidefiles.SideFiles`), ``row_cache``, ``row_files``, ``scan_files``,
  ``index_cache``: what is kept beside the tables and in memory.

The calls the layers above make most (reading a run, its checkpoints, its rows; writing rows and results) answer
on ``StoreCore`` itself and pass straight to their part; everything else is asked of the part. It imports nothing
above ``gradstore.core``; the user-facing :class:`gradstore.GradStore` *holds* a ``StoreCore`` (``store.core``) and
adds capture, attribution and selection.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import lance
import lancedb
import numpy as np
import pyarrow as pa

from gradstore.core import schema as S
from gradstore.core import sql as store_sql
from gradstore.core import storage
from gradstore.core.catalog import RunCatalog
from gradstore.core.curvature_files import Curvature, LayerCurvature
from gradstore.core.filters import StepRange
from gradstore.core.gradient_io import GradientBlock, GradientIO, Names
from gradstore.core.index_cache import IndexCache
from gradstore.core.maintenance import Maintenance
from gradstore.core.results import Results
from gradstore.core.row_cache import SCANS_DIRECTORY, RowCache, RowFiles, ScanFiles, row_files_directory
from gradstore.core.sidefiles import SideFiles
from gradstore.core.tables import Tables
from gradstore.core.vectors import DEFAULT_STORAGE_DTYPE, check_storage_dtype
from gradstore.core.writer import GradientWriter, WriterConfig
from gradstore.errors import (
    GradstoreError,
    InvalidArgumentError,
    NotAStoreError,
    SchemaMismatchError,
    StoreCorruptError,
    StorePermissionError,
)
from ingest import ProjectionSpec

_Call = TypeVar("_Call", bound=Callable[..., Any])


def one_snapshot(function: _Call) -> _Call:
    """Decorate ``function(store, ...)`` (a call on a :class:`StoreCore`) to run inside ``store.snapshot()``: all its
    reads see one version of each table. For calls that write, if at all, only after their last read."""

    @functools.wraps(function)
    def in_snapshot(store: StoreCore, *args: Any, **kwargs: Any) -> Any:
        with store.snapshot():
            return function(store, *args, **kwargs)

    return in_snapshot  # type: ignore[return-value]


def as_core(store: Any) -> StoreCore:
    """The :class:`StoreCore` of ``store``: a facade's ``core``, or ``store`` itself."""
    return getattr(store, "core", store)


class StoreCore:
    """The parts of one store (see the module docstring), and the calls the layers above make most."""

    #: The names of the parts, in the order their own names are looked up (:meth:`part_of`).
    PARTS = ("tables", "catalog", "gradients", "results", "curvature", "maintenance")

    def __init__(
        self,
        uri: str,
        db: lancedb.DBConnection,
        storage_dtype: str,
        storage_options: dict[str, str] | None = None,
        row_files: RowFiles | None = None,
    ) -> None:
        self.uri = uri
        self.storage_options = storage_options
        self.files = SideFiles(uri, storage_options)
        self.row_cache = RowCache()  # rows prepared for search, by gradients version and selection
        self.index_cache = IndexCache()  # loaded FAISS indexes, by name and manifest (gradstore.core.index_cache)
        self.row_files = row_files or RowFiles(None)  # the same, on local disk between processes
        scans = None if self.row_files.directory is None else self.row_files.directory / SCANS_DIRECTORY
        self.scan_files = ScanFiles(scans)  # small reads (runs, checkpoints, a selection's ids), the same
        self.tables = Tables(uri, db, storage_options, self.files, self.row_cache, self.scan_files)
        self.gradient_tables = self.tables.gradient_tables
        self.catalog = RunCatalog(self.tables, storage_dtype)
        self.curvature = Curvature(self.catalog)
        self.gradients = GradientIO(self.tables, self.catalog)
        self.results = Results(self.tables)
        self.maintenance = Maintenance(self.tables, self.catalog)

    def part_of(self, name: str) -> str | None:
        """The name of the part that answers ``name`` (``None``: none does), for messages about moved names."""
        return next((part for part in self.PARTS if hasattr(getattr(self, part), name)), None)

    @property
    def db(self) -> lancedb.DBConnection:
        """The store's LanceDB connection."""
        return self.tables.db

    @property
    def location(self) -> str:
        """The store's URI, a local path made absolute (what names the store in cache files)."""
        return self.tables.location

    # ------------------------------------------------------------------ tables (Tables)
    @property
    def writable(self) -> bool:
        """Whether this process may write the store (see :attr:`gradstore.core.tables.Tables.writable`)."""
        return self.tables.writable

    def require_writable(self, what: str) -> None:
        """Raise ``StorePermissionError`` if this process may not write the store (``what``: the write asked for)."""
        self.tables.require_writable(what)

    def writing(self, what: str) -> AbstractContextManager[None]:
        """A write of the store (:meth:`Tables.writing <gradstore.core.tables.Tables.writing>`)."""
        return self.tables.writing(what)

    def has_table(self, name: str) -> bool:
        """Whether the store holds table ``name``."""
        return self.tables.has_table(name)

    def table(self, name: str):
        """The LanceDB table ``name`` (:meth:`Tables.table <gradstore.core.tables.Tables.table>`)."""
        return self.tables.table(name)

    def dataset(self, name: str) -> lance.LanceDataset:
        """Table ``name``'s Lance dataset (:meth:`Tables.dataset <gradstore.core.tables.Tables.dataset>`)."""
        return self.tables.dataset(name)

    def scan(
        self,
        name: str,
        columns: Sequence[str] | None = None,
        where: str | None = None,
        row_address: bool = False,
        *,
        cache: bool = True,
    ) -> pa.Table:
        """A small metadata read, cached unless ``cache=False`` (:meth:`Tables.scan
        <gradstore.core.tables.Tables.scan>`)."""
        return self.tables.scan(name, columns, where, row_address, cache=cache)

    def reading(self, name: str) -> AbstractContextManager[None]:
        """Reads of table ``name`` (:meth:`Tables.reading <gradstore.core.tables.Tables.reading>`)."""
        return self.tables.reading(name)

    def snapshot(self) -> AbstractContextManager[None]:
        """One view of every table for a block (:meth:`Tables.snapshot <gradstore.core.tables.Tables.snapshot>`)."""
        return self.tables.snapshot()

    def past_snapshot(self) -> AbstractContextManager[None]:
        """Latest versions inside a snapshot (see :meth:`gradstore.core.tables.Tables.past_snapshot`)."""
        return self.tables.past_snapshot()

    # ------------------------------------------------------------------ runs and checkpoints (RunCatalog)
    @property
    def storage_dtype(self) -> str:
        """Storage dtype of the vector column, one per store (:attr:`RunCatalog.storage_dtype
        <gradstore.core.catalog.RunCatalog.storage_dtype>`)."""
        return self.catalog.storage_dtype

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
        """Register a capture run (:meth:`RunCatalog.create_run <gradstore.core.catalog.RunCatalog.create_run>`)."""
        return self.catalog.create_run(
            run_id,
            dim=dim,
            projection=projection,
            model_fingerprint=model_fingerprint,
            config=config,
            exist_ok=exist_ok,
        )

    def run(self, run_id: str) -> dict:
        """The ``runs`` row of ``run_id`` as a dict (raises ``UnknownRunError``)."""
        return self.catalog.run(run_id)

    def has_run(self, run_id: str) -> bool:
        """Whether the store holds run ``run_id``."""
        return self.catalog.has_run(run_id)

    def run_dim(self, run_id: str) -> int:
        """The dim of run ``run_id``'s vectors (raises ``UnknownRunError``)."""
        return self.catalog.run_dim(run_id)

    def run_config(self, run_id: str) -> dict:
        """The JSON config a run was created with (capture options, notes)."""
        return self.catalog.run_config(run_id)

    def run_projection(self, run_id: str) -> dict | None:
        """The projection spec a run was captured with as a dict (``None`` for a run created without one)."""
        return self.catalog.run_projection(run_id)

    def run_spec(self, run_id: str, needed_for: str | None = None) -> ProjectionSpec:
        """The run's projection spec (:meth:`RunCatalog.run_spec <gradstore.core.catalog.RunCatalog.run_spec>`)."""
        return self.catalog.run_spec(run_id, needed_for)

    def gradient_table_name(self, run_id: str) -> str:
        """The name of the table holding run ``run_id``'s rows."""
        return self.catalog.gradient_table_name(run_id)

    def gradient_table(self, run_id: str):
        """The LanceDB table holding run ``run_id``'s rows."""
        return self.catalog.gradient_table(run_id)

    def gradient_dataset(self, run_id: str) -> lance.LanceDataset:
        """The Lance dataset of run ``run_id``'s rows (pinned inside a snapshot)."""
        return self.catalog.gradient_dataset(run_id)

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
        self.catalog.record_checkpoint(run_id, checkpoint, step=step, epoch=epoch, learning_rate=learning_rate)

    def checkpoints(self, run_id: str | None = None) -> pa.Table:
        """Checkpoints (of one run, or all), ordered by step."""
        return self.catalog.checkpoints(run_id)

    def default_checkpoint(self, run_id: str) -> str | None:
        """The checkpoint a call on run ``run_id`` uses when given none (:meth:`RunCatalog.default_checkpoint
        <gradstore.core.catalog.RunCatalog.default_checkpoint>`)."""
        return self.catalog.default_checkpoint(run_id)

    # ------------------------------------------------------------------ curvature (Curvature)
    def load_curvature(self, run_id: str, checkpoint: str, split: str = "train") -> LayerCurvature:
        """Per layer ``(A, S, count)`` of a checkpoint's rows of ``split`` (``MissingCurvatureError`` if none)."""
        return self.curvature.load(run_id, checkpoint, split)

    def has_curvature(self, run_id: str, checkpoint: str, split: str = "train") -> bool:
        """Whether a capture with ``curvature=True`` saved statistics of the checkpoint's rows of ``split``."""
        return self.curvature.has(run_id, checkpoint, split)

    # ------------------------------------------------------------------ gradient rows (GradientIO)
    def writer(self, run_id: str, config: WriterConfig | None = None, **thresholds: Any) -> GradientWriter:
        """A streaming writer for ``run_id`` (see :meth:`gradstore.core.gradient_io.GradientIO.writer`)."""
        return self.gradients.writer(run_id, config, **thresholds)

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
        """Stream matching gradient rows as float32 blocks (:meth:`GradientIO.iter_gradients
        <gradstore.core.gradient_io.GradientIO.iter_gradients>`)."""
        return self.gradients.iter_gradients(
            run,
            checkpoint=checkpoint,
            split=split,
            steps=steps,
            where=where,
            columns=columns,
            block_rows=block_rows,
            selected_rows=selected_rows,
        )

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
        return self.gradients.read_gradients(
            run, checkpoint=checkpoint, split=split, steps=steps, where=where, columns=columns
        )

    def example_ids_for(self, grad_ids: np.ndarray, run: str | None = None) -> dict[int, str]:
        """``grad_id -> example_id`` for the given ids of run ``run`` (``None``: every gradient table)."""
        return self.gradients.example_ids_for(grad_ids, run)

    # ------------------------------------------------------------------ results and SQL
    def append_results(self, name: str, table: pa.Table) -> str:
        """Append a result table (:meth:`Results.append_results <gradstore.core.results.Results.append_results>`)."""
        return self.results.append_results(name, table)

    def sql(self, query: str):
        """Run read-only DuckDB SQL over every table (vectors excluded); returns a DuckDB relation.

        ``gradients`` holds the rows of every run of every dim; ``gradients_<dim>`` those of one dim."""
        self._sql_connection, relation = store_sql.query_store(self.tables, query)  # kept alive with its relation
        return relation


def _check_open_arguments(uri: Any, read_consistency: Any, storage_options: Any, row_files: Any) -> None:
    """Refuse arguments of :func:`connect` of a type it cannot use (an ``InvalidArgumentError`` saying what to
    pass), before anything is opened or created."""
    if not isinstance(uri, (str, os.PathLike)) or not str(uri):
        raise InvalidArgumentError(
            f"uri must be a local directory (a str or pathlib.Path) or an object-store URI such as 's3://bucket/x', "
            f"got {uri!r}"
        )
    if not isinstance(read_consistency, timedelta):
        raise InvalidArgumentError(
            f"read_consistency must be a datetime.timedelta (how stale a read may be), got {read_consistency!r}: "
            "e.g. timedelta(seconds=5)"
        )
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise InvalidArgumentError(
            f"storage_options must be a dict of object-store option names to values, got {storage_options!r}"
        )
    if not isinstance(row_files, (bool, str, os.PathLike, RowFiles)):
        raise InvalidArgumentError(
            "row_files must be True (the user's cache directory), False (none), a directory (a str or pathlib.Path) "
            f"or a gradstore.core.row_cache.RowFiles, got {row_files!r}"
        )


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
    _check_open_arguments(uri, read_consistency, storage_options, row_files)
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
        exists = store.tables.has_table(S.RUNS)
    except GradstoreError:
        raise
    except Exception as error:
        raise _open_error(error, uri) from error
    if exists:
        runs_schema = store.tables.table(S.RUNS).schema
        if (runs_schema.metadata or {}).get(S.FORMAT_KEY) != S.FORMAT_VERSION:
            raise NotAStoreError(f"{uri} holds a '{S.RUNS}' table that gradstore did not write")
    elif not create:
        raise NotAStoreError(f"no gradstore store at {uri}")
    elif not store.tables.writable:
        raise StorePermissionError(
            f"cannot create a store at {uri}: this process may not write there; {storage.PERMISSION_ADVICE}"
        )
    try:
        store.tables.ensure_fixed(store.catalog.new_store_dtype)
    except GradstoreError:
        raise
    except Exception as error:
        refused = storage.permission_error(error, uri, "create the fixed tables")
        if refused is None:
            raise
        raise refused from error
    # with rows, the gradient table's dtype (read only to check one asked for: a store whose rows this version cannot
    # decode still opens); before any run, the dtype recorded when the store was created
    has_rows = store.tables.gradient_tables.primary_dim() is not None
    fixed = (
        (store.storage_dtype if storage_dtype is not None else None)
        if has_rows
        else store.catalog.created_storage_dtype()
    )
    if fixed is not None:
        if storage_dtype is not None and fixed != storage_dtype:
            raise SchemaMismatchError(
                f"store {uri} stores {fixed} vectors, not {storage_dtype}: a store's storage_dtype is fixed when it is "
                f"created; open it without storage_dtype (or with storage_dtype={fixed!r}), or create a new store"
            )
        store.catalog.new_store_dtype = fixed  # what its runs' new gradient tables are created with
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
