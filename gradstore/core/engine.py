"""Where scans run: in this process (the default) or as Ray tasks, one per :class:`~gradstore.core.shards.Shard`.

An engine maps a task ``task(shard, payload) -> partial`` over shards and returns the partials in shard
order; the caller reduces them exactly (:mod:`gradstore.search.scan_tasks`). The payload (a fitted preconditioner,
prepared queries) is shipped once per map: Ray keeps one copy in its object store that every task reads.
Tasks are module-level functions of gradstore, so a worker needs gradstore installed (or on its
``PYTHONPATH``) and access to the store's URI.

``engine="ray"`` connects to the Ray cluster this process is already connected to, else to the one
``RAY_ADDRESS`` names, else starts a local one; :class:`RayEngine` takes an explicit ``address``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar, get_args

from gradstore.core.shards import Shard
from gradstore.errors import InvalidArgumentError

EngineName = Literal["local", "ray"]
"""Engines by name: ``local`` (this process) or ``ray``."""
ENGINE_NAMES = get_args(EngineName)

Payload = TypeVar("Payload")
Partial = TypeVar("Partial")
Task = Callable[[Shard, Any], Any]


class Engine(Protocol):
    """Runs a task over shards."""

    name: str

    @property
    def parallelism(self) -> int:
        """How many shards a scan is split into (tasks that can run at once, times a few for balance)."""
        ...

    def map(
        self, task: Callable[[Shard, Payload], Partial], shards: Sequence[Shard], payload: Payload
    ) -> list[Partial]:
        """``[task(shard, payload) for shard in shards]``, wherever the tasks run."""
        ...


class LocalEngine:
    """Runs every task in this process, one shard after another (one shard: a plain streaming scan)."""

    name = "local"
    parallelism = 1

    def map(
        self, task: Callable[[Shard, Payload], Partial], shards: Sequence[Shard], payload: Payload
    ) -> list[Partial]:
        """The tasks run here, in order."""
        return [task(shard, payload) for shard in shards]


class RayEngine:
    """Runs each task as a Ray task of one CPU on the cluster at ``address`` (see the module docstring).

    ``tasks_per_cpu`` shards per CPU of the cluster balance uneven shards; ``ray_init`` passes options to
    ``ray.init`` when this engine starts Ray (e.g. ``num_cpus`` for a local cluster)."""

    name = "ray"

    def __init__(self, address: str | None = None, *, tasks_per_cpu: int = 2, **ray_init: Any) -> None:
        if tasks_per_cpu < 1:
            raise InvalidArgumentError(f"tasks_per_cpu must be >= 1, got {tasks_per_cpu}")
        self.address = address
        self.tasks_per_cpu = tasks_per_cpu
        self.ray_init = ray_init
        self._remote: Any = None

    def _ray(self) -> Any:
        try:
            import ray
        except ImportError as error:
            raise InvalidArgumentError("engine='ray' needs Ray: pip install 'gradstore[ray]'") from error
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False, **self.ray_init)
        if self._remote is None:
            self._remote = ray.remote(num_cpus=1)(_run)
        return ray

    @property
    def parallelism(self) -> int:
        """CPUs of the cluster times ``tasks_per_cpu``."""
        cpus = int(self._ray().cluster_resources().get("CPU", 1))
        return max(1, cpus) * self.tasks_per_cpu

    def map(
        self, task: Callable[[Shard, Payload], Partial], shards: Sequence[Shard], payload: Payload
    ) -> list[Partial]:
        """One Ray task per shard; the payload is put in the object store once."""
        ray = self._ray()
        shared = ray.put(payload)
        return ray.get([self._remote.remote(task, shard, shared) for shard in shards])


def _run(task: Task, shard: Shard, payload: Any) -> Any:
    return task(shard, payload)


def resolve_engine(engine: EngineName | Engine | None = "local", address: str | None = None) -> Engine:
    """An engine from its name (``address``: the Ray cluster, for ``"ray"``) or an engine object as is."""
    if engine is None or engine == "local":
        if address is not None:
            raise InvalidArgumentError("a Ray address applies to engine='ray'")
        return LocalEngine()
    if engine == "ray":
        return RayEngine(address)
    if isinstance(engine, str):
        raise InvalidArgumentError(f"engine must be one of {ENGINE_NAMES} or an Engine, got {engine!r}")
    return engine
