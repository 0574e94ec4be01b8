"""The store: one LanceDB database holding runs, checkpoints, gradients, examples and scores."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pyarrow as pa

from gradstore import schema as S
from gradstore import sql as store_sql
from gradstore.errors import NotAStoreError, SchemaMismatchError, StoreCorruptError, UnknownRunError
from gradstore.tabular import to_arrow_table
from gradstore.vectors import DEFAULT_STORAGE_DTYPE, check_storage_dtype, decode, storage_dtype_of
from gradstore.writer import GradientWriter, WriterConfig

log = logging.getLogger(__name__)


@dataclass
class GradientBlock:
    """A block of stored gradients: float32 vectors with their ``grad_id``s and metadata columns."""

    grad_ids: np.ndarray  # int64 [n]
    vectors: np.ndarray  # float32 [n, dim]
    metadata: pa.Table  # the requested metadata columns, row-aligned

    def __len__(self) -> int:
        return len(self.grad_ids)

    def torch(self, device: str | None = None):
        """The vectors as a torch tensor (zero-copy on CPU)."""
        import torch

        return torch.from_numpy(self.vectors).to(device) if device else torch.from_numpy(self.vectors)


def sql_literal(value: str) -> str:
    """``value`` as a quoted SQL string literal (for Lance filters and DuckDB)."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_in(column: str, values: Sequence[str]) -> str:
    """``column IN ('a', 'b', ...)``."""
    return f"{column} IN ({', '.join(sql_literal(v) for v in values)})"


def gradient_filter(run: str | Sequence[str] | None = None, checkpoint: str | Sequence[str] | None = None,
                    split: str | Sequence[str] | None = None, steps: tuple[int | None, int | None] | None = None,
                    where: str | None = None) -> str | None:
    """A Lance filter expression selecting gradient rows (``None`` selects everything)."""
    clauses = []
    for column, value in (("run_id", run), ("checkpoint", checkpoint), ("split", split)):
        if value is None:
            continue
        values = [value] if isinstance(value, str) else list(value)
        clauses.append(sql_in(column, values))
    if steps is not None:
        low, high = steps
        if low is not None:
            clauses.append(f"step >= {int(low)}")
        if high is not None:
            clauses.append(f"step <= {int(high)}")
    if where:
        clauses.append(f"({where})")
    return " AND ".join(clauses) or None


