"""Pages of a memory-mapped file brought into the process's page tables in one system call per tensor.

A search over rows mapped from a row file (:mod:`gradstore.core.row_cache`) reads every byte; left to itself, the
first read takes one page fault per few pages (about 5 ms over 400 MB of bf16 rows on a 2-core machine, a tenth of
the search). ``madvise(MADV_POPULATE_READ)`` (Linux 5.14+) maps the pages, from the page cache or the disk, in one
call per range and far cheaper than the faults. Elsewhere (another system, an older kernel) nothing happens: the
faults then map the pages as before.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable

import torch

#: ``MADV_POPULATE_READ`` (Linux uapi); the :mod:`mmap` module names it from Python 3.13 on only.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def tensors_in(value: object) -> Iterable[torch.Tensor]:
    """The tensors in a loaded state (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def populate(tensors: Iterable[torch.Tensor]) -> bool:
    """Map the pages of each CPU tensor's storage (read-only population, no copy); ``False`` where the system
    cannot (nothing is changed then: the first reads fault the pages in)."""
    if _MADVISE is None:
        return False
    page = mmap.PAGESIZE
    done: set[tuple[int, int]] = set()
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or (start, size) in done:
            continue
        done.add((start, size))
        aligned = start - start % page
        if _MADVISE(aligned, size + start - aligned, MADV_POPULATE_READ) != 0:
            return False
    return True
