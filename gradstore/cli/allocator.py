"""The command line's memory allocator setting: glibc's malloc arenas limited to the CPUs this process may use.

glibc gives every thread that allocates while the others hold their arenas one of up to ``8 x cores`` arenas of its
own; Lance's reader threads, DuckDB's and torch's workers each fill one, and memory freed in an arena stays mapped
while a live block sits above it. On 2 cores ``gradstore demo`` peaked at 1.07 GB with the default arenas and
0.94 GB with ``MALLOC_ARENA_MAX=2`` (same results; docs/benchmarks.md). The command line is a process of its own,
so it sets this for itself; the library never changes the allocator of the process it is imported into.
``MALLOC_ARENA_MAX`` in the environment wins; other C libraries (musl, macOS, Windows) are left alone."""

from __future__ import annotations

import ctypes
import os
import sys

M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas() -> int | None:
    """Limit glibc's malloc arenas to the CPUs this process may run on; the limit set, or ``None`` when nothing
    was changed (not glibc, or ``MALLOC_ARENA_MAX`` set)."""
    if not sys.platform.startswith("linux") or os.environ.get("MALLOC_ARENA_MAX"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no such arenas)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    limit = max(2, len(os.sched_getaffinity(0)))
    return limit if mallopt(M_ARENA_MAX, limit) == 1 else None
