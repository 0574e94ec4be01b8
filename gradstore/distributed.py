"""Many ranks, one store: capture under ``torch.distributed`` (DDP, FSDP) with few commits.

Every rank captures the examples of its own micro-batches. Its :class:`~gradstore.core.writer.GradientWriter`
buffers rows as usual, but where a single process would commit, a rank only *writes data files*
(Lance fragments, :func:`lance.fragment.write_fragments`) and keeps their metadata. At a flush point
all ranks hand their fragment metadata to rank 0 (``gather_object`` on a dedicated gloo group), which
commits every rank's fragments in **one** ``LanceOperation.Append`` transaction and tells the others
whether it succeeded. Flush points are collective and happen on every rank at the same moment of the
loop:

* every ``commit_every`` optimizer steps (all ranks step together under DDP/FSDP),
* ``cap.flush()`` (the Hugging Face callback calls it at every checkpoint save),
* leaving the ``with`` block without an error.

A rank that dies loses only the rows staged since the last flush point: their data files exist but no
committed version references them, so the store opens and holds exactly the committed rows, each once.
Leaving the block with an exception skips the final collective commit (the other ranks may be gone).

Usage (in each rank, after ``init_process_group``)::

    from gradstore.distributed import distributed_capture
    with distributed_capture(store, ddp_model, "run", optimizer=opt, commit_every=100) as cap:
        ...  # the unchanged DDP / FSDP loop

A ``DistributedDataParallel`` wrapper is unwrapped (hooks go on ``ddp_model.module``) so layer names and
projection matrices equal a single-process run's. FSDP2 (``fully_shard``) modules keep their names and
are captured as they are: hooks see full (unsharded) activations and output gradients. FSDP1
(``FullyShardedDataParallel``, with or without ``use_orig_params``) inserts ``_fsdp_wrapped_module.`` into module
names; capture leaves it out (:func:`ingest.layers.clean_name`), so names and projections equal a
single-process run's, and hooks on the inner modules see full weights' activations and output gradients.
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lance
import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from lance.fragment import FragmentMetadata, write_fragments
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from gradstore.capture.session import StoreCapture, config_for_run
from gradstore.core import commits
from gradstore.core.writer import GradientWriter, WriterConfig
from gradstore.errors import InvalidArgumentError, surface
from ingest.curvature import CURVATURE_SPLITS

if TYPE_CHECKING:
    from gradstore.store import GradStore


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def unwrap(model: nn.Module) -> nn.Module:
    """The module that holds the layers: ``DistributedDataParallel`` (and ``DataParallel``) unwrapped."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


class FragmentStager:
    """Stands in for the gradients table behind one rank's writer: ``add`` writes Lance data files
    (fragments) without committing them; :meth:`take` hands their metadata over for a collective commit.

    ``count_rows`` reads the real table (the writer uses it to draw a free ``grad_id`` prefix).
    ``storage_options``: the store's (endpoint and credentials of an object-store URI; ``None`` on local disk).
    """

    def __init__(self, table: Any, storage_options: dict[str, str] | None = None) -> None:
        self._table = table
        self.uri = table.to_lance().uri
        self._storage_options = storage_options
        self._pending: list[FragmentMetadata] = []
        self._lock = threading.Lock()

    def add(self, data: pa.Table) -> None:
        """Write ``data`` as new data files of the gradients dataset (invisible until committed)."""
        fragments = write_fragments(
            data,
            self.uri,
            schema=data.schema,
            storage_options=self._storage_options,
            max_rows_per_file=commits.file_rows(data.schema) or 1 << 20,
        )
        with self._lock:
            self._pending.extend(fragments)

    def take(self) -> list[FragmentMetadata]:
        """The fragments written since the last call."""
        with self._lock:
            fragments, self._pending = self._pending, []
        return fragments

    def count_rows(self, filter: str | None = None) -> int:
        """Committed rows of the real table matching ``filter``."""
        return self._table.count_rows(filter)

    def to_lance(self) -> lance.LanceDataset:
        """The real dataset."""
        return self._table.to_lance()