class GradStore:
    """A gradient store. Create or open one with :func:`gradstore.open`."""

    def __init__(self, uri: str, db: lancedb.DBConnection, storage_dtype: str) -> None:
        self.uri = uri
        self.db = db
        self._storage_dtype = storage_dtype
        self._tables: dict[str, Any] = {}

    # ------------------------------------------------------------------ tables
    def has_table(self, name: str) -> bool:
        """Whether the store holds table ``name``."""
        return name in self._tables or name in self.db.list_tables().tables

    def table(self, name: str):
        """The LanceDB table ``name`` (raises ``KeyError`` if the store has none)."""
        if name not in self._tables:
            if not self.has_table(name):
                raise KeyError(f"the store has no table {name!r} yet")
            try:
                self._tables[name] = self.db.open_table(name)
            except Exception as error:
                raise StoreCorruptError(f"table {name!r} of store {self.uri} cannot be opened: {error}") from error
        return self._tables[name]

    def _create_table(self, name: str, schema: pa.Schema):
        self._tables[name] = self.db.create_table(name, schema=schema, exist_ok=True)
        return self._tables[name]

    def _ensure_fixed_tables(self) -> None:
        for name, schema in S.FIXED_SCHEMAS.items():
            if not self.has_table(name):
                self._create_table(name, schema)

    # ------------------------------------------------------------------ runs and checkpoints
    @property
    def dim(self) -> int | None:
        """Dimension of the stored vectors (``None`` until the first run is created)."""
        if not self.has_table(S.GRADIENTS):
            return None
        return self.table(S.GRADIENTS).schema.field(S.VECTOR_COLUMN).type.list_size

    @property
    def storage_dtype(self) -> str:
        """Storage dtype of the vector column (see :mod:`gradstore.vectors`)."""
        if self.has_table(S.GRADIENTS):
            return storage_dtype_of(self.table(S.GRADIENTS).schema.field(S.VECTOR_COLUMN).type)
        return self._storage_dtype

    def create_run(self, run_id: str, *, dim: int, projection: dict | None = None,
                   model_fingerprint: str | None = None, config: dict | None = None,
                   exist_ok: bool = False) -> dict:
        """Register a capture run of ``dim``-dimensional vectors with its projection spec.

        Re-creating an existing run with ``exist_ok=True`` checks that the projection spec is the same.
        """
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if self.dim is None:
            self._create_table(S.GRADIENTS, S.gradients_schema(dim, self._storage_dtype))
        elif self.dim != dim:
            raise SchemaMismatchError(f"this store holds {self.dim}-dimensional gradients; run {run_id!r} "
                                      f"would write {dim}-dimensional ones (use another store)")
        projection_json = json.dumps(projection, sort_keys=True) if projection is not None else None
        try:
            existing = self.run(run_id)
        except UnknownRunError:
            existing = None
        if existing is not None:
            if not exist_ok:
                raise ValueError(f"run {run_id!r} already exists (pass exist_ok=True to append to it)")
            if existing["projection"] != projection_json or existing["dim"] != dim:
                raise SchemaMismatchError(f"run {run_id!r} exists with a different projection spec or dim")
            return existing
        row = {"run_id": run_id, "created_at": datetime.now(timezone.utc), "model_fingerprint": model_fingerprint,
               "projection": projection_json, "projection_fingerprint": (projection or {}).get("fingerprint"),
               "dim": dim, "config": json.dumps(config or {}, sort_keys=True, default=str)}
        self.table(S.RUNS).add(pa.Table.from_pylist([row], schema=S.RUNS_SCHEMA))
        return row

    def run(self, run_id: str) -> dict:
        """The ``runs`` row of ``run_id`` as a dict (raises ``UnknownRunError``)."""
        rows = self.table(S.RUNS).search().where(f"run_id = {sql_literal(run_id)}").to_list()
        if not rows:
            known = self.table(S.RUNS).to_arrow().column("run_id").to_pylist()
            raise UnknownRunError(f"unknown run {run_id!r}; the store holds runs {known}")
        return rows[0]

    def has_run(self, run_id: str) -> bool:
        """Whether the store holds run ``run_id``."""
        return self.table(S.RUNS).count_rows(f"run_id = {sql_literal(run_id)}") > 0

    def run_config(self, run_id: str) -> dict:
        """The JSON config a run was created with (capture options, notes)."""
        return json.loads(self.run(run_id)["config"] or "{}")

    def ensure_run(self, run_id: str, spec: Any, model_fingerprint: str | None = None,
                   config: dict | None = None) -> None:
        """Create run ``run_id`` for vectors of projection ``spec`` (an ``ingest.ProjectionSpec``), or check
        that the existing run was captured with the same spec (raises ``ProjectionMismatchError``)."""
        from ingest.projection import ProjectionSpec

        if self.has_run(run_id):
            stored = self.run_projection(run_id)
            if stored is None:
                raise SchemaMismatchError(f"run {run_id!r} was created without a projection spec")
            ProjectionSpec.from_dict(stored).check_matches(spec)
            return
        projection = {**spec.to_dict(), "fingerprint": spec.fingerprint()}
        self.create_run(run_id, dim=spec.dim, projection=projection, model_fingerprint=model_fingerprint,
                        config=config)

    def run_spec(self, run_id: str):
        """The run's projection spec as an ``ingest.ProjectionSpec``."""
        from ingest.projection import ProjectionSpec

        stored = self.run_projection(run_id)
        if stored is None:
            raise SchemaMismatchError(f"run {run_id!r} has no projection spec")
        return ProjectionSpec.from_dict(stored)

    def capture(self, model: Any, run: str, *, optimizer: Any = None, per_example_loss: Any = None,
                grad_scaler: Any = None, learning_rate: float | None = None,
                writer: WriterConfig | None = None, **options: Any):
        """Capture per-example gradients of ``model`` into run ``run`` (a context manager).

        ``options`` are :class:`ingest.CaptureConfig` fields (``projection``, ``k_in``, ``k_out``, ``seed``,
        ``include``, ``loss_reduction``, ``split``, ``checkpoint``, ``curvature``...). For an existing run the
        projection and layer options default to the run's own, and a capture whose projection spec differs
        is refused. ``learning_rate`` overrides the optimizer's (for checkpoint passes without one).
        """
        from gradstore.capture import StoreCapture, config_for_run

        return StoreCapture(self, model, run, config_for_run(self, run, options), optimizer=optimizer,
                            per_example_loss=per_example_loss, grad_scaler=grad_scaler,
                            learning_rate=learning_rate, writer_config=writer)

    # ------------------------------------------------------------------ side files (curvature, indexes)
    def sidecar(self, *parts: str) -> Path:
        """A directory beside the tables for derived state (curvature statistics, indexes), created on demand."""
        if "://" in self.uri:
            raise NotImplementedError("side files (indexes, curvature) need a local store directory")
        path = Path(self.uri, "_gradstore", *parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def save_curvature(self, run_id: str, checkpoint: str, stats: dict) -> Path:
        """Save per-layer Kronecker curvature statistics of a run's checkpoint."""
        from gradstore.capture import curvature_arrays

        path = self.sidecar("runs", run_id) / f"curvature-{checkpoint}.npz"
        np.savez(path, **curvature_arrays(stats))
        return path

    def load_curvature(self, run_id: str, checkpoint: str) -> dict:
        """Per layer ``(A, S, count)`` saved by a capture with ``curvature=True``."""
        from gradstore.capture import curvature_from_arrays

        path = Path(self.uri, "_gradstore", "runs", run_id, f"curvature-{checkpoint}.npz")
        if not path.exists():
            raise FileNotFoundError(f"no curvature statistics for run {run_id!r} checkpoint {checkpoint!r}: "
                                    "capture with curvature=True")
        with np.load(path) as arrays:
            return curvature_from_arrays(arrays)

    def run_projection(self, run_id: str) -> dict | None:
        """The projection spec a run was captured with (``None`` for exact gradients)."""
        spec = self.run(run_id)["projection"]
        return json.loads(spec) if spec else None

    def runs(self) -> pa.Table:
        """All runs as an Arrow table."""
        return self.table(S.RUNS).to_arrow()

    def record_checkpoint(self, run_id: str, checkpoint: str, *, step: int | None = None,
                          epoch: int | None = None, learning_rate: float | None = None) -> None:
        """Record (or update) a checkpoint of a run with its step, epoch and learning rate."""
        self.run(run_id)
        row = pa.Table.from_pylist([{"run_id": run_id, "checkpoint": checkpoint, "step": step, "epoch": epoch,
                                     "learning_rate": learning_rate, "created_at": datetime.now(timezone.utc)}],
                                   schema=S.CHECKPOINTS_SCHEMA)
        (self.table(S.CHECKPOINTS).merge_insert(["run_id", "checkpoint"])
         .when_matched_update_all().when_not_matched_insert_all().execute(row))

    def checkpoints(self, run_id: str | None = None) -> pa.Table:
        """Checkpoints (of one run, or all), ordered by step."""
        query = self.table(S.CHECKPOINTS).search()
        if run_id is not None:
            query = query.where(f"run_id = {sql_literal(run_id)}")
        return query.to_arrow().sort_by([("run_id", "ascending"), ("step", "ascending")])

    # ------------------------------------------------------------------ writing and reading gradients
    def writer(self, run_id: str, config: WriterConfig | None = None, **thresholds: Any) -> GradientWriter:
        """A streaming writer for ``run_id`` (see :class:`gradstore.writer.GradientWriter`).

        Keyword arguments override :class:`~gradstore.writer.WriterConfig` fields.
        """
        self.run(run_id)
        if thresholds:
            config = WriterConfig(**{**(config or WriterConfig()).__dict__, **thresholds})
        return GradientWriter(self.table(S.GRADIENTS), run_id=run_id, dim=self.dim,
                              storage_dtype=self.storage_dtype, config=config)

    def iter_gradients(self, run: str | Sequence[str] | None = None, *, checkpoint: str | Sequence[str] | None = None,
                       split: str | Sequence[str] | None = None, steps: tuple[int | None, int | None] | None = None,
                       where: str | None = None, columns: Sequence[str] = ("example_id",),
                       block_rows: int = 65536) -> Iterator[GradientBlock]:
        """Stream matching gradient rows as float32 blocks of at most ``block_rows`` rows.

        Filters combine with AND; ``where`` is a Lance/SQL filter on metadata columns. Only one block is
        in memory at a time.
        """
        if self.dim is None:
            return
        for name in [run] if isinstance(run, str) else (run or []):
            self.run(name)
        wanted = ["grad_id", *[c for c in columns if c != "grad_id"], S.VECTOR_COLUMN, S.NORM_COLUMN]
        unknown = set(wanted) - set(self.table(S.GRADIENTS).schema.names)
        if unknown:
            raise SchemaMismatchError(f"gradients table has no column(s) {sorted(unknown)}")
        dataset = self.table(S.GRADIENTS).to_lance()
        scanner = dataset.scanner(columns=wanted, filter=gradient_filter(run, checkpoint, split, steps, where),
                                  batch_size=block_rows)
        dtype = self.storage_dtype
        for batch in _rebatch(scanner.to_reader(), block_rows):
            meta = pa.Table.from_batches([batch.select([c for c in wanted[1:-2]])]) if len(wanted) > 3 else \
                pa.table({})
            yield GradientBlock(grad_ids=np.array(batch.column("grad_id").to_numpy()),
                                vectors=decode(batch.column(S.VECTOR_COLUMN), batch.column(S.NORM_COLUMN), dtype),
                                metadata=meta)

    def read_gradients(self, run: str | Sequence[str] | None = None, **filters: Any) -> GradientBlock:
        """All matching rows in one block (for small selections; prefer :meth:`iter_gradients`)."""
        blocks = list(self.iter_gradients(run, **filters))
        if not blocks:
            columns = [c for c in filters.get("columns", ("example_id",)) if c != "grad_id"]
            schema = pa.schema([self.table(S.GRADIENTS).schema.field(c) for c in columns]) if self.dim else None
            empty = schema.empty_table() if schema is not None else pa.table({})
            return GradientBlock(np.empty(0, np.int64), np.empty((0, self.dim or 0), np.float32), empty)
        return GradientBlock(np.concatenate([b.grad_ids for b in blocks]),
                             np.concatenate([b.vectors for b in blocks]),
                             pa.concat_tables([b.metadata for b in blocks]))

    def count(self, table: str = S.GRADIENTS, where: str | None = None) -> int:
        """Row count of a table (0 if it does not exist yet)."""
        return self.table(table).count_rows(where) if self.has_table(table) else 0

    # ------------------------------------------------------------------ examples
    def add_examples(self, data: Any, id_column: str = "example_id") -> int:
        """Add training/query examples (any tabular input, see :func:`gradstore.tabular.to_arrow_table`).

        ``id_column`` names the column holding each example's id; it is stored as ``example_id`` (string).
        Later additions must have the same columns. Returns the number of rows added.
        """
        table = to_arrow_table(data)
        if id_column not in table.column_names:
            raise SchemaMismatchError(f"examples have no id column {id_column!r}; columns: {table.column_names}")
        ids = table.column(id_column).cast(pa.string())
        if ids.null_count:
            raise SchemaMismatchError(f"{ids.null_count} example(s) have no id in column {id_column!r}")
        table = table.drop_columns([id_column]) if id_column != "example_id" else table.drop_columns(["example_id"])
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
        self.table(S.EXAMPLES).add(table)
        return table.num_rows

    # ------------------------------------------------------------------ SQL
    def sql(self, query: str):
        """Run read-only DuckDB SQL over every table (vectors excluded); returns a DuckDB relation."""
        from gradstore.macros import macros_for

        tables = {name: self.table(name).to_lance() for name in self.db.list_tables().tables}
        self._sql_connection = store_sql.connect(tables, macros_for(set(tables)))  # lives with its relation
        return store_sql.run_query(self._sql_connection, query)

    # ------------------------------------------------------------------ attribution
    def build_index(self, run: str, *, checkpoint: str | None = None, method: str = "grad-dot",
                    damping: float | None = None, kind: str = "exact", split: str = "train",
                    where: str | None = None, name: str | None = None, refit: bool = False,
                    eigen_correction: bool = False):
        """Fit ``method``'s preconditioner over the run's rows and build/persist an index (incremental when
        rows were appended since). ``kind``: ``"exact"``, ``"auto"`` or a FAISS factory string."""
        from gradstore.attribution import default_checkpoint
        from gradstore.index import Selection, build_index

        selection = Selection(run, checkpoint or default_checkpoint(self, run), split, where)
        return build_index(self, selection, method, damping=damping, kind=kind, name=name, refit=refit,
                           eigen_correction=eigen_correction)

    def index(self, name: str):
        """Load a persisted index by name (``IndexMismatchError`` if it does not match the store)."""
        from gradstore.index import load_index

        return load_index(self, name)

    def attribute(self, queries: Any = None, *, run: str, k: int = 10, method: str = "grad-dot", **options: Any):
        """Top-k proponents (and with ``opponents=True`` opponents) of each query; see
        :func:`gradstore.attribution.attribute`. Returns a pyarrow Table, also appended to ``scores``."""
        from gradstore.attribution import attribute

        return attribute(self, queries, run=run, k=k, method=method, **options)

    def self_influence(self, *, run: str, method: str = "fisher", **options: Any):
        """Self-influence of every training row; see :func:`gradstore.attribution.self_influence`."""
        from gradstore.attribution import self_influence

        return self_influence(self, run=run, method=method, **options)

    def select(self, target: Any = None, *, run: str, budget: float = 0.05, **options: Any):
        """LESS-style data selection for a target set; see :func:`gradstore.selection.select`."""
        from gradstore.selection import select

        return select(self, target, run=run, budget=budget, **options)

    def report(self, out: str | Path = "report.html", *, run: str | None = None, max_queries: int = 1000,
               top: int = 10, selection: pa.Table | None = None) -> Path:
        """Write a self-contained HTML attribution report (opens offline); see :mod:`gradstore.report`."""
        from gradstore.report import ReportOptions, write_report

        return write_report(self, out, options=ReportOptions(run=run, max_queries=max_queries, top=top),
                            selection=selection)

    # ------------------------------------------------------------------ maintenance
    def compact(self, cleanup_older_than: timedelta | None = None) -> dict[str, int]:
        """Compact every table's fragments; optionally delete versions older than ``cleanup_older_than``.

        Returns the fragment count of each table after compaction.
        """
        counts = {}
        for name in self.db.list_tables().tables:
            dataset = self.table(name).to_lance()
            if len(dataset.get_fragments()) > 1:
                dataset.optimize.compact_files()
            if cleanup_older_than is not None:
                dataset.cleanup_old_versions(older_than=cleanup_older_than)
            counts[name] = len(self.table(name).to_lance().get_fragments())
        return counts

    def info(self) -> dict[str, Any]:
        """A summary: tables with rows, fragments and versions, runs, dim, dtype, bytes on disk."""
        tables = {}
        for name in sorted(self.db.list_tables().tables):
            dataset = self.table(name).to_lance()
            tables[name] = {"rows": dataset.count_rows(), "fragments": len(dataset.get_fragments()),
                            "version": dataset.version}
        path = Path(self.uri)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else None
        runs = self.runs().column("run_id").to_pylist() if self.has_table(S.RUNS) else []
        return {"uri": self.uri, "dim": self.dim, "storage_dtype": self.storage_dtype, "runs": runs,
                "tables": tables, "bytes_on_disk": size}


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


def open_store(uri: str | Path, *, create: bool = True, storage_dtype: str | None = None,
               read_consistency: timedelta = timedelta(0)) -> GradStore:
    """Create or open the store at ``uri`` (a local directory or an object-store URI LanceDB accepts).

    ``storage_dtype`` (``"float16"`` default, or ``"float32"``) applies when the gradients table is created;
    asking for a different one on an existing store is an error. ``read_consistency`` is how stale a read
    may be (0: always see other writers' latest commits).
    """
    uri = str(uri)
    local = "://" not in uri
    if storage_dtype is not None:
        check_storage_dtype(storage_dtype)
    if local:
        path = Path(uri)
        if path.exists() and not path.is_dir():
            raise NotAStoreError(f"{uri} is a file, not a gradstore store (a directory)")
        is_new = not path.exists() or not any(path.iterdir())
        if not is_new and not (path / f"{S.RUNS}.lance").exists():
            raise NotAStoreError(f"{uri} exists but is not a gradstore store (no '{S.RUNS}' table)")
        if is_new and not create:
            raise NotAStoreError(f"no gradstore store at {uri} (pass create=True to make one)")
    try:
        db = lancedb.connect(uri, read_consistency_interval=read_consistency)
        store = GradStore(uri, db, storage_dtype or DEFAULT_STORAGE_DTYPE)
        existing = set(db.list_tables().tables)
    except Exception as error:
        raise StoreCorruptError(f"cannot open store {uri}: {error}") from error
    if S.RUNS in existing:
        runs_schema = store.table(S.RUNS).schema
        if (runs_schema.metadata or {}).get(S.FORMAT_KEY) != S.FORMAT_VERSION:
            raise NotAStoreError(f"{uri} holds a '{S.RUNS}' table that gradstore did not write")
        if storage_dtype is not None and store.dim is not None and store.storage_dtype != storage_dtype:
            raise SchemaMismatchError(f"store {uri} stores {store.storage_dtype} vectors, not {storage_dtype}")
    elif not create:
        raise NotAStoreError(f"no gradstore store at {uri}")
    store._ensure_fixed_tables()
    return store
