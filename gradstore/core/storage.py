"""Where a store lives: one set of storage options for its tables (Lance) and its side files (pyarrow.fs).

A local path needs none. For an ``s3://`` store the options come from ``gradstore.open(uri,
storage_options=...)`` or, when not given, from the standard AWS environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ALLOW_HTTP``); LanceDB/Lance take them as they are and
:func:`filesystem` builds the matching ``pyarrow.fs.S3FileSystem``, so tables and side files always reach
the same endpoint with the same credentials.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pyarrow.fs as pafs

from gradstore.errors import InvalidArgumentError

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
