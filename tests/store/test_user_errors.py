"""Nothing but a ``GradstoreError`` escapes the public surface, and a refused call leaves the store as it was.

Property-based (hypothesis): generated arguments, good and bad, over ``open``, ``capture``, ``attribute``,
``select``, ``self_influence``, ``build_index``, ``sql``, ``report``, ``verify`` and the CLI. A call either
succeeds or raises a ``GradstoreError``; when it raises, every table of the store is at the version it had.
Beside them, the cases the "stranger's hands" issue reproduced, each with the error it must now give.
"""

from __future__ import annotations

import contextlib
import re
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_mlp
from torch import nn
from typer.testing import CliRunner

import gradstore
from gradstore.cli import app
from gradstore.methods import ALIASES, METHODS

N_TRAIN, N_QUERY, RUN = 24, 3, "run"
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True
)


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _train(store: gradstore.GradStore, model: nn.Module, run: str = RUN) -> None:
    """Training rows at checkpoint ``c0`` (with curvature) and query rows captured on the final model."""
    x, y = _data(1, N_TRAIN)
    with store.capture(model, run, checkpoint="c0", learning_rate=0.1, curvature=True, k_in=3, k_out=3) as cap:
        for start in range(0, N_TRAIN, 8):
            cap.set_ids([f"x{i}" for i in range(start, start + 8)])
            nn.functional.cross_entropy(model(x[start : start + 8]), y[start : start + 8]).backward()
            model.zero_grad()
    xq, yq = _data(2, N_QUERY)
    with store.capture(model, run, split="query", checkpoint="final") as cap:
        cap.set_ids([f"q{i}" for i in range(N_QUERY)])
        nn.functional.cross_entropy(model(xq), yq).backward()
        model.zero_grad()


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> gradstore.GradStore:
    store = gradstore.open(tmp_path_factory.mktemp("user-errors") / "store")
    _train(store, tiny_mlp())
    store.add_examples([{"example_id": f"x{i}", "text": f"example {i}"} for i in range(N_TRAIN)])
    return store


def _versions(store: gradstore.GradStore) -> dict[str, int]:
    return {name: store.core.dataset(name).version for name in store.core.tables.table_names()}


def _check(store: gradstore.GradStore, call) -> None:
    """``call()`` succeeds, or raises a GradstoreError and leaves every table at its version."""
    before = _versions(store)
    try:
        call()
    except gradstore.GradstoreError:
        assert _versions(store) == before
    except Exception as error:  # the property's failure: show what escaped
        raise AssertionError(f"{type(error).__name__} escaped the public surface: {error}") from error


# ---------------------------------------------------------------------------------------------- strategies
names = st.sampled_from([*METHODS, *ALIASES]) | st.text(max_size=8)
checkpoint_names = st.none() | st.sampled_from(["c0", "final", "nope", "", "../x"]) | st.text(max_size=6)
numbers = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3) | st.text(max_size=3)
filters = (
    st.none()
    | st.text(max_size=16)
    | st.sampled_from(
        ["", "step >= 0", "nosuch = 1", "example_id ==== 'x'", "1", "example_id = 'x1'", "1=1) OR (1=1", "a; drop"]
    )
)
query_forms = (
    st.none()
    | st.text(max_size=12)
    | st.lists(st.sampled_from(["q0", "q1", "x0", "nope", ""]), max_size=3)
    | st.integers(1, 3).map(lambda n: np.ones((n, 5), np.float32))
    | st.sampled_from([np.full((1, 72), np.nan, np.float32), np.ones((2, 3, 4), np.float32)])
    | st.sampled_from([5, 2.5, b"q0", np.array(["q0"]), [[0.5, 1.0]]])
)
kinds = st.sampled_from(["exact", "auto", "Flat", "IVF4,Flat", "HNSW8,Flat", "Bogus", "", "IVF999,Flat"])
common = {
    "checkpoint": checkpoint_names,
    "damping": numbers,
    "blocks": st.sampled_from(["auto", "layer", "full", "bogus"]),
    "split": st.sampled_from(["train", "query", "", "other"]),
    "where": filters,
}


