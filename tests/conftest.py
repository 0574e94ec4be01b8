"""Shared fixtures: a fresh store directory per test, deterministic torch settings."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LANCE_LOG", "error")


@pytest.fixture
def store_path(tmp_path):
    """A path for a new store (not created yet)."""
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    """A new, empty store."""
    import gradstore

    return gradstore.open(store_path)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A local S3-compatible server (moto in server mode, a subprocess on a free localhost port)."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("moto.server")
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
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("the moto server exited") from None
                time.sleep(0.1)
        else:
            raise RuntimeError("the moto server did not start")
        yield endpoint
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A new bucket on the local S3 server: ``(bucket name, storage options)``."""
    import re
    import uuid

    import boto3

    options = {
        "aws_endpoint": s3_endpoint,
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "aws_region": "us-east-1",
        "allow_http": "true",
    }
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    return name, options
