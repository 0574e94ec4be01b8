"""The store's catalog of runs and checkpoints: which runs it holds, with their dims, projection specs and
configs, which gradient table holds each run's rows, and each run's checkpoints (:class:`RunCatalog`)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from gradstore.core import commits
from gradstore.core import schema as S
from gradstore.core.filters import gradient_filter, sql_literal
from gradstore.core.tables import Tables, writes
from gradstore.core.vectors import check_storage_dtype, storage_dtype_of
from gradstore.errors import (
    InvalidArgumentError,
    InvalidNameError,
    ProjectionMismatchError,
    SchemaMismatchError,
    StoreCorruptError,
    UnknownRunError,
)
from ingest import ProjectionMismatchError as LowerProjectionMismatchError
from ingest import ProjectionSpec

#: Bytes the row cache counts for a run's rows' checkpoint labels (small metadata kept per table version beside the
#: prepared rows, so repeated calls on a run read no column again).
RUN_ROW_BYTES = 4096


def check_run_name(run_id: str) -> str:
    """A run id must be a non-empty string (it is never used as a path: side files hash it)."""
    if not isinstance(run_id, str) or not run_id.strip():
        raise InvalidNameError(f"a run id must be a non-empty string, got {run_id!r}")
    return run_id


def check_spec(expected: ProjectionSpec, found: ProjectionSpec) -> None:
    """``expected.check_matches(found)`` raising gradstore's ``ProjectionMismatchError``."""
    try:
        expected.check_matches(found)
    except LowerProjectionMismatchError as error:
        raise ProjectionMismatchError(*error.args) from error


