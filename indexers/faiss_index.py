"""Approximate (or flat) inner-product search with FAISS: ids, random-sample training, persistence, GPU.

FAISS is an optional dependency (``pip install 'gradstore[cpu]'`` or ``'gradstore[gpu]'``) and is imported
lazily. ``nprobe`` defaults to :func:`default_nprobe` (``max(8, nlist // 8)``, at most ``nlist``); HNSW
graphs (``HNSW32,Flat``, ``HNSW32,SQ8``) keep ``ef_search`` candidates per query, :data:`DEFAULT_EF_SEARCH` unless
set (at least ``k``).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from indexers.blocks import ArrayLike, VectorBlocks, count_rows, unpack_block
from indexers.manifest import check_manifest, normalize_manifest

INDEX_FILE = "index.faiss"
MANIFEST_FILE = "manifest.json"
GPU_MAX_K = 2048
"""The largest k FAISS GPU indexes search; beyond it searches run on a CPU copy."""
METRICS = ("ip", "l2")
DEFAULT_EF_SEARCH = 128
"""HNSW candidates kept per query unless set (FAISS ``efSearch``; a search keeps at least ``k``). On real
captured gradients (``bench/ann_recall.py``, balanced rows, ``HNSW32``) 128 found 0.997 / 0.993 of the top-10 at
26,624 / 79,872 rows, 64 found 0.976 / 0.963, FAISS's own default 16 found 0.89 / 0.80."""
MISSING_ID = -1
"""The id of an entry a search did not fill (FAISS's own mark), always after the found entries of its row."""
FACTORY_FORMS = (
    "a codec ('Flat', 'SQ4', 'SQ6', 'SQ8', 'SQfp16', 'SQbf16', or 'PQ<m>[x<bits>][fs|fsr|np]': m subspaces dividing "
    "the dimension, bits 1..16, default 8), alone or after 'IVF<lists>,' or 'HNSW<M>,' (M >= 2 links), or "
    "'HNSW<M>' alone (float32 rows): e.g. 'HNSW32,SQfp16', 'HNSW32,Flat', 'IVF1024,PQ64'"
)
"""The FAISS factory strings :class:`FaissIndex` builds (:func:`check_factory`), in words."""
_CODEC = re.compile(r"Flat|SQ(?:4|6|8|fp16|bf16)|PQ(?P<subspaces>\d+)(?:x(?P<bits>\d+))?(?:fsr|fs|np)?")
_STRUCTURE = re.compile(r"(?P<structure>IVF|HNSW)(?P<size>\d+)")
PQ_MAX_BITS = 16
"""The most bits per PQ subspace code :func:`check_factory` accepts (``2**bits`` centroids each, as many training
rows)."""


class FewerResultsWarning(UserWarning):
    """Some queries of an approximate search got fewer than ``k`` rows: the IVF lists probed or the HNSW graph
    search held fewer candidates (their missing entries have id :data:`MISSING_ID`)."""


def packed(
    scores: np.ndarray, ids: np.ndarray, missing: np.ndarray, fill: float = -np.inf
) -> tuple[np.ndarray, np.ndarray]:
    """``scores`` and ``ids [q, k]`` with the ``missing [q, k]`` entries at the end of their rows (the found ones in
    their order), their ids :data:`MISSING_ID` and their scores ``fill`` (FAISS leaves garbage there: ``-FLT_MAX``
    from IVF lists, anything from HNSW graphs)."""
    if not missing.any():
        return scores, ids
    order = np.argsort(missing, axis=1, kind="stable")
    scores = np.take_along_axis(scores, order, 1).astype(np.float32)
    ids = np.take_along_axis(ids, order, 1).astype(np.int64)
    gone = np.take_along_axis(missing, order, 1)
    scores[gone], ids[gone] = fill, MISSING_ID
    return scores, ids


def found_counts(ids: np.ndarray) -> np.ndarray:
    """Rows found per query of a search result's ``ids [q, k]`` (entries that are not :data:`MISSING_ID`)."""
    return (np.asarray(ids) != MISSING_ID).sum(axis=1)


