"""Gradient rows in and out: a run's streaming writer, reads of stored rows as float32 blocks, counts and
``grad_id -> example_id`` look-ups (:class:`GradientIO`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from gradstore.core import commits
from gradstore.core.catalog import RunCatalog
from gradstore.core.filters import StepRange, gradient_filter
from gradstore.core.gradient_tables import table_dim
from gradstore.core.tables import READ_ERRORS, Tables, writes
from gradstore.core.vector_scanner import late_materialization, vector_scanner
from gradstore.core.vectors import decode, vector_columns
from gradstore.core.writer import GradientWriter, WriterConfig
from gradstore.errors import InvalidArgumentError, SchemaMismatchError

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
            vectors=decode(batch, storage_dtype),
            metadata=pa.Table.from_batches([batch.select(list(metadata_columns))]),
        )

    def torch(self, device: str | None = None):
        """The vectors as a torch tensor (zero-copy on CPU)."""
        import torch

        return torch.from_numpy(self.vectors).to(device) if device else torch.from_numpy(self.vectors)


class GradientIO:
    """Writing and reading the gradient rows of a store's runs (each run's rows in its dim's gradient table)."""

    def __init__(self, tables: Tables, catalog: RunCatalog) -> None:
        self.tables = tables
        self.catalog = catalog

    @writes("write gradients")
    def writer(self, run_id: str, config: WriterConfig | None = None, **thresholds: Any) -> GradientWriter:
        """A streaming writer for ``run_id`` (see :class:`gradstore.core.writer.GradientWriter`) into the run's
        own gradient table. Keyword arguments override :class:`~gradstore.core.writer.WriterConfig` fields; any
        other keyword, or a ``config`` that is not a ``WriterConfig``, is an ``InvalidArgumentError``.
        """
        if config is not None and not isinstance(config, WriterConfig):
            raise InvalidArgumentError(
                f"config must be a gradstore.WriterConfig (or None), got {type(config).__name__}: pass the thresholds "
                "as keywords or as WriterConfig(...)"
            )
        if thresholds:
            known = [field.name for field in dataclasses.fields(WriterConfig)]
            unknown = sorted(set(thresholds) - set(known))
            if unknown:
                raise InvalidArgumentError(
                    f"writer() got unknown keyword(s) {unknown}: the writer's thresholds are {known} "
                    "(gradstore.WriterConfig)"
                )
            config = dataclasses.replace(config or WriterConfig(), **thresholds)
        return GradientWriter(
            commits.InertTable(self.catalog.gradient_table(run_id)),
            run_id=run_id,
            dim=self.catalog.run_dim(run_id),
            storage_dtype=self.catalog.storage_dtype,
            config=config,
            id_tables=self.catalog.other_gradient_tables(run_id),  # grad_ids unique across the store, not one table
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
        dataset = self.tables.dataset(name)
        vectors = vector_columns(dataset.schema)
        metadata_columns = [c for c in dict.fromkeys(columns) if c != "grad_id"]  # grad_norm may be asked for too
        wanted = ["grad_id", *[c for c in metadata_columns if c not in vectors], *vectors]
        unknown = set(wanted) - set(dataset.schema.names)
        if unknown:
            raise SchemaMismatchError(f"gradients table has no column(s) {sorted(unknown)}")
        late = selected_rows is None or late_materialization(selected_rows, dataset.count_rows())
        scanner = vector_scanner(
            dataset, wanted, gradient_filter(run, checkpoint, split, steps, where), block_rows, late
        )
        dtype = self.catalog.storage_dtype

        def read() -> Iterator[pa.RecordBatch]:  # opens the reader on the first next(), inside the try below
            yield from _rebatch(scanner.to_reader(), block_rows)

        batches = read()
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except READ_ERRORS as error:
                raise self.tables.unreadable(name, error) from error
            yield GradientBlock.from_batch(batch, metadata_columns, dtype)

    def _table_of_runs(self, run: Names | None) -> str | None:
        """The one gradient table holding ``run``'s rows (every gradient's, for ``None``); ``None`` if the store
        has no gradient table yet."""
        runs = [run] if isinstance(run, str) else list(run or [])
        if not runs:
            tables = self.tables.gradient_tables.by_dim()
            if len(tables) > 1:
                raise InvalidArgumentError(
                    f"store {self.tables.uri} holds runs of several dims {list(tables)}: pass run=... "
                    "(the rows of one read share one dim)"
                )
            return next(iter(tables.values()), None)
        names = {self.catalog.gradient_table_name(name) for name in runs}
        if len(names) > 1:
            dims = {name: self.catalog.run_dim(name) for name in runs}
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
            schema = self.tables.table(name).schema if name is not None else None
            empty = pa.schema([schema.field(c) for c in names]).empty_table() if schema is not None else pa.table({})
            dim = table_dim(schema) if schema is not None else 0
            return GradientBlock(np.empty(0, np.int64), np.empty((0, dim), np.float32), empty)
        return GradientBlock(
            np.concatenate([b.grad_ids for b in blocks]),
            np.concatenate([b.vectors for b in blocks]),
            pa.concat_tables([b.metadata for b in blocks]),
        )

    def example_ids_for(self, grad_ids: np.ndarray, run: str | None = None) -> dict[int, str]:
        """``grad_id -> example_id`` for the given ids of run ``run`` (``None``: looked up in every gradient
        table); one filtered scan of two int/string columns per table."""
        unique = np.unique(grad_ids)
        if len(unique) == 0:
            return {}
        names = (
            [self.catalog.gradient_table_name(run)]
            if run is not None
            else self.tables.gradient_tables.by_dim().values()
        )
        found: dict[int, str] = {}
        for name in names:
            with self.tables.reading(name):
                table = self.tables.dataset(name).to_table(
                    columns=["grad_id", "example_id"],
                    filter=f"grad_id IN ({', '.join(str(int(g)) for g in unique)})",
                )
            found.update(zip(table.column("grad_id").to_pylist(), table.column("example_id").to_pylist()))
        return found


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
