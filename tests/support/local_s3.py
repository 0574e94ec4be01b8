"""A local S3-compatible server for trying, testing and benchmarking a store on object storage.

:func:`moto_server` starts ``moto`` in server mode (a subprocess on a free localhost port; ``pip install
'moto[server]'``, part of the ``test`` extra) and :func:`new_bucket` creates a bucket on it and returns the
storage options that reach it::

    with moto_server() as endpoint:
        store = gradstore.open("s3://bucket/store", storage_options=new_bucket(endpoint, "bucket"))

Test tooling, not part of the package: the tests (``tests/conftest.py``'s ``s3_endpoint``/``s3_bucket`` fixtures,
``tests/core/test_object_store.py``) import it as ``local_s3`` (pyproject.toml puts ``tests/support`` on pytest's
``sys.path``), and ``bench/ingest_throughput.py`` puts ``tests/support`` on ``sys.path`` to share it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

#: The credentials and region moto accepts (any non-empty values work).
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "aws_region": "us-east-1"}


@contextmanager
def moto_server(start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run a moto S3 server on a free localhost port for the ``with`` block; yields its ``http://`` endpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("the moto server exited") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait(30)


def s3_client(endpoint: str):
    """A ``boto3`` S3 client of the server at ``endpoint`` (boto3 comes with moto)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDENTIALS["aws_access_key_id"],
        aws_secret_access_key=CREDENTIALS["aws_secret_access_key"],
        region_name=CREDENTIALS["aws_region"],
    )


def new_bucket(endpoint: str, name: str) -> dict[str, str]:
    """Create bucket ``name`` on the server at ``endpoint``; the storage options of a store in it."""
    s3_client(endpoint).create_bucket(Bucket=name)
    return {"aws_endpoint": endpoint, **CREDENTIALS, "allow_http": "true"}