@SETTINGS
@given(
    st.fixed_dictionaries(
        {"method": names},
        optional={
            **common,
            "k": st.integers(-2, 40) | st.floats(allow_nan=True) | st.text(max_size=2) | st.booleans(),
            "queries": query_forms,
            "query_checkpoint": checkpoint_names,
            "checkpoints": st.none() | st.lists(st.sampled_from(["c0", "final", "x"]), max_size=3),
            "kind": kinds,
            "opponents": st.booleans(),
            "rerank": st.integers(-2, 3) | st.floats(allow_nan=True),
            "engine": st.sampled_from(["local", "nowhere"]),
            "eigen_correction": st.booleans(),
            "run": st.sampled_from([RUN, "missing", ""]),
        },
    )
)
def test_attribute_raises_only_gradstore_errors(filled, arguments):
    arguments = {"run": RUN, "write": False, **arguments}
    queries = arguments.pop("queries", None)
    _check(filled, lambda: filled.attribute(queries, **arguments))


@SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            **common,
            "preconditioner": names,
            "budget": numbers,
            "aggregate": st.sampled_from(["max", "mean", "median"]),
            "checkpoints": st.none() | st.lists(st.sampled_from(["c0", "final", "x"]), max_size=3),
            "target": query_forms,
        },
    ).filter(lambda a: "checkpoint" not in a)  # select sums over checkpoints=, it has no checkpoint=
)
def test_select_raises_only_gradstore_errors(filled, arguments):
    target = arguments.pop("target", None)
    _check(filled, lambda: filled.select(target, run=RUN, **arguments))


@SETTINGS
@given(st.fixed_dictionaries({"method": names}, optional=common))
def test_self_influence_raises_only_gradstore_errors(filled, arguments):
    _check(filled, lambda: filled.self_influence(run=RUN, write=False, **arguments))


@SETTINGS
@given(
    st.fixed_dictionaries(
        {"method": names},
        optional={
            **common,
            "kind": kinds,
            "name": st.none() | st.sampled_from(["ok-name", "../escape", "/abs", "", "a/b"]) | st.text(max_size=8),
            "refit": st.booleans(),
        },
    )
)
def test_build_index_raises_only_gradstore_errors(filled, arguments):
    _check(filled, lambda: filled.build_index(RUN, **arguments))


@SETTINGS
@given(
    st.sampled_from(
        [
            "select count(*) from gradients",
            "drop table runs",
            "delete from examples",
            "select * from nowhere",
            "select 1; select 2",
            "copy runs to '/tmp/x.csv'",
            "attach '/tmp/other.core.db'",
            "select * from read_csv('/etc/passwd')",
            "",
        ]
    )
    | st.text(max_size=30)
)
def test_sql_raises_only_gradstore_errors(filled, query):
    _check(filled, lambda: filled.sql(query).fetchall())


@SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "run": st.none() | st.sampled_from([RUN, "missing"]),
            "max_queries": st.integers(-2, 5) | st.text(max_size=2),
            "top": st.integers(-2, 5) | st.floats(allow_nan=True),
        },
    ),
    st.sampled_from(["report.html", "missing-dir/report.html", "."]),
)
def test_report_raises_only_gradstore_errors(filled, tmp_path_factory, arguments, out):
    target = tmp_path_factory.mktemp("report") / out
    _check(filled, lambda: filled.report(target, **arguments))


def test_verify_answers(filled):
    report = filled.verify()
    assert report.ok, report.problems


@SETTINGS
@given(
    st.text(alphabet=string.ascii_letters + string.digits + "._- ", min_size=1, max_size=12).filter(
        lambda name: name.strip(" ") not in ("", ".", "..")
    ),
    st.booleans(),
    st.none() | st.sampled_from(["float16", "bfloat16", "float32", "float64", "int8", ""]) | st.text(max_size=5),
)
def test_open_raises_only_gradstore_errors(tmp_path_factory, name, create, storage_dtype):
    root = tmp_path_factory.mktemp("open")
    (root / "a-file").write_text("not a store")
    for path in (root / name, root / "a-file", root / "a-file" / name):
        with contextlib.suppress(gradstore.GradstoreError):
            gradstore.open(path, create=create, storage_dtype=storage_dtype)


class _NoLayers(nn.Module):
    def forward(self, x):
        return x * 2


@SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "run": st.sampled_from(["new-run", RUN, "", "../up", "a/b"]),
            "split": st.sampled_from(["train", "query", "", 3]),
            "checkpoint": st.sampled_from(["c1", "", None]),
            "k_in": st.integers(-1, 4) | st.text(max_size=2),
            "k_out": st.integers(-1, 4),
            "projection": st.sampled_from(["factorized", "dense", None, "bogus"]),
            "normalizer": st.sampled_from([None, "adam_factored", "bogus"]),
            "loss_reduction": st.sampled_from(["mean", "sum", "token_mean", "median"]),
            "learning_rate": numbers,
            "bogus_option": st.booleans(),
        },
    ),
    st.sampled_from(["mlp", "no-layers"]),
    st.sampled_from([8, 7, 0]),  # ids given for the batch of 8 rows: right, too few, none set
)
def test_capture_raises_only_gradstore_errors(tmp_path_factory, arguments, model_kind, ids):
    store = gradstore.open(tmp_path_factory.mktemp("capture") / "store")
    _train(store, tiny_mlp())
    model = tiny_mlp() if model_kind == "mlp" else _NoLayers()
    x, y = _data(3, 8)

    def run() -> None:
        with store.capture(model, arguments.pop("run", RUN), **arguments) as cap:
            if ids:
                cap.set_ids([f"n{i}" for i in range(ids)])
            out = model(x)
            loss = nn.functional.cross_entropy(out, y) if out.shape[-1] == 3 else out.sum()
            loss.backward()

    before = _versions(store)
    try:
        run()
    except gradstore.GradstoreError:
        after = _versions(store)
        assert {name: after.get(name) for name in before} == before
    except Exception as error:
        raise AssertionError(f"{type(error).__name__} escaped capture: {error}") from error


cli_values = st.sampled_from(["run", "missing", "", "0", "-1", "nan", "fisher", "bogus", "c0", "../x", "q0,q1"])
cli_options = st.sampled_from(
    [
        "--run",
        "--method",
        "--damping",
        "--kind",
        "--k",
        "--checkpoint",
        "--query-checkpoint",
        "--where",
        "--queries",
        "--blocks",
        "--rerank",
        "--budget",
        "--checkpoints",
    ]
)


@SETTINGS
@given(
    st.sampled_from(["attribute", "select", "self-influence", "build-index", "sql", "info", "verify", "report"]),
    st.lists(st.tuples(cli_options, cli_values), max_size=4),
    st.sampled_from(["store", "missing-store", "a-file"]),
)
def test_cli_prints_one_line_never_a_traceback(filled, tmp_path_factory, command, options, where):
    root = tmp_path_factory.mktemp("cli")
    (root / "a-file").write_text("not a store")
    location = filled.core.location if where == "store" else str(root / where)
    arguments = [command, location, *[part for pair in options for part in pair]]
    if command in ("attribute", "self-influence"):
        arguments.append("--no-write")
    if command == "report":
        arguments += ["--out", str(root / "report.html")]
    if command == "sql":
        arguments.insert(2, "select count(*) from runs")
    before = _versions(filled)
    result = CliRunner().invoke(app, arguments)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 1:  # the command's own error: one line
        assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1, result.output
        assert _versions(filled) == before


# ---------------------------------------------------------------------------------------------- the cases
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"method": "fisher", "checkpoints": ["does-not-exist"]}, "does not use checkpoints="),
        ({"method": "grad-dot", "damping": 0.5}, "does not use damping="),
        ({"method": "fisher", "rerank": 4}, "kind='exact' is exact already"),
        ({"method": "fisher", "kind": "HNSW8,Flat", "rerank": -1}, "rerank must be"),
        ({"method": "fisher", "damping": -1.0}, "damping must be"),
        ({"method": "fisher", "damping": float("nan")}, "damping must be"),
        ({"method": "tracin", "kind": "HNSW8,Flat"}, "does not use kind="),
        ({"method": "cosine", "blocks": "full"}, "does not use blocks="),
        ({"method": "fisher", "where": "nosuch = 1"}, "cannot be used on the gradients table"),
        ({"method": "fisher", "where": ""}, "empty filter"),
        ({"method": "fisher", "eigen_correction": True}, "method='ekfac'"),
        ({"method": "fisher", "dampng": 0.1}, "did you mean damping="),
        ({"method": "fisher", "checkpoint": "final"}, "holds them at \\['c0'\\]"),
    ],
)
def test_arguments_a_method_does_not_use_are_refused(filled, arguments, message):
    with pytest.raises(gradstore.InvalidArgumentError, match=message):
        filled.attribute(run=RUN, write=False, **arguments)


FLAG_CALLS = {
    "attribute": lambda store, flags: store.attribute(run=RUN, method="grad-dot", **{"write": False, **flags}),
    "self_influence": lambda store, flags: store.self_influence(run=RUN, method="grad-dot", **flags),
    "build_index": lambda store, flags: store.build_index(RUN, method="grad-dot", **flags),
    "capture": lambda store, flags: store.capture(tiny_mlp(), RUN, **flags),
    "create_run": lambda store, flags: store.create_run("another", dim=4, **flags),
    "token_scores": lambda store, flags: store.token_scores(None, None, run=RUN, **flags),
    "replay": lambda store, flags: store.replay(
        ["q0"], run=RUN, model_fn=tiny_mlp, batch_fn=list, loss_fn=len, optimizer="sgd", **flags
    ),
    "open": lambda store, flags: gradstore.open(store.core.location, **flags),
}


