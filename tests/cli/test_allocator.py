"""The command line's allocator setting (gradstore.cli.allocator): glibc's malloc arenas limited to this process's
CPUs, the environment's ``MALLOC_ARENA_MAX`` respected."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from gradstore.cli.allocator import limit_malloc_arenas


def _glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is None


@pytest.mark.skipif(not _glibc(), reason="glibc only")
def test_arenas_are_limited_to_the_cpus_of_the_process(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert limit_malloc_arenas() == max(2, len(os.sched_getaffinity(0)))