class CollectiveCommit:
    """Commits every rank's staged fragments in one Lance transaction (rank 0), collectively."""

    def __init__(self, table: Any | None, group: Any, max_fragments: int) -> None:
        self.table = table  # the LanceDB gradients table (rank 0 commits into it)
        self._group = group
        self._max_fragments = max_fragments
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.commits = 0
        self.rows_committed = 0

    def gather(self, obj: Any) -> list[Any] | None:
        """``obj`` of every rank, on rank 0 (``None`` elsewhere). Collective."""
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0, group=self._group)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank. Collective."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def commit(self, fragments: list[FragmentMetadata]) -> int:
        """Gather ``fragments`` from every rank; rank 0 appends them all in one commit. Collective.

        Returns the rows committed (every rank's). Raises on every rank if the commit failed.
        """
        gathered = self.gather(fragments)
        outcome: tuple[str, Any] = ("ok", 0)
        if self.rank == 0:
            try:
                outcome = ("ok", self._append([f for part in gathered for f in part]))
            except Exception as error:  # reported to every rank below
                outcome = ("error", repr(error))
        status, value = self.broadcast(outcome)
        if status != "ok":
            raise RuntimeError(f"gradstore: rank 0 could not commit the ranks' gradient rows: {value}")
        self.rows_committed += value
        return value

    def _append(self, fragments: list[FragmentMetadata]) -> int:
        if not fragments:
            return 0

        def commit() -> lance.LanceDataset:
            dataset = self.table.to_lance()
            return lance.LanceDataset.commit(
                dataset, lance.LanceOperation.Append(fragments), read_version=dataset.version
            )

        dataset = commits.retrying(commit, "collective commit")
        self.commits += 1
        if self._max_fragments and commits.small_fragments(dataset) > self._max_fragments:
            commits.compact(self.table, "collective compaction")
        return sum(f.physical_rows for f in fragments)