def _flags_of_the_api() -> list[tuple[str, str]]:
    """Every (call, parameter) of the store's API and ``gradstore.open`` annotated ``bool`` or ``bool | None``."""
    import inspect

    from gradstore.store import API, GradStore

    calls = {name: getattr(GradStore, name) for name in API if callable(getattr(GradStore, name))}
    calls["open"] = gradstore.open
    return [
        (name, parameter.name)
        for name, call in calls.items()
        for parameter in inspect.signature(call).parameters.values()
        if str(parameter.annotation) in ("bool", "bool | None")
    ]


@pytest.mark.parametrize(("call", "flag"), _flags_of_the_api())
@pytest.mark.parametrize("value", ["no", "yes", 0, 1, 1.0])
def test_every_flag_of_the_api_takes_only_true_or_false(filled, call, flag, value):
    """A flag given anything but ``True``/``False`` (``opponents="no"``, ``write="yes"``, ``refit=1``) is refused
    naming it, before anything is written (not taken as a truth value)."""
    before = _versions(filled)
    with pytest.raises(gradstore.InvalidArgumentError, match=rf"{flag}= takes True(, False or None| or False)"):
        FLAG_CALLS[call](filled, {flag: value})
    assert _versions(filled) == before


def test_a_numpy_bool_is_a_flag_value_too(filled):
    with_numpy = FLAG_CALLS["attribute"](filled, {"opponents": np.True_})
    assert with_numpy.equals(FLAG_CALLS["attribute"](filled, {"opponents": True}))


def test_numpy_numbers_are_the_numbers_they_hold(filled):
    """``k=np.int64(3)``, ``damping=np.float32(0.5)`` (numbers taken from arrays) answer as the Python numbers do,
    not refused as "not a whole number" / "not a finite number"."""
    common = {"run": RUN, "method": "fisher", "write": False}
    plain = filled.attribute(k=3, damping=0.5, **common)
    for k, damping in ((np.int64(3), np.float32(0.5)), (np.int32(3), np.float64(0.5)), (3, np.float16(0.5))):
        got = filled.attribute(k=k, damping=damping, **common)
        assert got.column("example_id").equals(plain.column("example_id"))
        np.testing.assert_allclose(got.column("score").to_numpy(), plain.column("score").to_numpy(), rtol=1e-6)
    with pytest.raises(gradstore.InvalidArgumentError, match="k must be a whole number >= 1, got 0"):
        filled.attribute(k=np.int64(0), **common)
    with pytest.raises(gradstore.InvalidArgumentError, match="damping must be a number in"):
        filled.attribute(damping=np.float32("nan"), **common)


@pytest.mark.parametrize(
    ("call", "queries", "shown"),
    [
        ("attribute", 5, "int 5"),
        ("attribute", 2.5, "float 2.5"),
        ("score_matrix", b"q0", "bytes b'q0'"),
        ("attribute", np.array(["q0"]), "an array of <U2"),
        ("score_matrix", [[0.5, 1.0]], "a list holding list"),
        ("select", 7, "int 7"),
    ],
)
def test_queries_of_another_form_are_refused_naming_the_forms(filled, call, queries, shown):
    name = "target" if call == "select" else "queries"
    with pytest.raises(gradstore.InvalidArgumentError, match=rf"{name}= takes None .*; got {re.escape(shown)}"):
        getattr(filled, call)(queries, run=RUN)
    for ids in (["q0"], ("q0",), iter(["q0"])):  # any iterable of ids
        assert filled.score_matrix(ids, run=RUN, method="grad-dot").query_ids == ["q0"]


def test_an_empty_query_filter_selects_nothing_instead_of_every_row(filled):
    with pytest.raises(gradstore.InvalidFilterError, match="empty filter"):
        filled.attribute("", run=RUN, write=False, method="grad-dot")


