"""Shared fixtures: a fresh store directory per test, deterministic torch settings."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("LANCE_LOG", "error")
# row files (gradstore.core.row_cache) the tests write go to a directory of this session, not the user's cache
os.environ["GRADSTORE_CACHE_DIR"] = tempfile.mkdtemp(prefix="gradstore-test-cache-")


@pytest.fixture
def disk_full(monkeypatch):
    """``disk_full(owner, name)``: calling ``owner.name`` raises ``OSError(ENOSPC)``, as a write to a full disk does."""

    def fill(owner, name: str) -> None:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(owner, name, full)

    return fill


@pytest.fixture(scope="session")
def built_store(tmp_path_factory):
    """``built_store(name, build)``: the directory of a store ``build(path)`` made once per test session (the first
    test asking for ``name`` builds it); a test that writes to it copies it first (``shutil.copytree``)."""
    built: dict[str, object] = {}

    def get(name: str, build):
        if name not in built:
            path = tmp_path_factory.mktemp(f"built-{name}") / "store"
            build(path)
            built[name] = path
        return built[name]

    return get


@pytest.fixture(scope="session")
def ray_engine():
    """A ``RayEngine`` on a local Ray cluster of 2 CPUs, started once per session (a start costs seconds) by the
    first test that asks for it and shut down at the end (skipped where ray is not installed)."""
    ray = pytest.importorskip("ray")
    from gradstore.core.engine import RayEngine

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield RayEngine()
    finally:
        ray.shutdown()


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
    pytest.importorskip("moto.server")
    from local_s3 import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A new bucket on the local S3 server: ``(bucket name, storage options)``."""
    import re
    import uuid

    from local_s3 import new_bucket

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    return name, new_bucket(s3_endpoint, name)


#: Chromium's flags in tests: no sandbox (root), and none of its background connections (the network is closed).
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium under Playwright (skipped when either is missing; .ci/run installs both)."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install -y chromium)")
    with playwright_api.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=executable, headless=True, args=BROWSER_ARGS)
        yield launched
        launched.close()
