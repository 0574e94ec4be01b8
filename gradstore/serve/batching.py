"""Micro-batching: concurrent single-query lookups with the same options are scored as one call (one GEMM over
the prepared rows); each caller gets its own query's rows. Batches form while the previous one runs (a lone
lookup on an idle server waits for nothing); ``window_s`` adds a fixed wait for company."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np


class _Group:
    def __init__(self) -> None:
        self.vectors: list[np.ndarray] = []
        self.full = threading.Event()
        self.done = threading.Event()
        self.results: list[Any] | None = None
        self.error: BaseException | None = None


class MicroBatcher:
    """``submit(key, vector)`` blocks until the vector's result is ready. The first caller of a key waits up to
    ``window_s`` (or until ``max_batch`` vectors joined) and for the batch running before it, then runs
    ``run_batch(key, vectors [n, dim])``, which returns one result per row. When a batch fails, each of its
    vectors is run alone, so an error reaches only the request that caused it. ``batches`` and ``batched`` count
    calls and vectors (for tests and benches)."""

    def __init__(
        self, run_batch: Callable[[Hashable, np.ndarray], list[Any]], window_s: float = 0.0, max_batch: int = 64
    ) -> None:
        self.run_batch = run_batch
        self.window_s = window_s
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._open: dict[Hashable, _Group] = {}
        self._slot = threading.Lock()  # one batch scores at a time; the next one fills meanwhile
        self.batches = 0
        self.batched = 0

    def submit(self, key: Hashable, vector: np.ndarray) -> Any:
        with self._lock:
            group = self._open.get(key)
            leader = group is None
            if leader:
                group = self._open[key] = _Group()
            index = len(group.vectors)
            group.vectors.append(vector)
            if len(group.vectors) >= self.max_batch:
                del self._open[key]
                group.full.set()
        if leader:
            if self.window_s > 0:
                group.full.wait(self.window_s)
            with self._slot:
                with self._lock:
                    if self._open.get(key) is group:
                        del self._open[key]
                self._run(key, group)
        else:
            group.done.wait()
        result = group.results[index] if group.results is not None else None
        if isinstance(result, BaseException):
            raise result
        if group.error is not None:
            raise group.error
        return result

    def _run(self, key: Hashable, group: _Group) -> None:
        try:
            with self._lock:
                self.batches += 1
                self.batched += len(group.vectors)
            try:
                group.results = self.run_batch(key, np.stack(group.vectors))
            except Exception:
                if len(group.vectors) == 1:
                    raise
                results: list[Any] = []
                for vector in group.vectors:  # whose request was it? each alone, errors to their owners
                    try:
                        results.extend(self.run_batch(key, vector[None]))
                    except Exception as error:
                        results.append(error)
                group.results = results
        except BaseException as error:
            group.error = error
        finally:
            group.done.set()
