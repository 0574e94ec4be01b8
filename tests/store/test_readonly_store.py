"""A store this process may read but not write: reads, attribution with ``write=False``, SQL, verify and reports work
(fits and indexes stay in memory), writes asked for raise ``StorePermissionError``, and so does making a store where
the process may not write (not ``StoreCorruptError``).

Root ignores file modes, so the end-to-end tests build a store as root and read it as ``nobody`` (``setpriv``); they
are skipped when not running as root or without ``setpriv``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import gradstore
from gradstore.core import storage

N_TRAIN, N_QUERY, DIM = 40, 3, 12


def _build(path: Path) -> None:
    """A store of one run (exact vectors of 12 dims: training and query rows), its examples, one grad-dot
    attribution written (scores and a fit and index in side files)."""
    store = gradstore.open(path, storage_dtype="float32")
    store.create_run("run", dim=DIM)
    rng = np.random.default_rng(0)
    with store.writer("run") as writer:
        writer.append(rng.standard_normal((N_TRAIN, DIM)), [f"x{i}" for i in range(N_TRAIN)], split="train")
        writer.append(rng.standard_normal((N_QUERY, DIM)), [f"q{i}" for i in range(N_QUERY)], split="query")
    store.add_examples([{"example_id": f"x{i}", "label": i % 3} for i in range(N_TRAIN)])
    store.attribute(run="run", k=3, method="grad-dot")


# ---------------------------------------------------------------------------------------------- any user
def test_permission_failures_are_told_apart_from_other_failures():
    assert storage.is_permission_error(PermissionError(errno.EACCES, "Permission denied"))
    assert storage.is_permission_error(OSError(errno.EROFS, "Read-only file system"))
    assert storage.is_permission_error(OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied"))
    assert storage.is_permission_error(
        OSError("Generic S3 error: Client error with status 403 Forbidden: AccessDenied")
    )
    assert storage.is_permission_error(RuntimeError("LanceError(IO): InvalidAccessKeyId"))
    chained = RuntimeError("could not commit")
    chained.__cause__ = PermissionError(errno.EPERM, "Operation not permitted")
    assert storage.is_permission_error(chained)
    assert not storage.is_permission_error(OSError(errno.ENOSPC, "No space left on device"))
    assert not storage.is_permission_error(RuntimeError("LanceError(IO): Corrupt file: data/0.lance"))
    assert storage.is_missing_error(FileNotFoundError(errno.ENOENT, "No such file or directory"))
    assert storage.is_missing_error(OSError("AWS Error NO_SUCH_BUCKET: NoSuchBucket"))
    error = storage.permission_error(PermissionError(errno.EACCES, "Permission denied"), "/s", "open")
    assert isinstance(error, gradstore.StorePermissionError) and isinstance(error, PermissionError)
    assert "storage_options" in str(error) and "write=False" in str(error)
    assert storage.permission_error(OSError(errno.ENOSPC, "No space left on device"), "/s", "open") is None


def test_a_store_taken_as_read_only_keeps_fits_in_memory_and_refuses_writes(store_path):
    _build(store_path)
    store = gradstore.open(store_path)
    store.core.tables._writable = False  # as found for a store whose directories this process may not write
    fits = store_path / "_gradstore" / "fits"
    before = sorted(p.name for p in fits.iterdir())
    found = store.attribute(run="run", k=3, method="fisher", write=False)
    assert found.num_rows == N_QUERY * 3
    store.self_influence(run="run", write=False)
    assert store.fits.fitted == 1  # the fisher fit of attribute, reused from memory
    assert sorted(p.name for p in fits.iterdir()) == before  # nothing saved
    scores = store.count("scores")
    with pytest.raises(gradstore.StorePermissionError, match="read-only for this process: pass write=False"):
        store.attribute(run="run", k=3, method="fisher")
    with pytest.raises(gradstore.StorePermissionError, match="read-only"):
        store.add_examples([{"example_id": "new", "label": 0}])
    with pytest.raises(gradstore.StorePermissionError, match="read-only"):
        store.writer("run")
    assert store.count("scores") == scores


# ---------------------------------------------------------------------------------------------- another uid
def _nobody_available() -> str | None:
    """Why the tests as ``nobody`` cannot run here (``None``: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (to build a store and read it as another user: root ignores file modes)"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux) to run a process as nobody"
    try:
        import pwd

        pwd.getpwnam("nobody")
    except (ImportError, KeyError):
        return "needs a 'nobody' user"
    return None


needs_nobody = pytest.mark.skipif(_nobody_available() is not None, reason=str(_nobody_available()))

SCRIPT = r"""
import json, sys
import gradstore

store_path, home, empty = sys.argv[1:4]
out = {}


def error_of(call):
    try:
        call()
    except Exception as error:
        return [type(error).__name__, isinstance(error, gradstore.StorePermissionError), str(error)]
    return None


store = gradstore.open(store_path)
out["writable"] = store.writable
top = store.attribute(run="run", k=3, method="fisher", write=False)
out["attribute"] = [top.column("example_id").to_pylist(), top.column("score").to_pylist()]
out["self_influence"] = store.self_influence(run="run", write=False).num_rows
out["fitted"] = store.fits.fitted
out["sql"] = store.sql("select count(*) from scores").fetchall()[0][0]
report = store.verify()
out["verify"] = [report.ok, report.side_files_checked, report.problems]
out["report"] = str(store.report(out=f"{home}/report.html"))
out["attribute_write"] = error_of(lambda: store.attribute(run="run", k=3, method="fisher"))
out["add_examples"] = error_of(lambda: store.add_examples([{"example_id": "new", "label": 0}]))


def capture():
    import torch

    with store.capture(torch.nn.Linear(3, 2), "run2", projection=None):
        pass


out["capture"] = error_of(capture)
out["new_store"] = error_of(lambda: gradstore.open(f"{store_path}/inner/new"))
out["new_store_in_empty_directory"] = error_of(lambda: gradstore.open(empty))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def readonly_store():
    """``(base, store, home)``: a store built by root, world-readable and writable by root only, under a directory
    every user may traverse; ``home`` a directory ``nobody`` may write."""
    base = Path(tempfile.mkdtemp(prefix="gradstore-readonly-"))  # not under pytest's root-only temp directory
    try:
        base.chmod(0o755)
        _build(base / "store")
        (base / "empty").mkdir()
        subprocess.run(["chmod", "-R", "a+rX,go-w", str(base / "store"), str(base / "empty")], check=True)
        home = base / "home"
        home.mkdir()
        home.chmod(0o777)
        yield base, base / "store", home
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as_nobody(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / "cache"),
        "GRADSTORE_CACHE_DIR": str(home / "gradstore-cache"),
        "TMPDIR": str(home),
    }
    command = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=home)


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@needs_nobody
def test_a_store_read_by_another_user_attributes_without_writing(readonly_store):
    base, store_path, home = readonly_store
    expected_copy = base / "copy"
    shutil.copytree(store_path, expected_copy)
    expected = gradstore.open(expected_copy).attribute(run="run", k=3, method="fisher", write=False)
    before = _files(store_path)
    script = home / "read_only.py"
    script.write_text(SCRIPT)
    done = _as_nobody([str(script), str(store_path), str(home), str(base / "empty")], home)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["writable"] is False
    ids, scores = out["attribute"]
    assert ids == expected.column("example_id").to_pylist()
    np.testing.assert_allclose(scores, expected.column("score").to_pylist(), rtol=1e-5)
    assert out["self_influence"] == N_TRAIN
    assert out["fitted"] == 1  # self_influence reused attribute's fisher fit, kept in memory
    assert out["sql"] == N_QUERY * 3  # root's grad-dot results
    ok, side_files, problems = out["verify"]
    assert ok and side_files > 0, problems
    assert Path(out["report"]).stat().st_size > 0
    for call in ("attribute_write", "add_examples", "capture"):
        name, is_permission, message = out[call]
        assert is_permission, (call, out[call])
        assert "read-only for this process: pass write=False or open a writable copy" in message
    for call in ("new_store", "new_store_in_empty_directory"):
        name, is_permission, message = out[call]
        assert name == "StorePermissionError" and is_permission, (call, out[call])
    assert _files(store_path) == before  # nothing of the store changed
    assert not stat.S_IWOTH & store_path.stat().st_mode


@needs_nobody
def test_the_cli_on_a_store_read_by_another_user(readonly_store):
    base, store_path, home = readonly_store
    cli = Path(sys.executable).parent / "gradstore"
    if not cli.exists():
        pytest.skip(f"no gradstore console script beside {sys.executable}")
    attribute = [str(cli), "attribute", str(store_path), "--run", "run", "-k", "2", "--method", "fisher"]
    refused = _as_nobody(attribute, home)
    assert refused.returncode == 1, refused.stderr[-4000:]
    assert "read-only for this process" in refused.stderr
    assert "Traceback" not in refused.stderr
    help_text = _as_nobody([str(cli), "attribute", "--help"], home).stdout
    if "--no-write" not in help_text:
        pytest.skip("`gradstore attribute` has no --no-write option yet: a read-only store cannot be attributed there")
    done = _as_nobody([*attribute, "--no-write"], home)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "q0" in done.stdout and "fisher" in done.stdout
