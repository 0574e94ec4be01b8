"""Side files: what the store keeps beside its tables (fitted preconditioners, indexes, curvature).

They live under ``<store>/_gradstore/`` in the store's own storage, local directory or object store alike
(through ``pyarrow.fs``). Every key is a sequence of validated path components, so no name stored in a
store or passed by a user can reach outside that root. Each file is written whole (to a temporary name
then renamed on local disk; one PUT on object storage), so a reader never sees half a file, and its
SHA-256 is kept beside it, so a damaged file is reported as such instead of being used.

Processes that write the same key at once (two jobs fitting the same rows, DDP ranks saving curvature) hold its
writers' lock (:meth:`SideFiles.writing`, an advisory ``flock`` on local stores) and readers its shared lock
(:meth:`SideFiles.reading`), so a file and its checksum are always one writer's pair and no reader sees a key
half replaced. Object stores offer no lock: there the writers of one key must not overlap.

A process may be killed between any two of these steps, so each leaves a state that checks out:
replacing a file first lets its checksum file accept the old and the new content, then replaces the file,
then keeps only the new checksum; removing a key first deletes its ``manifest.json`` (the file written
last, which puts a fit or index in use) and every checksum, so what a kill leaves of a half-removed key
is neither used nor reported as damaged (a checksum never outlives its file).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO

import pyarrow.fs as pafs

from gradstore.core import storage
from gradstore.errors import InvalidNameError, StoreCorruptError

try:
    import fcntl
except ImportError:  # not on POSIX: writers are not serialized
    fcntl = None

ROOT = "_gradstore"
CHECKSUM_SUFFIX = ".sha256"
#: The file of a directory key written last (fits, indexes): the key is in use once it exists.
MANIFEST = "manifest.json"
LOCKS = "locks"  # the writers' lock files of local stores (see SideFiles.writing)
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}$")


def check_component(part: str, what: str = "name") -> str:
    """``part`` if it is a safe single path component (letters, digits, ``._=+-``; not ``.``/``..``)."""
    if not isinstance(part, str) or not _COMPONENT.match(part) or part in (".", ".."):
        raise InvalidNameError(
            f"{what} {part!r} cannot name a file: use 1-200 letters, digits and '._=+-', "
            "starting with a letter or digit"
        )
    return part


class SideFiles:
    """Files under ``<store uri>/_gradstore`` on the store's own filesystem."""

    def __init__(self, store_uri: str, storage_options: dict[str, str] | None = None) -> None:
        self.uri = store_uri
        filesystem, base = storage.filesystem(store_uri, storage_options)
        self.filesystem = filesystem
        self.store_path = base.rstrip("/")  # the store's own directory (its tables live there too)
        self.root = f"{self.store_path}/{ROOT}"
        self.local = isinstance(filesystem, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        """The full path of key ``parts`` (each part validated)."""
        return "/".join([self.root, *(check_component(p) for p in parts)])

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole file (atomically: a reader sees the old or the new content, never a mix), then its
        SHA-256 beside it (``<name>.sha256``), which :meth:`read_bytes` and :meth:`damaged` check. Storage refusing
        the write (file modes, a read-only mount, object-store credentials) raises ``StorePermissionError``."""
        target = self.path(*parts)
        with self._refused("write side file " + target):
            self._write_bytes(data, target)

    @contextmanager
    def _refused(self, doing: str) -> Iterator[None]:
        """Storage refusing access inside the block raises ``StorePermissionError`` (``doing``: what was done)."""
        try:
            yield
        except OSError as error:  # a StorePermissionError raised inside passes as it is
            refused = storage.permission_error(error, self.uri, doing)
            if refused is None:
                raise
            raise refused from error

    def _write_bytes(self, data: bytes, target: str) -> None:
        self.filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
        digest = hashlib.sha256(data).hexdigest()
        try:
            accepted = self._get(target + CHECKSUM_SUFFIX).decode().split()
        except (FileNotFoundError, UnicodeDecodeError):
            accepted = []
        if accepted and digest not in accepted:  # while the file is replaced, either content checks out
            self._put(target + CHECKSUM_SUFFIX, "\n".join([digest, *accepted]).encode())
        self._put(target, data)
        self._put(target + CHECKSUM_SUFFIX, digest.encode())

    def _put(self, target: str, data: bytes) -> None:
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
        data = self._get(target)
        try:
            accepted = self._get(target + CHECKSUM_SUFFIX).decode().split()
        except FileNotFoundError:
            return data  # written before checksums were kept
        if hashlib.sha256(data).hexdigest() not in accepted:
            raise StoreCorruptError(f"side file {target} is damaged: its content does not match its checksum")
        return data

    def _get(self, target: str) -> bytes:
        try:
            with self.filesystem.open_input_stream(target) as stream:
                return stream.read()
        except FileNotFoundError:
            raise
        except OSError as error:
            if self.filesystem.get_file_info(target).type == pafs.FileType.NotFound:
                raise FileNotFoundError(target) from None
            refused = storage.permission_error(error, self.uri, f"read side file {target}")
            if refused is not None:
                raise refused from error
            raise StoreCorruptError(f"side file {target} cannot be read: {error}") from error

    def damaged(self) -> tuple[list[str], int]:
        """Check every side file against its checksum: ``(problems, files checked)``; a file written before
        checksums were kept is not checked."""
        selector = pafs.FileSelector(self.root, recursive=True, allow_not_found=True)
        files = {
            info.path
            for info in self.filesystem.get_file_info(selector)
            if info.type == pafs.FileType.File and not info.path.endswith(".tmp")
        }
        problems, checked = [], 0
        for path in sorted(files):
            if path.endswith(CHECKSUM_SUFFIX):
                if path[: -len(CHECKSUM_SUFFIX)] not in files:
                    problems.append(f"side file {path[: -len(CHECKSUM_SUFFIX)]} is missing")
                continue
            if path + CHECKSUM_SUFFIX not in files:
                continue
            checked += 1
            try:
                accepted = self._get(path + CHECKSUM_SUFFIX).decode().split()
                if hashlib.sha256(self._get(path)).hexdigest() not in accepted:
                    problems.append(f"side file {path} is damaged (checksum mismatch)")
            except (OSError, StoreCorruptError, UnicodeDecodeError) as error:
                problems.append(f"side file {path} cannot be read: {error}")
        return problems, checked

    def exists(self, *parts: str) -> bool:
        """Whether a file (or directory) exists under the key."""
        return self.filesystem.get_file_info(self.path(*parts)).type != pafs.FileType.NotFound

    def writing(self, *parts: str) -> AbstractContextManager[None]:
        """Hold a key's lock exclusively while writing or replacing it: processes that save the same fit or
        index at once take turns (one's removal would delete the other's files mid-write, and two checksums
        written at once can leave one file's content beside the other's checksum), and no reader
        (:meth:`reading`) sees a half-replaced key. On a local store an advisory ``flock`` on
        ``_gradstore/locks/<hash of the key>.lock``; an object store offers no lock, so there the writers of
        one key must not overlap."""
        return self._locked(parts, exclusive=True)

    def reading(self, *parts: str) -> AbstractContextManager[None]:
        """Hold a key's lock shared while reading it (readers do not wait for each other, only for a writer)."""
        return self._locked(parts, exclusive=False)

    @contextmanager
    def _locked(self, parts: tuple[str, ...], exclusive: bool) -> Iterator[None]:
        handle = self._lock_file(parts) if self.local and fcntl is not None else None
        if handle is None:
            yield
            return
        with handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _lock_file(self, parts: tuple[str, ...]) -> BinaryIO | None:
        """The open lock file of a key, or ``None``: on a store this process cannot write (read-only: no writer
        to wait for), or where ``locks`` would lead outside the store (a link planted in it)."""
        locks = Path(self.root) / LOCKS
        name = hashlib.sha256(self.path(*parts).encode()).hexdigest()[:32]
        try:
            locks.mkdir(parents=True, exist_ok=True)
            if not locks.resolve().is_relative_to(Path(self.store_path).resolve()):
                return None
            descriptor = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError:
            return None
        return os.fdopen(descriptor, "r+b")

    def children(self, *parts: str) -> list[str]:
        """The names directly under a directory key (none if it does not exist)."""
        selector = pafs.FileSelector(self.path(*parts), allow_not_found=True)
        return sorted(info.base_name for info in self.filesystem.get_file_info(selector))

    def remove(self, *parts: str) -> None:
        """Delete a key and everything under it (nothing happens if it does not exist): a directory's
        ``manifest.json`` first, then every checksum, then the rest (see the module docstring)."""
        target = self.path(*parts)
        with self._refused("remove side file " + target):
            self._remove(target)

    def _remove(self, target: str) -> None:
        info = self.filesystem.get_file_info(target)
        if info.type == pafs.FileType.Directory:
            selector = pafs.FileSelector(target, recursive=True)
            checksums = [i.path for i in self.filesystem.get_file_info(selector) if i.path.endswith(CHECKSUM_SUFFIX)]
            manifest = f"{target}/{MANIFEST}"
            for path in [manifest + CHECKSUM_SUFFIX, manifest, *checksums]:
                if self.filesystem.get_file_info(path).type == pafs.FileType.File:
                    self.filesystem.delete_file(path)
            self.filesystem.delete_dir(target)
        elif info.type == pafs.FileType.File:
            self.filesystem.delete_file(target)

    def bytes_under_store(self) -> int:
        """Total size of every file of the store (tables and side files), local or remote."""
        selector = pafs.FileSelector(self.store_path, recursive=True, allow_not_found=True)
        return sum(
            info.size or 0 for info in self.filesystem.get_file_info(selector) if info.type == pafs.FileType.File
        )

    def put_directory(self, local: Path, *parts: str) -> None:
        """Copy the files of a local directory (recursively) under a key."""
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.write_bytes(path.read_bytes(), *parts, *path.relative_to(local).parts)

    @contextmanager
    def local_directory(self, *parts: str) -> Iterator[Path]:
        """The files under a key as a local directory (in place on local disk, a temporary copy otherwise),
        each checked against its checksum (``StoreCorruptError`` naming a damaged file)."""
        base = self.path(*parts)
        if self.local:  # read in place
            _check_directory(Path(base), base)
            yield Path(base)
            return
        scratch = Path(tempfile.mkdtemp(prefix="gradstore-"))
        try:
            selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
            for info in self.filesystem.get_file_info(selector):
                if info.type == pafs.FileType.File:
                    relative = info.path[len(base) + 1 :]
                    destination = scratch.joinpath(*relative.split("/"))
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with self.filesystem.open_input_stream(info.path) as stream:
                        destination.write_bytes(stream.read())
            _check_directory(scratch, base)
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _check_directory(directory: Path, shown: str) -> None:
    """Raise ``StoreCorruptError`` if a file under ``directory`` does not match the checksum beside it."""
    for checksum in directory.rglob(f"*{CHECKSUM_SUFFIX}"):
        path = checksum.with_name(checksum.name[: -len(CHECKSUM_SUFFIX)])
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(chunk)
        except FileNotFoundError:
            raise StoreCorruptError(f"side file {shown}/{path.relative_to(directory)} is missing") from None
        if digest.hexdigest() not in checksum.read_text().split():
            raise StoreCorruptError(
                f"side file {shown}/{path.relative_to(directory)} is damaged: its content does not match its checksum"
            )
