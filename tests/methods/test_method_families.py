"""A method is an object (issue 37 item 1): every registry entry is an instance of one of the families, each
implements the calls its ``operations`` name, each family's operations called directly give the closed forms the
flag-era tests checked, and no module outside ``gradstore/methods`` branches on a method's name or family."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from quadratic import (
    INIT,
    RUN,
    T,
    capture_queries,
    columns,
    model_at,
    train_captured,
    true_effects,
)

import gradstore
from gradstore.core.engine import resolve_engine
from gradstore.methods import FAMILIES, METHODS, Method, ScoreOptions
from gradstore.methods.checkpoint_sum import CheckpointSum
from gradstore.methods.dvemb import Embeddings
from gradstore.methods.extension import register, register_method, scoped_registry
from gradstore.methods.preconditioned import Preconditioned
from gradstore.methods.replay import Replayed
from gradstore.methods.trajectory import Trajectory

#: The call each operation name dispatches to on the method object.
CALLS = {
    "attribute": "attribute",
    "score_matrix": "matrix",
    "self_influence": "self_influence",
    "select": "select",
    "build_index": "build_index",
}
#: The family of every built-in method, and what each used of the flag-era registry (``Method.uses``).
FLAG_ERA = {
    "grad-dot": (Preconditioned, {"checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "cosine": (Preconditioned, {"checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "diagonal": (Preconditioned, {"damping", "checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "fisher": (Preconditioned, {"damping", "blocks", "checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "kfac": (Preconditioned, {"damping", "checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "ekfac": (Preconditioned, {"damping", "checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "tracin": (CheckpointSum, {"checkpoints"}),
    "trackstar": (Preconditioned, {"damping", "blocks", "checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "tracin-steps": (Trajectory, {"checkpoint", "query_checkpoint"}),
    "source": (Trajectory, {"blocks", "checkpoints", "query_checkpoint"}),
    "source-ekfac": (Trajectory, {"checkpoints", "query_checkpoint"}),
    "dvemb": (Embeddings, {"blocks", "checkpoint", "kind", "rerank", "query_checkpoint", "device"}),
    "replay": (Replayed, set()),  # issue 38 item 5: reads the replay store.replay(...) kept
}


def test_every_registry_entry_is_a_family_object_implementing_its_operations():
    assert list(METHODS) == list(FLAG_ERA)
    for name, method in METHODS.items():
        family, uses = FLAG_ERA[name]
        assert isinstance(method, Method) and isinstance(method, FAMILIES) and type(method) is family, name
        assert method.uses == frozenset(uses), name
        assert method.reads_history == (family is not Preconditioned), name
        for operation in method.operations - {"token_scores"}:
            call = CALLS[operation]
            assert getattr(type(method), call) is not getattr(Method, call), (name, operation)


def test_an_operation_a_method_does_not_take_is_refused_by_the_object():
    with pytest.raises(gradstore.InvalidArgumentError, match="build_index does not take method='tracin'"):
        METHODS["tracin"].build_index(
            None, None, ScoreOptions(method="tracin"), run="r", name=None, refit=False, engine=resolve_engine("local")
        )


# ---------------------------------------------------------------------------------------------- closed forms
N_TRAIN, N_QUERY, DIM = 12, 3, 5


@pytest.fixture
def two_checkpoints(tmp_path):
    """Train and query rows at checkpoints ``c0`` (lr 0.1) and ``c1`` (lr 0.2), float32 rows."""
    rng = np.random.default_rng(1)
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    store.create_run("run", dim=DIM)
    rows = {}
    with store.writer("run") as writer:
        for step, (checkpoint, rate) in enumerate((("c0", 0.1), ("c1", 0.2))):
            store.record_checkpoint("run", checkpoint, step=step, learning_rate=rate)
            train = rng.standard_normal((N_TRAIN, DIM)).astype(np.float32)
            queries = rng.standard_normal((N_QUERY, DIM)).astype(np.float32)
            writer.append(train, [f"t{i:02d}" for i in range(N_TRAIN)], checkpoint=checkpoint, split="train")
            writer.append(queries, [f"q{i}" for i in range(N_QUERY)], checkpoint=checkpoint, split="query")
            rows[checkpoint] = (train.astype(np.float64), queries.astype(np.float64), rate)
    return store, rows


def _ids(n: int = N_QUERY) -> list[str]:
    return [f"q{i}" for i in range(n)]


def test_preconditioned_operations_equal_the_closed_forms(two_checkpoints):
    store, rows = two_checkpoints
    core, fits, engine = store.core, store.fits, resolve_engine("local")
    train, queries, _ = rows["c1"]  # the latest checkpoint: the default
    grad_dot, cosine = METHODS["grad-dot"], METHODS["cosine"]
    options = ScoreOptions(method="grad-dot")

    matrix = grad_dot.matrix(core, fits, _ids(), options, run="run")
    np.testing.assert_allclose(matrix.scores, queries @ train.T, rtol=1e-5, atol=1e-5)
    unit = train / np.linalg.norm(train, axis=1, keepdims=True)
    units = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    cosines = cosine.matrix(core, fits, _ids(), ScoreOptions(method="cosine"), run="run")
    np.testing.assert_allclose(cosines.scores, units @ unit.T, rtol=1e-5, atol=1e-5)

    top = grad_dot.attribute(core, fits, ["q0"], options, run="run", k=3, opponents=False, engine=engine)
    expected = np.argsort(-(queries[0] @ train.T))[:3]
    assert top.column("example_id").to_pylist() == [f"t{i:02d}" for i in expected]
    np.testing.assert_allclose(top.column("score").to_numpy(), (queries[0] @ train.T)[expected], rtol=1e-5)

    influence = grad_dot.self_influence(core, fits, options, run="run", engine=engine).to_pandas()
    by_id = influence.set_index("example_id").self_influence
    np.testing.assert_allclose(by_id[[f"t{i:02d}" for i in range(N_TRAIN)]], (train**2).sum(1), rtol=1e-5)

    # LESS: sum_c lr_c * max_q cos(g_c, q_c) over the checkpoints with a learning rate
    ids, scores = grad_dot.select(core, fits, _ids(), options, run="run", aggregate="max", engine=engine)
    want = sum(
        rate
        * ((q / np.linalg.norm(q, axis=1, keepdims=True)) @ (g / np.linalg.norm(g, axis=1, keepdims=True)).T).max(0)
        for g, q, rate in rows.values()
    )
    order = np.argsort(np.asarray(ids, dtype=str))
    np.testing.assert_allclose(np.asarray(scores)[order], want, rtol=1e-5)


def test_checkpoint_sum_equals_the_learning_rate_weighted_sum(two_checkpoints):
    store, rows = two_checkpoints
    table = METHODS["tracin"].attribute(
        store.core,
        store.fits,
        None,
        ScoreOptions(method="tracin"),
        run="run",
        k=N_TRAIN,
        opponents=False,
        engine=resolve_engine("local"),
    )
    want = sum(rate * queries @ train.T for train, queries, rate in rows.values())
    frame = table.to_pandas()
    for q in range(N_QUERY):
        got = frame[frame.query_id == f"q{q}"].set_index("example_id").score
        np.testing.assert_allclose(got[[f"t{i:02d}" for i in range(N_TRAIN)]], want[q], rtol=1e-6)
    assert set(frame.method) == {"tracin"}


@pytest.fixture
def trained(tmp_path):
    store = gradstore.open(tmp_path / "store", storage_dtype="float32")
    model = model_at(INIT)
    train_captured(store, range(T), model)
    capture_queries(store, model, "final", T)
    store.core.record_checkpoint(RUN, "final", step=T)
    return store


def test_trajectory_and_embeddings_families_equal_the_unrolled_effects(trained):
    store = trained
    truth, tracin = true_effects()
    steps = METHODS["tracin-steps"].matrix(
        store.core, store.fits, ["qa", "qb"], ScoreOptions(method="tracin-steps"), run=RUN
    )
    np.testing.assert_allclose(columns(steps), tracin, rtol=2e-4, atol=1e-6)
    embeddings = METHODS["dvemb"].matrix(store.core, store.fits, ["qa", "qb"], ScoreOptions(method="dvemb"), run=RUN)
    np.testing.assert_allclose(columns(embeddings), truth, rtol=2e-4, atol=1e-6)
    top = METHODS["dvemb"].attribute(
        store.core,
        store.fits,
        ["qa"],
        ScoreOptions(method="dvemb"),
        run=RUN,
        k=3,
        opponents=False,
        engine=resolve_engine("local"),
    )
    expected = np.argsort(-truth[0])[:3]
    assert top.column("example_id").to_pylist() == [str(i) for i in expected]
    assert set(top.column("method").to_pylist()) == {"dvemb"}


# ---------------------------------------------------------------------------------------------- extension
def test_register_method_registers_a_preconditioned_method_and_register_takes_a_family_object():
    from indexers import IdentityPreconditioner

    with scoped_registry():
        method = register_method("plain", IdentityPreconditioner, summary="q . g again", damped=False)
        assert isinstance(method, Preconditioned) and METHODS["plain"] is method
        steps = Trajectory(
            "steps-again",
            "identity",
            query_only=True,
            damped=False,
            trajectory="steps",
            summary="tracin-steps under another name",
        )
        assert register(steps) is steps and METHODS["steps-again"].uses == METHODS["tracin-steps"].uses
        with pytest.raises(gradstore.InvalidArgumentError, match="exists already"):
            register(CheckpointSum("tracin", "another tracin"))
    assert "plain" not in METHODS and "steps-again" not in METHODS


# ---------------------------------------------------------------------------------------------- no switches
NAMES = "|".join(re.escape(name) for name in [*FLAG_ERA, "influence"])
#: What a branch on a method's family or name looks like.
SWITCHES = [
    re.compile(r"(?<!gradstore\.methods)\.trajectory\b"),
    re.compile(r"\bover_checkpoints\b"),
    re.compile(r"""\bmethod\w*(\.name)?\s*(==|!=|\bin\b|\bnot in\b)\s*[(\[{]?\s*["'](""" + NAMES + r""")["']"""),
    re.compile(r"""["'](""" + NAMES + r""")["']\s*(==|!=)\s*\w*method"""),
    re.compile(
        r"""["'](embeddings|segments|steps)["']\s*(==|!=|\bin\b)|(==|!=)\s*["'](embeddings|segments|steps)["']"""
    ),
]


def test_no_module_outside_the_methods_package_switches_on_a_method():
    root = Path(gradstore.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(root / "methods"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(pattern.search(line) for pattern in SWITCHES):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_demo_and_the_read_only_server_see_the_flag_era_kinds():
    from gradstore.demo.run import TRAIN_CHECKPOINT, _where

    passes = ["epoch-1", "epoch-2"]
    for name, method in METHODS.items():
        if name in ("tracin", "source", "source-ekfac"):  # flag era: over_checkpoints or trajectory == "segments"
            expected = {"checkpoints": passes}
        elif name in ("tracin-steps", "dvemb"):  # trajectory in ("steps", "embeddings")
            expected = {"checkpoint": TRAIN_CHECKPOINT}
        elif name == "replay":  # the rows it replayed: no checkpoint argument
            expected = {}
        else:
            expected = {"checkpoint": "epoch-2"}
        assert _where(method, "epoch-2", passes) == expected, name
    message = METHODS["dvemb"].read_only_refusal("r", Exception("dvemb: build the derived run 'r.dvemb' of data"))
    assert message is not None and "gradstore attribute STORE --run r --method dvemb -k 1 --no-write" in message
    assert all(m.read_only_refusal("r", Exception("r.dvemb")) is None for n, m in METHODS.items() if n != "dvemb")
