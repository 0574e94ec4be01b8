"""Where a store lives: one set of storage options for its tables (Lance) and its side files (pyarrow.fs).

A local path needs none. For an ``s3://`` store the options come from ``gradstore.open(uri,
storage_options=...)`` or, when not given, from the standard AWS environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ALLOW_HTTP``); LanceDB/Lance take them as they are and
:func:`filesystem` builds the matching ``pyarrow.fs.S3FileSystem``, so tables and side files always reach
the same endpoint with the same credentials.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pyarrow.fs as pafs

from gradstore.errors import InvalidArgumentError, StorePermissionError

#: Lance storage-option names and the environment variables they default to.
AWS_ENVIRONMENT = {
    "aws_endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "aws_access_key_id": ("AWS_ACCESS_KEY_ID",),
    "aws_secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "aws_session_token": ("AWS_SESSION_TOKEN",),
    "aws_region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "allow_http": ("AWS_ALLOW_HTTP",),
}
#: Other spellings Lance accepts for the same options (normalised to the names above).
_ALIASES = {
    "endpoint": "aws_endpoint",
    "endpoint_url": "aws_endpoint",
    "access_key_id": "aws_access_key_id",
    "secret_access_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "region": "aws_region",
    "aws_allow_http": "allow_http",
}


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names object storage (``scheme://``) rather than a local path."""
    return "://" in uri and not uri.startswith("file://")


def storage_options(uri: str, given: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The options of the store at ``uri``: ``given`` (names normalised), else the AWS environment
    variables for an ``s3://`` store; ``None`` for a local store."""
    if not is_remote(uri):
        if given:
            raise InvalidArgumentError("storage_options apply to object-store URIs (s3://...), not local paths")
        return None
    if given is not None:
        options = {_ALIASES.get(key.lower(), key.lower()): str(value) for key, value in given.items()}
    elif uri.startswith("s3://"):
        options = {}
        for key, names in AWS_ENVIRONMENT.items():
            value = next((os.environ[n] for n in names if os.environ.get(n)), None)
            if value is not None:
                options[key] = value
    else:
        options = {}
    endpoint = options.get("aws_endpoint", "")
    if endpoint.startswith("http://") and "allow_http" not in options:
        options["allow_http"] = "true"  # an explicit plain-http endpoint (a local test server) is meant
    return options


def filesystem(uri: str, options: Mapping[str, str] | None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of the store at ``uri`` and the store's path on it."""
    if not is_remote(uri):
        local = uri[len("file://") :] if uri.startswith("file://") else uri
        return pafs.LocalFileSystem(), str(Path(local).resolve())
    scheme, path = uri.split("://", 1)
    if scheme != "s3":
        return pafs.FileSystem.from_uri(uri)
    options = options or {}
    endpoint = options.get("aws_endpoint")
    s3_scheme = None
    if endpoint:
        s3_scheme, _, endpoint = endpoint.rpartition("://") if "://" in endpoint else ("https", "", endpoint)
    s3 = pafs.S3FileSystem(
        access_key=options.get("aws_access_key_id"),
        secret_key=options.get("aws_secret_access_key"),
        session_token=options.get("aws_session_token"),
        region=options.get("aws_region"),
        endpoint_override=endpoint or None,
        scheme=s3_scheme,
    )
    return s3, path.rstrip("/")


# ---------------------------------------------------------------------------------------------- access
#: ``errno`` values of a refused access: no permission (``EACCES``, ``EPERM``) or a read-only file system.
PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
#: What Lance (``object_store``) and pyarrow's S3 filesystem say when storage refuses a request or finds no usable
#: credentials (``AccessDenied``, ``AWS Error ACCESS_DENIED``, ``403 Forbidden``, ``InvalidAccessKeyId``, ...).
_PERMISSION_MESSAGE = re.compile(
    r"access[ _]?denied|forbidden|\b40[13]\b|unauthori[sz]ed|permission denied|read-only file system|"
    r"operation not permitted|invalidaccesskeyid|signaturedoesnotmatch|expiredtoken|invalidtoken|credential",
    re.IGNORECASE,
)
#: What they say of a path or bucket that is not there.
_MISSING_MESSAGE = re.compile(r"nosuchbucket|no such file or directory|\b404\b", re.IGNORECASE)
#: What to do about a refused access (the end of every ``StorePermissionError`` raised for one).
PERMISSION_ADVICE = (
    "check that this process may read the store's files (and write them, to write), or for an object store pass "
    "its credentials (gradstore.open(uri, storage_options=...) or the AWS_* environment variables); a store this "
    "process may only read is opened as usual and used with write=False"
)
#: The message of a write asked of a store this process may not write.
READ_ONLY = "the store is read-only for this process: pass write=False or open a writable copy"


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from (``__cause__``, else ``__context__``)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_permission_error(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is storage refusing access: a ``PermissionError``, an
    ``OSError`` with ``EACCES``/``EPERM``/``EROFS``, or an object store's 401/403 or credentials failure."""
    for cause in _chain(error):
        if isinstance(cause, PermissionError):
            return True
        if isinstance(cause, OSError) and cause.errno in PERMISSION_ERRNOS:
            return True
        if _PERMISSION_MESSAGE.search(str(cause)):
            return True
    return False


def is_missing_error(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) says a path or bucket does not exist."""
    for cause in _chain(error):
        if isinstance(cause, FileNotFoundError) or (isinstance(cause, OSError) and cause.errno == errno.ENOENT):
            return True
        if _MISSING_MESSAGE.search(str(cause)):
            return True
    return False


def permission_error(error: BaseException, uri: str, doing: str) -> StorePermissionError | None:
    """The ``StorePermissionError`` to raise (``from error``) when ``doing`` something to the store at ``uri`` failed
    with ``error``, if storage refused access; ``None`` for any other failure."""
    if isinstance(error, StorePermissionError) or not is_permission_error(error):
        return None
    return StorePermissionError(f"cannot {doing} (store {uri}): access refused ({error}); {PERMISSION_ADVICE}")


def local_writable(uri: str) -> bool:
    """Whether this process may write the local store at ``uri``: create files in its directory, its side files'
    directory and each table's directories (what Lance writes into); ``os.access`` also sees a read-only mount.
    Nothing is written to find out. A store directory not made yet is writable if its nearest existing parent is."""
    local = uri[len("file://") :] if uri.startswith("file://") else uri
    root = Path(local).resolve()
    if not root.exists():
        parent = next((p for p in root.parents if p.exists()), None)
        return parent is not None and os.access(parent, os.W_OK | os.X_OK)
    directories = [root]
    for child in root.iterdir():
        if child.is_dir() and (child.suffix == ".lance" or child.name == "_gradstore"):
            directories.append(child)
            directories.extend(grandchild for grandchild in child.iterdir() if grandchild.is_dir())
    return all(os.access(directory, os.W_OK | os.X_OK) for directory in directories)
