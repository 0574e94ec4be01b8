"""``StoreAPI``: the calls a store answers wherever it is, in this process (:class:`gradstore.GradStore`) or behind
``gradstore serve`` (:class:`gradstore.serve.client.RemoteStore`). Both implement it with the same signatures
(names, kinds, defaults, annotations; tests/store/test_store_api.py compares them), so code written against one runs
against the other. The scoring calls take their options as keywords or as one
:class:`~gradstore.methods.ScoreOptions` (``options=``).

What differs is where the work runs: a served store's ``engine`` and ``device`` are the server's (a client may
leave them at their defaults only), and ``write=None`` means the store's default: a local store appends the
results, a served one does not (a server writes only when asked, ``write=True``, with a write-scoped token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gradstore.methods import DEFAULT_METHOD

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from gradstore.answers.selection import Aggregate
    from gradstore.core.engine import Engine, EngineName
    from gradstore.methods import BlockStructure, MethodName, ScoreOptions
    from gradstore.methods.queries import QueryInput

IndexKind = str  # "exact", "auto" or a FAISS factory string such as "Flat" or "IVF1024,Flat"

#: The calls of :class:`StoreAPI`.
STORE_API = ("attribute", "info", "runs", "select", "self_influence", "sql")


@runtime_checkable
class StoreAPI(Protocol):
    """The store API shared by a local and a served store (see the module docstring)."""

    def attribute(
        self,
        queries: QueryInput = None,
        *,
        run: str,
        k: int = 10,
        method: MethodName = DEFAULT_METHOD,
        checkpoint: str | None = None,
        query_checkpoint: str | None = None,
        checkpoints: Sequence[str] | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        kind: IndexKind = "exact",
        opponents: bool = False,
        split: str = "train",
        where: str | None = None,
        write: bool | None = None,
        engine: EngineName | Engine = "local",
        rerank: int = 0,
        device: str | torch.device | None = None,
        options: ScoreOptions | None = None,
    ) -> pa.Table:
        """Top-k proponents (and opponents) of each query (:meth:`gradstore.GradStore.attribute`)."""
        ...

    def self_influence(
        self,
        *,
        run: str,
        method: MethodName = DEFAULT_METHOD,
        checkpoint: str | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        split: str = "train",
        where: str | None = None,
        write: bool | None = None,
        engine: EngineName | Engine = "local",
        options: ScoreOptions | None = None,
    ) -> pa.Table:
        """``g^T P^-1 g`` of every selected training row (:meth:`gradstore.GradStore.self_influence`)."""
        ...

    def select(
        self,
        target: QueryInput = None,
        *,
        run: str,
        budget: float = 0.05,
        preconditioner: MethodName = "grad-dot",
        aggregate: Aggregate = "max",
        checkpoints: Sequence[str] | None = None,
        damping: float | None = None,
        blocks: BlockStructure = "auto",
        split: str = "train",
        where: str | None = None,
        engine: EngineName | Engine = "local",
        options: ScoreOptions | None = None,
    ) -> pa.Table:
        """LESS-style data selection (:meth:`gradstore.GradStore.select`)."""
        ...

    def sql(self, query: str) -> Any:
        """Read-only DuckDB SQL over the store's tables: a DuckDB relation."""
        ...

    def runs(self) -> pa.Table:
        """Every run of the store."""
        ...

    def info(self) -> dict[str, Any]:
        """Tables, runs, dims, dtype and size of the store."""
        ...