def test_queries_captured_on_the_final_model_are_attributed_against_training_rows(filled):
    """The README's flow: rows captured during training (checkpoint c0), queries at "final"."""
    default = filled.attribute(run=RUN, k=4, write=False, method="grad-dot")
    explicit = filled.attribute(run=RUN, k=4, write=False, checkpoint="c0", query_checkpoint="final", method="grad-dot")
    assert default.equals(explicit)
    assert sorted(set(default.column("query_id").to_pylist())) == [f"q{i}" for i in range(N_QUERY)]
    assert set(default.column("checkpoint").to_pylist()) == {"c0"}
    with pytest.raises(gradstore.InvalidArgumentError, match="query_checkpoint"):
        filled.attribute(
            np.ones((1, filled.run(RUN)["dim"]), np.float32), run=RUN, query_checkpoint="final", method="grad-dot"
        )
    with pytest.raises(gradstore.InvalidArgumentError, match="query rows exist at checkpoints \\['final'\\]"):
        filled.attribute(run=RUN, write=False, query_checkpoint="c0", method="grad-dot")


def test_query_rows_at_several_checkpoints_need_query_checkpoint(tmp_path: Path):
    store = gradstore.open(tmp_path / "store")
    model = tiny_mlp()
    _train(store, model)
    xq, yq = _data(4, 2)
    with store.capture(model, RUN, split="query", checkpoint="later") as cap:
        cap.set_ids(["p0", "p1"])
        nn.functional.cross_entropy(model(xq), yq).backward()
    with pytest.raises(gradstore.InvalidArgumentError, match="pass query_checkpoint"):
        store.attribute(run=RUN, write=False, method="grad-dot")
    table = store.attribute(run=RUN, k=2, write=False, query_checkpoint="later", method="grad-dot")
    assert sorted(set(table.column("query_id").to_pylist())) == ["p0", "p1"]


def test_the_cli_reports_a_refused_argument_in_one_line(filled):
    result = CliRunner().invoke(
        app, ["attribute", filled.core.location, "--run", RUN, "--method", "grad-dot", "--damping", "0.5", "--no-write"]
    )
    assert result.exit_code == 1
    assert result.output.strip().startswith("error: attribute(method='grad-dot') does not use damping=")


@pytest.mark.parametrize("name", ["methods", "options"])
def test_the_docs_tables_are_the_registry(name):
    from gradstore import methods

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    start = text.index(f"<!-- {name}-table")
    table = text[text.index("\n", start) + 1 : text.index(f"<!-- /{name}-table -->")].strip()
    assert table == getattr(methods, f"{name}_table")()


def test_select_names_its_method_by_its_own_keyword(filled):
    """select takes its method as ``preconditioner=``: its refusals say so (not ``method=``, which it has not)."""
    with pytest.raises(
        gradstore.InvalidArgumentError, match=r"select\(preconditioner='grad-dot'\) does not use damping="
    ):
        filled.select(["q0"], run=RUN, preconditioner="grad-dot", damping=0.1)
    with pytest.raises(gradstore.InvalidArgumentError, match="select does not take preconditioner='tracin'"):
        filled.select(["q0"], run=RUN, preconditioner="tracin")


def test_the_cli_method_choices_are_the_registry():
    """The registry's methods of each call, then the aliases of those (``influence`` for ``fisher``...)."""
    from gradstore.cli import AttributeMethod, BuildIndexMethod, SelectSpace, SelfInfluenceMethod
    from gradstore.methods import ALIASES, method_names

    def expected(call: str) -> list[str]:
        names = method_names(call)
        return [*names, *(alias for alias, method in ALIASES.items() if method in names)]

    assert [m.value for m in AttributeMethod] == expected("attribute")
    assert [m.value for m in BuildIndexMethod] == expected("build_index")
    assert [m.value for m in SelfInfluenceMethod] == expected("self_influence")
    assert [m.value for m in SelectSpace] == expected("select")


def test_rows_written_without_a_split_are_named_as_such(tmp_path):
    """Rows a writer stored without ``split=`` are not training rows: attributing says so and how to label them,
    not "capture them first"; rows of another split are named with the split= that scores them."""
    store = gradstore.open(tmp_path / "s")
    store.create_run("r", dim=8)
    rows = np.random.default_rng(0).normal(size=(6, 8)).astype(np.float32)
    with store.writer("r") as writer:
        writer.append(rows, [f"e{i}" for i in range(6)])
    with pytest.raises(gradstore.InvalidArgumentError, match="written without a split.*split='train'"):
        store.attribute(rows[:1], run="r", method="grad-dot", write=False)
    store.create_run("v", dim=8)
    with store.writer("v") as writer:
        writer.append(rows, [f"e{i}" for i in range(6)], split="val")
    with pytest.raises(gradstore.InvalidArgumentError, match=r"splits \['val'\].*pass split="):
        store.attribute(rows[:1], run="v", method="grad-dot", write=False)
    assert store.attribute(rows[:1], run="v", method="grad-dot", split="val", k=2, write=False).num_rows == 2
