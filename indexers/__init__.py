"""Search side of gradstore: preconditioners and top-k inner-product indexes (exact in torch, FAISS).

Works on numpy/torch arrays and re-iterable sources of ``(ids, vectors)`` blocks; imports neither
``gradstore`` nor ``ingest``. FAISS is optional and imported only when a FAISS index is used.
"""

from indexers.blocks import VectorBlocks, blocks_from_arrays
from indexers.exact import UNIT_BF16_NORM, ExactIndex, PreparedRows, RunningTopK, float32_products, resolve_device
from indexers.faiss_index import (
    MISSING_ID,
    FaissIndex,
    FewerResultsWarning,
    default_nprobe,
    found_counts,
    gpu_available,
    packed,
    require_faiss,
)
from indexers.manifest import check_manifest, manifest_diff
from indexers.preconditioner import FitStatistics
from indexers.preconditioner_registry import (
    PRECONDITIONERS,
    CosinePreconditioner,
    DiagonalPreconditioner,
    FisherPreconditioner,
    IdentityPreconditioner,
    KroneckerPreconditioner,
    Preconditioner,
    load_preconditioner,
    make_preconditioner,
    register_preconditioner,
)
from indexers.prefetch import prefetched, read_ahead
from indexers.recall import choose_index_kind, measure_recall, recall_at_k
from indexers.search_errors import IndexMismatchError, NotFittedError

__all__ = [
    "PRECONDITIONERS",
    "register_preconditioner",
    "CosinePreconditioner",
    "DiagonalPreconditioner",
    "ExactIndex",
    "UNIT_BF16_NORM",
    "FitStatistics",
    "FaissIndex",
    "FewerResultsWarning",
    "FisherPreconditioner",
    "IdentityPreconditioner",
    "IndexMismatchError",
    "KroneckerPreconditioner",
    "MISSING_ID",
    "NotFittedError",
    "Preconditioner",
    "PreparedRows",
    "RunningTopK",
    "VectorBlocks",
    "blocks_from_arrays",
    "check_manifest",
    "choose_index_kind",
    "default_nprobe",
    "float32_products",
    "found_counts",
    "gpu_available",
    "load_preconditioner",
    "make_preconditioner",
    "manifest_diff",
    "packed",
    "prefetched",
    "read_ahead",
    "measure_recall",
    "recall_at_k",
    "resolve_device",
    "require_faiss",
]
