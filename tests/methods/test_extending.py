"""User-defined methods (gradstore.register_method): the RMS method of examples/custom_method.py scores as its
numpy closed form through attribute, score_matrix, self_influence, select and build_index, from the CLI (loaded
through GRADSTORE_PLUGINS), and misuse is a GradstoreError that says what to do."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gradstore
from gradstore.methods import METHODS
from gradstore.methods.extension import scoped_registry

ROOT = Path(__file__).resolve().parents[2]

RUN, DIM, N = "r", 12, 90
RNG = np.random.default_rng(4)
TRAIN = (RNG.standard_normal((N, DIM)) * np.logspace(-1, 0, DIM)).astype(np.float32)
QUERIES = RNG.standard_normal((3, DIM)).astype(np.float32)
TRAIN_IDS = [f"t{i:03d}" for i in range(N)]


@pytest.fixture(scope="module", autouse=True)
def custom_method():
    """examples/custom_method.py imported (it registers "rms") for this module only: the registry is restored."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        with scoped_registry():
            loaded = sys.modules.get("custom_method")  # imported by an earlier scope: registered again
            yield importlib.reload(loaded) if loaded else importlib.import_module("custom_method")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert "rms" not in METHODS


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = gradstore.open(tmp_path_factory.mktemp("extending") / "store", storage_dtype="float32")
    store.create_run(RUN, dim=DIM)
    store.record_checkpoint(RUN, "final", step=1, learning_rate=0.1)
    with store.writer(RUN) as writer:
        writer.append(TRAIN, TRAIN_IDS, checkpoint="final", split="train")
        writer.append(QUERIES, ["qa", "qb", "qc"], checkpoint="final", split="query")
    return store


def expected(damping: float) -> np.ndarray:
    """``(P^-1 q) . g`` with ``P = diag(E[g^2]) + damping``, in float64."""
    train = TRAIN.astype(np.float64)
    second = (train**2).mean(0)
    return (QUERIES / (second + damping)) @ train.T


def test_a_registered_method_scores_as_its_closed_form_everywhere(store, custom_method):
    assert METHODS["rms"] is custom_method.RMS
    want = expected(0.3)
    matrix = store.score_matrix(["qa", "qb", "qc"], run=RUN, method="rms", damping=0.3)
    order = [TRAIN_IDS.index(e) for e in matrix.example_ids]
    np.testing.assert_allclose(matrix.scores, want[:, order], rtol=1e-5, atol=1e-6)
    top = store.attribute(["qa"], run=RUN, method="rms", damping=0.3, k=5, write=False)
    best = np.argsort(-want[0], kind="stable")[:5]
    assert top.column("example_id").to_pylist() == [TRAIN_IDS[i] for i in best]
    np.testing.assert_allclose(top.column("score").to_numpy(), want[0][best], rtol=1e-5)
    second = (TRAIN.astype(np.float64) ** 2).mean(0)
    own = (TRAIN.astype(np.float64) ** 2 / (second + 0.1)).sum(1)  # g . P^-1 g at the default damping
    table = store.self_influence(run=RUN, method="rms", write=False).to_pandas().set_index("example_id")
    np.testing.assert_allclose(table.loc[TRAIN_IDS, "self_influence"], own, rtol=1e-5)
    store.build_index(RUN, method="rms")
    indexed = store.attribute(["qa"], run=RUN, method="rms", k=5, write=False)
    assert indexed.column("example_id").to_pylist() == [TRAIN_IDS[i] for i in np.argsort(-expected(0.1)[0])[:5]]
    chosen = store.select(["qa", "qb"], run=RUN, budget=10, preconditioner="rms")
    assert len(chosen) == 10


def test_the_cli_loads_a_method_named_in_gradstore_plugins(store):
    env = {**os.environ, "GRADSTORE_PLUGINS": "custom_method"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "gradstore.cli",
        "attribute",
        store.uri,
        "--run",
        RUN,
        "--method",
        "rms",
        "--k",
        "2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "rms" in result.stdout
    env["GRADSTORE_PLUGINS"] = "no_such_module_here"
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0 and "GRADSTORE_PLUGINS names 'no_such_module_here'" in result.stderr


def test_misuse_is_refused_with_what_to_do(custom_method):
    with pytest.raises(gradstore.InvalidArgumentError, match="exists already"):
        gradstore.register_method("fisher", custom_method.RMSPreconditioner, summary="clash")
    with pytest.raises(gradstore.InvalidArgumentError, match="exists already"):
        gradstore.register_method("rms", custom_method.RMSPreconditioner, summary="another definition")
    with pytest.raises(gradstore.InvalidArgumentError, match="lacks"):
        gradstore.register_method("half", type("Half", (), {"name": "half"}), summary="no protocol")
    with pytest.raises(gradstore.InvalidArgumentError, match="lower-case"):
        gradstore.register_method("Bad Name", custom_method.RMSPreconditioner, summary="bad")
    same = gradstore.register_method("rms", custom_method.RMSPreconditioner, summary=custom_method.RMS.summary)
    assert same == custom_method.RMS  # the same definition again: a no-op
