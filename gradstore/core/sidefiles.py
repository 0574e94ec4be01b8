"""Side files: what the store keeps beside its tables (fitted preconditioners, indexes, curvature).

They live under ``<store>/_gradstore/`` in the store's own storage, local directory or object store alike
(through ``pyarrow.fs``). Every key is a sequence of validated path components, so no name stored in a
store or passed by a user can reach outside that root. Each file is written whole (to a temporary name
then renamed on local disk; one PUT on object storage), so a reader never sees half a file.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

from gradstore.core import storage
from gradstore.errors import InvalidNameError, StoreCorruptError

ROOT = "_gradstore"
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")


def check_component(part: str, what: str = "name") -> str:
    """``part`` if it is a safe single path component (letters, digits, ``._=+-``; not ``.``/``..``)."""
    if not isinstance(part, str) or not _COMPONENT.match(part) or part in (".", ".."):
        raise InvalidNameError(f"{what} {part!r} cannot name a file: use 1-200 letters, digits and '._=+-', "
                               "starting with a letter or digit")
    return part


class SideFiles:
    """Files under ``<store uri>/_gradstore`` on the store's own filesystem."""

    def __init__(self, store_uri: str, storage_options: dict[str, str] | None = None) -> None:
        filesystem, base = storage.filesystem(store_uri, storage_options)
        self.filesystem = filesystem
        self.store_path = base.rstrip("/")  # the store's own directory (its tables live there too)
        self.root = f"{self.store_path}/{ROOT}"
        self.local = isinstance(filesystem, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        """The full path of key ``parts`` (each part validated)."""
        return "/".join([self.root, *(check_component(p) for p in parts)])

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole file (atomically: a reader sees the old or the new content, never a mix)."""
        target = self.path(*parts)
        self.filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
        if self.local:
            temporary = f"{target}.{uuid.uuid4().hex}.tmp"
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, target)
        else:
            with self.filesystem.open_output_stream(target) as stream:
                stream.write(data)

    def read_bytes(self, *parts: str) -> bytes:
        """The content of a file (``FileNotFoundError`` if there is none)."""
        target = self.path(*parts)
        try:
            with self.filesystem.open_input_stream(target) as stream:
                return stream.read()
        except FileNotFoundError:
            raise
        except OSError as error:
            if self.filesystem.get_file_info(target).type == pafs.FileType.NotFound:
                raise FileNotFoundError(target) from None
            raise StoreCorruptError(f"side file {target} cannot be read: {error}") from error

    def exists(self, *parts: str) -> bool:
        """Whether a file (or directory) exists under the key."""
        return self.filesystem.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound

    def children(self, *parts: str) -> list[str]:
        """Names directly under a directory key (empty if it does not exist)."""
        selector = pafs.FileSelector(self.path(*parts), allow_not_found=True)
        return sorted(info.base_name for info in self.filesystem.get_file_info(selector))

    def remove(self, *parts: str) -> None:
        """Delete a directory key and everything under it (nothing happens if it does not exist)."""
        target = self.path(*parts)
        info = self.filesystem.get_file_info(target)
        if info.type == pafs.FileType.Directory:
            self.filesystem.delete_dir(target)
        elif info.type == pafs.FileType.File:
            self.filesystem.delete_file(target)

    def bytes_under_store(self) -> int:
        """Total size of every file of the store (tables and side files), local or remote."""
        selector = pafs.FileSelector(self.store_path, recursive=True, allow_not_found=True)
        return sum(info.size or 0 for info in self.filesystem.get_file_info(selector)
                   if info.type == pafs.FileType.File)

    def put_directory(self, local: Path, *parts: str) -> None:
        """Copy the files of a local directory (recursively) under a key."""
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.write_bytes(path.read_bytes(), *parts, *path.relative_to(local).parts)

    @contextmanager
    def local_directory(self, *parts: str) -> Iterator[Path]:
        """The files under a key as a local directory (in place on local disk, a temporary copy otherwise)."""
        base = self.path(*parts)
        if self.local:  # read in place
            yield Path(base)
            return
        scratch = Path(tempfile.mkdtemp(prefix="gradstore-"))
        try:
            selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
            for info in self.filesystem.get_file_info(selector):
                if info.type == pafs.FileType.File:
                    relative = info.path[len(base) + 1:]
                    destination = scratch.joinpath(*relative.split("/"))
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with self.filesystem.open_input_stream(info.path) as stream:
                        destination.write_bytes(stream.read())
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