def require_faiss() -> Any:
    """The ``faiss`` module, or an ImportError saying which extra to install."""
    try:
        import faiss
    except ImportError as error:
        raise ImportError(
            "FAISS is not installed: pip install 'gradstore[cpu]' (or 'gradstore[gpu]' for CUDA GPUs)"
        ) from error
    return faiss


@functools.cache
def gpu_available() -> bool:
    """True when faiss has GPU support, a CUDA driver answers, and FAISS sees at least one GPU.

    The driver is probed through ``libcuda`` before any FAISS GPU call, so a GPU build of FAISS on a machine
    without a driver is reported as ``False`` instead of failing."""
    try:
        faiss = require_faiss()
    except ImportError:
        return False
    if not hasattr(faiss, "StandardGpuResources") or _cuda_driver_devices() == 0:
        return False
    return faiss.get_num_gpus() > 0


def _cuda_driver_devices() -> int:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def default_nprobe(nlist: int) -> int:
    """The documented default number of IVF lists probed: ``min(nlist, max(8, nlist // 8))``."""
    return min(nlist, max(8, nlist // 8))


def sample_rows(source: VectorBlocks, sample_size: int, seed: int = 0) -> np.ndarray:
    """A uniform random sample (without replacement) of ``sample_size`` rows, as float32, in two passes."""
    total = count_rows(source)
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=min(sample_size, total), replace=False))
    parts, start = [], 0
    for _, vectors, scales in map(unpack_block, source()):
        stop = start + len(vectors)
        local = chosen[np.searchsorted(chosen, start) : np.searchsorted(chosen, stop)] - start
        if len(local):
            parts.append(_float32(vectors[local], None if scales is None else scales[local]))
        start = stop
    if not parts:
        raise ValueError("cannot train an index on a source with no rows")
    return np.concatenate(parts)


def check_factory(factory: str, dim: int) -> int:
    """The fewest rows a FAISS index of ``factory`` over ``dim`` dims trains on (the IVF lists, the ``2**bits``
    centroids of each PQ subspace; 1 for kinds without training), or a ``ValueError`` saying what to pass where
    ``factory`` is not one of :data:`FACTORY_FORMS`. Checked before FAISS sees the string: FAISS takes factory
    strings it cannot build and then aborts the process (``HNSW0``, ``HNSW1``, ``PQ4x0``), hangs (``NSG2``) or
    fails later (``IVF0``, ``IDMap,Flat``), instead of raising."""
    parts = factory.split(",") if isinstance(factory, str) else []
    structure = _STRUCTURE.fullmatch(parts[0]) if len(parts) in (1, 2) else None
    codec = _CODEC.fullmatch(parts[-1]) if len(parts) in (1, 2) else None
    kind = None if structure is None else structure["structure"]
    known = (structure is not None and codec is not None) if len(parts) == 2 else (codec is not None or kind == "HNSW")
    if not known:
        raise ValueError(f"index kind {factory!r} is not one gradstore builds; pass {FACTORY_FORMS}")
    size = None if structure is None else int(structure["size"])
    if kind == "IVF" and size < 1:
        raise ValueError(f"index kind {factory!r}: an IVF index needs at least 1 list (IVF<lists> with lists >= 1)")
    if kind == "HNSW" and size < 2:
        raise ValueError(
            f"index kind {factory!r}: an HNSW graph needs at least 2 links per node (HNSW<M> with M >= 2; "
            "HNSW32 is the usual choice)"
        )
    rows = size if kind == "IVF" else 1
    if codec is not None and codec["subspaces"] is not None:
        subspaces, bits = int(codec["subspaces"]), int(codec["bits"] or 8)
        if subspaces < 1 or dim % subspaces:
            divisors = [m for m in range(1, dim + 1) if dim % m == 0]
            raise ValueError(
                f"index kind {factory!r}: PQ<m> splits the {dim} dims into m equal subspaces, so m must divide {dim} "
                f"(one of {divisors[:12]}{' ...' if len(divisors) > 12 else ''})"
            )
        if not 1 <= bits <= PQ_MAX_BITS:
            raise ValueError(
                f"index kind {factory!r}: PQ<m>x<bits> takes 1 to {PQ_MAX_BITS} bits per subspace code (8 by default)"
            )
        rows = max(rows, 2**bits)
    return rows