class RunCatalog:
    """The ``runs`` and ``checkpoints`` tables of a store, and the gradient table of each run.

    ``new_store_dtype`` is the dtype a store's first gradient table is created with (:func:`gradstore.core.connect`
    sets it to the one the store records)."""

    def __init__(self, tables: Tables, storage_dtype: str) -> None:
        self.tables = tables
        self.new_store_dtype = storage_dtype
        self._run_dims: dict[str, int] = {}  # a run's dim never changes

    @property
    def dims(self) -> list[int]:
        """The vector dimensions the store holds (one gradient table each), ascending."""
        return list(self.tables.gradient_tables.by_dim())

    @property
    def dim(self) -> int | None:
        """Dimension of the stored vectors: ``None`` until the first run is created; a store holding runs of
        several dims raises ``InvalidArgumentError`` (ask :meth:`run_dim` for a run's dim)."""
        dims = self.dims
        if len(dims) > 1:
            raise InvalidArgumentError(
                f"store {self.tables.uri} holds runs of several dims {dims}: use store.core.run_dim(run) (a run's dim)"
            )
        return dims[0] if dims else None

    def run_dim(self, run_id: str) -> int:
        """The dim of run ``run_id``'s vectors (raises ``UnknownRunError``)."""
        if run_id not in self._run_dims:
            self._run_dims[run_id] = int(self.run(run_id)["dim"])
        return self._run_dims[run_id]

    def gradient_table_name(self, run_id: str) -> str:
        """The name of the table holding run ``run_id``'s rows (see :mod:`gradstore.core.gradient_tables`)."""
        return self.tables.gradient_tables.name_for_dim(self.run_dim(run_id))

    def gradient_table(self, run_id: str):
        """The LanceDB table holding run ``run_id``'s rows."""
        return self.tables.table(self.gradient_table_name(run_id))

    def gradient_dataset(self, run_id: str) -> lance.LanceDataset:
        """The Lance dataset of run ``run_id``'s rows (as :meth:`Tables.dataset` gives it: pinned inside a snapshot)."""
        return self.tables.dataset(self.gradient_table_name(run_id))

    def other_gradient_tables(self, run_id: str) -> list[Any]:
        """The gradient tables of the dims other than run ``run_id``'s (a writer keeps its ``grad_id``s unique
        across them too)."""
        own = self.gradient_table_name(run_id)
        return [self.tables.table(name) for name in self.tables.gradient_tables.by_dim().values() if name != own]

    @property
    def storage_dtype(self) -> str:
        """Storage dtype of the vector column (see :mod:`gradstore.core.vectors`); one per store, fixed when the
        store is created (:meth:`created_storage_dtype`)."""
        if self.tables.gradient_tables.primary_dim() is not None:
            return storage_dtype_of(self.tables.dataset(S.GRADIENTS).schema.field(S.VECTOR_COLUMN))
        return self.new_store_dtype

    def created_storage_dtype(self) -> str | None:
        """The dtype recorded in the ``runs`` table's schema metadata when the store was created (``None``: a store
        made before it was recorded)."""
        if not self.tables.has_table(S.RUNS):
            return None
        recorded = (self.tables.table(S.RUNS).schema.metadata or {}).get(S.STORAGE_DTYPE_KEY)
        if recorded is None:
            return None
        try:
            return check_storage_dtype(recorded.decode())
        except (InvalidArgumentError, UnicodeDecodeError) as error:
            raise StoreCorruptError(f"store {self.tables.uri} records an unknown storage dtype {recorded!r}") from error

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
        if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)) or dim <= 0:
            raise InvalidArgumentError(
                f"dim must be a positive whole number (the length of the run's gradient rows), got {dim!r}"
            )
        dim = int(dim)
        projection_json = json.dumps(projection, sort_keys=True) if projection is not None else None
        existing = self.run(run_id) if self.has_run(run_id) else None
        if existing is not None:
            if not exist_ok:
                raise InvalidArgumentError(f"run {run_id!r} already exists (pass exist_ok=True to append to it)")
            if existing["projection"] != projection_json or existing["dim"] != dim:
                raise SchemaMismatchError(f"run {run_id!r} exists with a different projection spec or dim")
            return existing
        self.tables.gradient_tables.ensure(dim, self.new_store_dtype)  # before the run: its rows need the table
        row = {
            "run_id": run_id,
            "created_at": datetime.now(timezone.utc),
            "model_fingerprint": model_fingerprint,
            "projection": projection_json,
            "projection_fingerprint": (projection or {}).get("fingerprint"),
            "dim": dim,
            "config": json.dumps(config or {}, sort_keys=True, default=str),
        }
        commits.append(self.tables.table(S.RUNS), pa.Table.from_pylist([row], schema=S.RUNS_SCHEMA), "run creation")
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

    def _rows_of(self, run_id: str) -> list[dict]:
        """The ``runs`` rows of ``run_id`` in commit order (Lance assigns fragment ids, hence row addresses,
        in commit order; compaction keeps the order), each with its ``_rowaddr``. A :meth:`Tables.scan`: repeated calls
        on the same version of the ``runs`` table read nothing, a new process reads its scan file."""
        rows = self.tables.scan(S.RUNS, where=f"run_id = {sql_literal(run_id)}", row_address=True)
        return rows.sort_by("_rowaddr").to_pylist()

    def _delete_run_row(self, row: dict) -> None:
        """Withdraw a run row this process committed and lost (found again on every attempt: compaction moves it)."""
        for stored in self._rows_of(row["run_id"]):
            if self._is_row(stored, row):
                self.tables.table(S.RUNS).to_lance().delete(f"_rowaddr = {int(stored['_rowaddr'])}")
                return

    def run(self, run_id: str) -> dict:
        """The ``runs`` row of ``run_id`` as a dict (raises ``UnknownRunError``); the first committed one if
        two processes created the run at once."""
        rows = self._rows_of(run_id)
        if not rows:
            known = self.tables.table(S.RUNS).to_arrow().column("run_id").to_pylist()
            raise UnknownRunError(f"unknown run {run_id!r}; the store holds runs {known}")
        winner = rows[0]  # runs created at once by two processes: the first commit is the run
        del winner["_rowaddr"]
        return winner

    def has_run(self, run_id: str) -> bool:
        """Whether the store holds run ``run_id``."""
        return self.tables.table(S.RUNS).count_rows(f"run_id = {sql_literal(run_id)}") > 0

    def runs(self) -> pa.Table:
        """All runs as an Arrow table."""
        return self.tables.table(S.RUNS).to_arrow()

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
        """Record (or update) a checkpoint of a run with its step, epoch and learning rate; a value not given
        (``None``) keeps the one recorded (a checkpoint pass without ``learning_rate=`` leaves the training's)."""
        self.run(run_id)
        if step is None or epoch is None or learning_rate is None:
            where = f"run_id = {sql_literal(run_id)} AND checkpoint = {sql_literal(checkpoint)}"
            recorded = self.tables.scan(S.CHECKPOINTS, where=where).to_pylist()
            if recorded:
                last = recorded[-1]
                step = last["step"] if step is None else step
                epoch = last["epoch"] if epoch is None else epoch
                learning_rate = last["learning_rate"] if learning_rate is None else learning_rate
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
        commits.upsert(self.tables.table(S.CHECKPOINTS), row, ["run_id", "checkpoint"], "checkpoint record")

    def checkpoints(self, run_id: str | None = None) -> pa.Table:
        """Checkpoints (of one run, or all), ordered by step. A :meth:`Tables.scan`, so repeated calls (every call that
        defaults its checkpoint) on the same version of the ``checkpoints`` table read nothing."""
        where = None if run_id is None else f"run_id = {sql_literal(run_id)}"
        return self.tables.scan(S.CHECKPOINTS, where=where).sort_by([("run_id", "ascending"), ("step", "ascending")])

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
        with self.tables.reading(name):
            dataset = self.tables.dataset(name)

            def read() -> frozenset[str | None]:
                labels: set[str | None] = set()
                scanner = dataset.scanner(columns=["checkpoint"], filter=gradient_filter(run_id))
                for batch in scanner.to_batches():
                    labels.update(batch.column(0).unique().to_pylist())
                return frozenset(labels)

            return set(
                self.tables.row_cache.memo((dataset.version, name, "checkpoint labels", run_id), read, RUN_ROW_BYTES)
            )