class DistributedCapture(StoreCapture):
    """A :class:`~gradstore.capture.session.StoreCapture` whose ranks stage rows as data files and commit them
    together at collective flush points (see the module docstring). Use :func:`distributed_capture`."""

    def __init__(
        self,
        store: GradStore,
        model: nn.Module,
        run: str,
        config: Any,
        *,
        commit_every: int = 100,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        if not is_distributed():
            raise RuntimeError(
                "distributed capture needs torch.distributed initialised with > 1 rank; "
                "use store.capture(...) in a single process"
            )
        if commit_every < 1:
            raise InvalidArgumentError(f"commit_every must be >= 1, got {commit_every}")
        super().__init__(store, unwrap(model), run, config, **kwargs)
        self.commit_every = commit_every
        self._timeout = timeout
        self._stager: FragmentStager | None = None
        self._committer: CollectiveCommit | None = None
        self._hook: Any = None
        self._steps = 0

    @property
    def rows_committed(self) -> int:
        """Rows of every rank committed so far by this capture."""
        return self._committer.rows_committed if self._committer else 0

    def __enter__(self) -> DistributedCapture:
        group = dist.new_group(backend="gloo", timeout=self._timeout)  # collective; CPU objects on any backend
        self._committer = committer = CollectiveCommit(
            None, group, (self._writer_config or WriterConfig()).max_fragments
        )
        failure = None
        if dist.get_rank() == 0:  # one rank creates the run; the others then check their spec against it
            try:
                StoreCapture.__enter__(self)
            except Exception as error:  # told to every rank, so none waits in a collective
                failure = repr(error)
                raise
            finally:
                committer.broadcast(failure)
        else:
            failure = committer.broadcast(None)
            if failure is not None:
                raise RuntimeError(f"gradstore: rank 0 could not start the capture: {failure}")
            StoreCapture.__enter__(self)
        committer.table = self.store.gradient_table(self.run_id)
        self._hook = register_optimizer_step_post_hook(self._after_step)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._hook.remove()
        try:
            self.capture.__exit__(exc_type, exc, tb)
        finally:
            self._writer.close()  # stages the last rows of this rank
        if exc_type is None:  # a failing rank must not wait for the others in a collective
            self._committer.commit(self._stager.take())
            self._record_run()
            if dist.get_rank() == 0:  # every rank captures the same model
                self._record_coverage()

    def flush(self) -> None:
        """Commit every rank's captured rows (one transaction). Collective: call it on every rank."""
        self.capture.flush()
        self._writer.flush()
        self._committer.commit(self._stager.take())

    def _open_writer(self) -> GradientWriter:
        self._stager = FragmentStager(self.store.gradient_table(self.run_id), self.store.storage_options)
        config = dataclasses.replace(self._writer_config or WriterConfig(), max_fragments=0)
        return GradientWriter(
            self._stager,
            run_id=self.run_id,
            dim=self.store.run_dim(self.run_id),
            storage_dtype=self.store.storage_dtype,
            config=config,
            id_tables=self.store.catalog.other_gradient_tables(self.run_id),
        )

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is not self.capture.optimizer:
            return
        self._steps += 1
        if self._steps % self.commit_every == 0:
            self.flush()

    def _record_run(self) -> None:
        """Rank 0 records checkpoints and the ranks' pooled curvature statistics (per checkpoint and split)."""
        curvature = (
            {(c, split): self.capture.curvature(c, split) for c in self._seen for split in CURVATURE_SPLITS}
            if self.capture.config.curvature
            else {}
        )
        gathered = self._committer.gather((self._seen, curvature))
        if dist.get_rank() == 0:  # every rank steps the same optimizer: rank 0's optimizer_steps rows
            self._write_optimizer_steps()
        self._optimizer_rows = []
        if gathered is None:
            return
        seen: dict[str, dict[str, Any]] = {}
        for part, _ in gathered:
            for checkpoint, info in part.items():
                if checkpoint not in seen or (info["step"], info["epoch"]) >= (
                    seen[checkpoint]["step"],
                    seen[checkpoint]["epoch"],
                ):
                    seen[checkpoint] = info
        for checkpoint, info in seen.items():
            self.store.record_checkpoint(self.run_id, checkpoint, **info)
        for checkpoint in seen:
            for split in CURVATURE_SPLITS:
                stats = pool_curvature([part.get((checkpoint, split), {}) for _, part in gathered])
                if stats:
                    self.store.curvature.save(self.run_id, checkpoint, stats, split)


def pool_curvature(
    parts: list[dict[str, tuple[np.ndarray, np.ndarray, int]]],
) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """Token-weighted means of per-rank curvature statistics ``layer -> (A, S, count)``."""
    pooled: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
    for part in parts:
        for layer, (a, s, n) in part.items():
            if layer not in pooled:
                pooled[layer] = (a * n, s * n, n)
            else:
                pa_, ps_, pn = pooled[layer]
                pooled[layer] = (pa_ + a * n, ps_ + s * n, pn + n)
    return {layer: (a / max(n, 1), s / max(n, 1), n) for layer, (a, s, n) in pooled.items()}


@surface
def distributed_capture(
    store: GradStore,
    model: nn.Module,
    run: str,
    *,
    commit_every: int = 100,
    optimizer: Any = None,
    per_example_loss: Any = None,
    grad_scaler: Any = None,
    learning_rate: float | None = None,
    writer: WriterConfig | None = None,
    timeout: timedelta | None = None,
    **options: Any,
) -> DistributedCapture:
    """Capture on every rank of a ``torch.distributed`` job into run ``run``; rows are committed together.

    Call it on every rank (it is collective). ``commit_every``: optimizer steps between collective commits.
    ``options`` are the flat options of :meth:`ingest.CaptureConfig.from_options`, as for
    :meth:`GradStore.capture`; ``rank`` defaults to the process's rank. ``timeout`` bounds each collective
    (default: torch's).
    """
    return DistributedCapture(
        store.core,
        model,
        run,
        config_for_run(store.core, run, options),
        commit_every=commit_every,
        timeout=timeout,
        optimizer=optimizer,
        per_example_loss=per_example_loss,
        grad_scaler=grad_scaler,
        learning_rate=learning_rate,
        writer_config=writer,
    )
