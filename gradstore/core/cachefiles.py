"""What the row files and scan files share: names, atomic writes and a byte budget for files of derived data kept
on local disk between processes (:mod:`gradstore.core.rowfiles`, :mod:`gradstore.core.scanfiles`).

A file's name is ``<hash of what it holds>-<hash of what that was read from>``: files of the same thing share the
first part, so writing a new one removes the stale ones."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_Loaded = TypeVar("_Loaded")

STALE_TEMP_SECONDS = 3600  # a temporary file this old was left by a process that died while writing


def cache_file_name(identity: dict[str, Any], content: dict[str, Any]) -> str:
    """``<hash of identity>-<hash of content>`` (each 32 hex digits)."""
    return f"{_digest(identity)}-{_digest(content)}"


def _digest(value: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def dataset_content(dataset: Any) -> dict[str, Any]:
    """What a read of the Lance ``dataset`` (one version of a table) reads from: its version and its fragments'
    data and deletion files, which Lance never changes in place (a table made again at the same path and version
    has other files)."""
    return {"version": dataset.version, "fragments": [str(f.metadata) for f in dataset.get_fragments()]}


def load_or_remove(path: Path, load: Callable[[Path], _Loaded], kind: str) -> _Loaded | None:
    """``load(path)``; ``None`` when there is no file at ``path`` or it fails to load or check (then the ``kind``
    file is removed: a damaged cache file only costs a read from the store). A loaded file is marked recently used
    (removed last by :func:`evict`)."""
    if not path.is_file():
        return None
    try:
        loaded = load(path)
    except Exception as error:
        log.warning("%s %s is unusable (%s); removed, read from the store instead", kind, path, error)
        path.unlink(missing_ok=True)
        return None
    with contextlib.suppress(OSError):  # removed by another process meanwhile, or a read-only directory
        os.utime(path)
    return loaded


def write_into_place(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` a temporary file beside ``path``, then rename it to ``path``: readers see a whole file or
    none. The temporary file is removed if anything fails."""
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def evict(kept: Path, suffix: str, budget_bytes: int, budget_files: int | None = None) -> None:
    """In ``kept``'s directory, remove the other files of the same thing as ``kept`` (same first part of the name),
    temporary files of dead writers, and the least recently used ``suffix`` files until the directory holds at most
    ``budget_bytes`` and (when given) ``budget_files`` of them."""
    same = kept.name.split("-")[0]
    now = time.time()
    files = []
    for path in kept.parent.iterdir():
        try:
            stat = path.stat()
            if path.name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_SECONDS:
                path.unlink()
            elif path.name.endswith(suffix) and path.name != kept.name:
                if path.name.split("-")[0] == same:
                    path.unlink()
                else:
                    files.append((stat.st_mtime, stat.st_size, path))
        except FileNotFoundError:  # another process removed it meanwhile
            continue
    total = sum(size for _, size, _ in files) + _size(kept)
    count = len(files) + 1
    for _, size, path in sorted(files, key=lambda entry: entry[0]):
        if total <= budget_bytes and (budget_files is None or count <= budget_files):
            break
        path.unlink(missing_ok=True)
        total -= size
        count -= 1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # removed by another process's eviction meanwhile
        return 0