def _is_graph(index: Any) -> bool:
    """Whether a FAISS index (inside its ``IndexIDMap``, if any) is an HNSW graph."""
    faiss = require_faiss()
    inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap) else index
    return isinstance(inner, faiss.IndexHNSW)


def _float32(vectors: ArrayLike, scales: np.ndarray | None = None) -> np.ndarray:
    array = vectors.detach().cpu().numpy() if hasattr(vectors, "detach") else np.asarray(vectors)
    array = np.ascontiguousarray(array, dtype=np.float32)
    return array if scales is None else array * scales[:, None]


class FaissIndex:
    """A FAISS index built from a factory string (``Flat``, ``IVF1024,SQfp16``, ``IVF1024,PQ64``)
    whose FAISS ids are the caller's ``grad_id``s.

    ``metric`` is ``"ip"`` (inner product, larger is better) or ``"l2"`` (distance, smaller is better).
    Non-IVF indexes are wrapped in ``IndexIDMap``; IVF indexes take ids natively.
    """

    def __init__(
        self, factory: str, dim: int, metric: str = "ip", nprobe: int | None = None, ef_search: int | None = None
    ):
        faiss = require_faiss()
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        check_factory(factory, dim)
        metric_type = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
        try:
            index = faiss.index_factory(int(dim), factory, metric_type)
        except RuntimeError as error:  # FAISS reports an unknown factory string as a RuntimeError
            reason = str(error).rsplit(": ", 1)[-1]
            raise ValueError(
                f"FAISS cannot build index kind {factory!r} for {dim} dims ({reason}): the fast-scan PQ codes take "
                "4 bits (PQ<m>x4fs; fsr after IVF<lists>, only), HNSW graphs no fast-scan codes"
            ) from error
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is None:
            index = faiss.IndexIDMap(index)
        self.graph = _is_graph(index)
        """Whether the index is an HNSW graph (``ef_search`` applies; copies cannot be merged)."""
        self.factory, self.dim, self.metric = factory, int(dim), metric
        self.nlist: int | None = None if ivf is None else int(ivf.nlist)
        """Number of IVF lists, or ``None`` for non-IVF indexes."""
        self.manifest: dict[str, Any] = {}
        self._index = index
        self._on_gpu = False
        self._mmap_path: Path | None = None
        self._cpu_copy = None
        self.nprobe = nprobe
        self.ef_search = ef_search

    @property
    def ntotal(self) -> int:
        """Number of vectors in the index."""
        return int(self._index.ntotal)

    @property
    def on_gpu(self) -> bool:
        """Whether the index lives on GPUs (a copy :meth:`to_gpu` moved; searches with ``k`` above
        :data:`GPU_MAX_K` still run on a CPU copy)."""
        return self._on_gpu

    @property
    def nprobe(self) -> int | None:
        """IVF lists probed per query (``None`` for non-IVF indexes)."""
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int | None) -> None:
        nlist = self.nlist
        if nlist is None:
            self._nprobe = None
            return
        self._nprobe = min(int(value), nlist) if value is not None else default_nprobe(nlist)
        faiss = require_faiss()
        space = faiss.GpuParameterSpace() if self._on_gpu else faiss.ParameterSpace()
        space.set_index_parameter(self._index, "nprobe", self._nprobe)

    @property
    def ef_search(self) -> int | None:
        """HNSW candidates kept per query (at least ``k``); ``None`` for indexes that are not HNSW graphs."""
        return self._ef_search

    @ef_search.setter
    def ef_search(self, value: int | None) -> None:
        if not self.graph:
            self._ef_search = None
            return
        if value is not None and int(value) < 1:
            raise ValueError(f"ef_search must be >= 1, got {value}")
        self._ef_search = DEFAULT_EF_SEARCH if value is None else int(value)

    @property
    def mergeable(self) -> bool:
        """Whether :meth:`merge_from` works (FAISS cannot merge HNSW graphs: fill one index instead)."""
        return not self.graph

    def train(self, source: VectorBlocks, sample_size: int | None = None, seed: int = 0) -> None:
        """Train (e.g. IVF centroids) on a uniform random sample of the source; no-op if already trained.

        ``sample_size`` defaults to ``max(10_000, 64 * nlist)`` rows."""
        if self._index.is_trained:
            return
        sample = sample_rows(source, sample_size or self.training_rows, seed)
        self.check_training_rows(len(sample))
        self._index.train(sample)

    @property
    def training_rows(self) -> int:
        """The default training sample: ``max(10_000, 64 * nlist)`` rows."""
        return max(10_000, 64 * (self.nlist or 0))

    def check_training_rows(self, rows: int) -> None:
        """A ``ValueError`` saying what to change when ``rows`` rows are too few to train this index on (fewer than
        its IVF lists, or than the ``2**bits`` centroids of a PQ subspace: :func:`check_factory`)."""
        needed = check_factory(self.factory, self.dim)
        if rows < needed:
            raise ValueError(
                f"index kind {self.factory!r} trains on at least {needed} rows (one per IVF list or PQ centroid) and "
                f"{rows} were given: use fewer IVF lists (about 4 * sqrt(rows)) or fewer PQ bits, or exact search"
            )

    def add(self, ids: np.ndarray, vectors: ArrayLike) -> None:
        """Append ``vectors [n, dim]`` under ``ids [n]`` (incremental: rows appended since the build)."""
        if not self._index.is_trained:
            raise RuntimeError("train the index before adding vectors")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        vectors = _float32(vectors)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim or len(ids) != len(vectors):
            raise ValueError(f"expected ids [n] and vectors [n, {self.dim}], got {ids.shape} and {vectors.shape}")
        self._writable().add_with_ids(vectors, ids)
        self._cpu_copy = None

    def _writable(self) -> Any:
        """The FAISS index, read into memory first if it is memory-mapped (read-only in FAISS)."""
        if self._mmap_path is not None:
            self._index = require_faiss().read_index(str(self._mmap_path))
            self._mmap_path = None
            self.nprobe = self._nprobe
        return self._index

    def merge_from(self, other: FaissIndex) -> None:
        """Move every vector of ``other`` (built from the same trained index, e.g. on another shard of the
        rows) into this index, ids kept; ``other`` is left empty."""
        if (other.factory, other.dim, other.metric) != (self.factory, self.dim, self.metric):
            raise ValueError(
                f"cannot merge a {other.factory!r} index of {other.dim} dims ({other.metric}) into "
                f"a {self.factory!r} index of {self.dim} dims ({self.metric})"
            )
        if not self.mergeable:
            raise ValueError(f"FAISS cannot merge {self.factory!r} indexes (HNSW graphs): add every row to one index")
        self._writable().merge_from(other._writable(), 0)
        self._cpu_copy = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable state (the CPU index serialized), so that shards can be built in other processes."""
        return {
            "factory": self.factory,
            "dim": self.dim,
            "metric": self.metric,
            "nlist": self.nlist,
            "nprobe": self._nprobe,
            "graph": self.graph,
            "ef_search": self._ef_search,
            "manifest": self.manifest,
            "index": require_faiss().serialize_index(self._cpu_index()),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.factory, self.dim, self.metric = state["factory"], state["dim"], state["metric"]
        self.nlist, self.manifest = state["nlist"], state["manifest"]
        self._index = require_faiss().deserialize_index(state["index"])
        self._on_gpu, self._mmap_path, self._cpu_copy = False, None, None
        self.nprobe = state["nprobe"]
        self.graph = state["graph"]
        self.ef_search = state["ef_search"]

    def add_from(self, source: VectorBlocks) -> None:
        """Add every block of a source (float16 or scaled blocks become float32 rows one block at a time)."""
        for ids, vectors, scales in map(unpack_block, source()):
            self.add(ids, _float32(vectors, scales))

    def search(self, queries: ArrayLike, k: int, *, warn: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """``(scores float32 [q, k'], ids int64 [q, k'])`` with ``k' = min(k, ntotal)``, best first.

        Scores are inner products for ``"ip"`` and squared distances for ``"l2"``. IVF and HNSW searches may find
        fewer than ``k'`` rows for a query (the lists probed, or the graph search, hold fewer): its missing entries
        come last in its row, with id :data:`MISSING_ID` (``-1``) and score ``-inf`` (``"ip"``) or ``+inf``
        (``"l2"``), and unless ``warn=False`` one :class:`FewerResultsWarning` per call says how many queries got
        fewer and what to raise (:meth:`shortfall_reason`); :func:`found_counts` counts each query's rows."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        queries = _float32(queries).reshape(-1, self.dim)
        k = min(k, self.ntotal)
        if k == 0:
            return np.empty((len(queries), 0), np.float32), np.empty((len(queries), 0), np.int64)
        index = self._index
        if self._on_gpu and k > GPU_MAX_K:
            warnings.warn(f"k={k} is above the FAISS GPU limit {GPU_MAX_K}; searching a CPU copy", stacklevel=2)
            index = self._cpu_index()
        params = None
        if self.graph:  # the graph keeps at least k candidates
            params = require_faiss().SearchParametersHNSW(efSearch=max(self._ef_search, k))
        scores, ids = index.search(queries, k, params=params)
        scores, ids = scores.astype(np.float32, copy=False), ids.astype(np.int64, copy=False)
        scores, ids = packed(scores, ids, ids < 0, -np.inf if self.metric == "ip" else np.inf)
        short = int((found_counts(ids) < k).sum())
        if warn and short:
            warnings.warn(
                f"FAISS {self.factory} found fewer than k={k} rows for {short} of {len(ids)} queries: "
                f"{self.shortfall_reason()}; their missing entries have id {MISSING_ID}. For k rows, "
                f"{self.shortfall_fix()} or search exactly (ExactIndex)",
                FewerResultsWarning,
                stacklevel=2,
            )
        return scores, ids

    def shortfall_reason(self) -> str:
        """Why a search of this index can find fewer than ``k`` rows, in words (for warnings)."""
        if self.nlist is not None:
            return f"the {self._nprobe} IVF list(s) probed (nprobe, of {self.nlist}) hold fewer rows"
        if self.graph:
            return f"the HNSW graph search reached fewer rows (ef_search={self._ef_search}, at least k)"
        return "FAISS returned fewer rows than it holds"

    def shortfall_fix(self) -> str:
        """The index setting that finds more rows per query, in words (for warnings)."""
        if self.nlist is not None:
            return f"raise nprobe (now {self._nprobe}, at most {self.nlist}: every list) or build with fewer lists"
        if self.graph:
            return f"raise ef_search (now {self._ef_search})"
        return "use another index kind"

    def _cpu_index(self) -> Any:
        if not self._on_gpu:
            return self._index
        if self._cpu_copy is None:
            self._cpu_copy = require_faiss().index_gpu_to_cpu(self._index)
            if self._nprobe is not None:
                require_faiss().ParameterSpace().set_index_parameter(self._cpu_copy, "nprobe", self._nprobe)
        return self._cpu_copy

    def save(self, directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
        """Write ``index.faiss`` and ``manifest.json`` (the caller's manifest plus the index settings).

        The manifest should say what the index was built from (store version, row count, projection
        spec, preconditioner, metric); :meth:`load` compares it with the caller's expectation."""
        faiss = require_faiss()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        temporary = directory / (INDEX_FILE + ".tmp")
        faiss.write_index(self._cpu_index(), str(temporary))
        os.replace(temporary, directory / INDEX_FILE)
        self.manifest = normalize_manifest(manifest)
        settings = {
            "factory": self.factory,
            "dim": self.dim,
            "metric": self.metric,
            "nlist": self.nlist,
            "nprobe": self._nprobe,
            "ef_search": self._ef_search,
            "ntotal": self.ntotal,
            "faiss_version": faiss.__version__,
        }
        text = json.dumps({"manifest": self.manifest, "index": settings}, indent=2, sort_keys=True)
        (directory / (MANIFEST_FILE + ".tmp")).write_text(text)
        os.replace(directory / (MANIFEST_FILE + ".tmp"), directory / MANIFEST_FILE)

    @classmethod
    def load(
        cls, directory: str | os.PathLike, expected_manifest: dict[str, Any] | None = None, mmap: bool = True
    ) -> FaissIndex:
        """Read an index written by :meth:`save`, memory-mapped by default.

        Raises :class:`~indexers.search_errors.IndexMismatchError` naming the differing keys when
        ``expected_manifest`` differs from the saved manifest (before reading the index file)."""
        faiss = require_faiss()
        directory = Path(directory)
        saved = json.loads((directory / MANIFEST_FILE).read_text())
        if expected_manifest is not None:
            check_manifest(expected_manifest, saved["manifest"])
        settings = saved["index"]
        loaded = cls.__new__(cls)
        loaded.factory, loaded.dim, loaded.metric = settings["factory"], settings["dim"], settings["metric"]
        loaded.nlist = settings["nlist"]
        loaded.manifest, loaded._on_gpu, loaded._cpu_copy = saved["manifest"], False, None
        path = directory / INDEX_FILE
        if mmap:
            flag = faiss.IO_FLAG_MMAP if loaded.nlist is not None else faiss.IO_FLAG_MMAP_IFC
            loaded._index = faiss.read_index(str(path), flag)
            loaded._mmap_path = path
        else:
            loaded._index, loaded._mmap_path = faiss.read_index(str(path)), None
        if loaded.ntotal != settings["ntotal"] or loaded._index.d != loaded.dim:
            raise ValueError(
                f"{path} holds {loaded.ntotal} x {loaded._index.d} vectors but its manifest says "
                f"{settings['ntotal']} x {loaded.dim}: the index files are inconsistent"
            )
        loaded.nprobe = settings["nprobe"]
        loaded.graph = _is_graph(loaded._index)
        loaded.ef_search = settings.get("ef_search")
        return loaded

    def to_gpu(self) -> FaissIndex:
        """A copy on all visible GPUs (sharded, float16 storage where FAISS allows it).

        Without faiss GPU support or a CUDA driver this warns and returns ``self`` unchanged."""
        if not gpu_available():
            warnings.warn("no CUDA GPU usable by FAISS; the index stays on CPU", stacklevel=2)
            return self
        if self.graph:
            warnings.warn(
                f"FAISS has no GPU version of {self.factory!r} (an HNSW graph); it stays on CPU", stacklevel=2
            )
            return self
        faiss = require_faiss()
        options = faiss.GpuMultipleClonerOptions()
        options.shard, options.useFloat16 = True, True
        try:
            gpu_index = faiss.index_cpu_to_all_gpus(self._index, co=options)
        except RuntimeError:
            options.useFloat16 = False  # e.g. PQ sizes whose float16 lookup tables FAISS refuses
            gpu_index = faiss.index_cpu_to_all_gpus(self._index, co=options)
        moved = FaissIndex.__new__(FaissIndex)
        moved.factory, moved.dim, moved.metric, moved.manifest = (
            self.factory,
            self.dim,
            self.metric,
            self.manifest,
        )
        moved.nlist = self.nlist
        moved._index, moved._on_gpu, moved._mmap_path, moved._cpu_copy = gpu_index, True, None, None
        moved.nprobe = self._nprobe
        moved.graph, moved._ef_search = False, None
        return moved
