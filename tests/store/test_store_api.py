"""One store API local and remote: ``GradStore`` and ``RemoteStore`` implement ``gradstore.StoreAPI`` with the same
signatures (parameter names, kinds, defaults and annotations) for every call of the protocol, and a served store
takes its scoring options as ``options=`` as a local one does."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
from served_store import READ, RUN, make_store, same_table

import gradstore
from gradstore.errors import InvalidArgumentError
from gradstore.methods import ScoreOptions
from gradstore.serve import RemoteStore, Tokens, serve
from gradstore.store_api import STORE_API, StoreAPI


def _parameters(function) -> list[tuple[str, object, object, object]]:
    signature = inspect.signature(function)
    return [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values() if p.name != "self"]


def test_the_protocol_lists_its_calls():
    members = sorted(name for name, value in vars(StoreAPI).items() if inspect.isfunction(value) and name[0] != "_")
    assert tuple(members) == STORE_API


@pytest.mark.parametrize("call", STORE_API)
def test_local_and_remote_stores_have_the_protocols_signatures(call):
    declared = _parameters(getattr(StoreAPI, call))
    assert _parameters(getattr(gradstore.GradStore, call)) == declared, f"GradStore.{call} differs from StoreAPI"
    assert _parameters(getattr(RemoteStore, call)) == declared, f"RemoteStore.{call} differs from StoreAPI"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    local = make_store(tmp_path_factory.mktemp("api") / "store")
    tokens = Tokens.parse(READ)
    with serve(local.uri, tokens=tokens, flight_port=0, http_port=None, refresh_s=0.0) as running:
        remote = gradstore.connect(running.flight_uri, token=READ)
        yield local, remote
        remote.close()


def test_both_stores_are_store_apis_and_take_options(served):
    local, remote = served
    assert isinstance(local, StoreAPI) and isinstance(remote, StoreAPI)
    options = ScoreOptions(method="fisher", damping=0.3, where="example_id < 't-040'")
    columns = ["query_id", "example_id", "score", "rank", "method"]
    expected = local.attribute(run=RUN, k=4, write=False, options=options).select(columns)
    same_table(remote.attribute(run=RUN, k=4, options=options).select(columns), expected)
    keywords = remote.attribute(run=RUN, k=4, method="fisher", damping=0.3, where="example_id < 't-040'")
    same_table(keywords.select(columns), expected)
    chosen = ScoreOptions(method="fisher", checkpoints=["final"])
    same_table(remote.select(run=RUN, budget=5, options=chosen), local.select(run=RUN, budget=5, options=chosen))
    vectors = np.ones((1, 16), np.float32)
    remote.self_influence(run=RUN, options=ScoreOptions(method="grad-dot"))
    remote.attribute(vectors, run=RUN, k=2, options=ScoreOptions(method="grad-dot"))


def test_a_served_store_refuses_what_is_the_servers_choice_or_contradicts_the_options(served):
    _, remote = served
    with pytest.raises(InvalidArgumentError, match="engine= is the server's"):
        remote.attribute(run=RUN, engine="ray")
    with pytest.raises(InvalidArgumentError, match="device= is the server's"):
        remote.attribute(run=RUN, device="cpu")
    with pytest.raises(InvalidArgumentError, match=r"damping=0\.5.*options\.damping=0\.3"):
        remote.attribute(run=RUN, damping=0.5, options=ScoreOptions(damping=0.3))


@pytest.mark.parametrize("call", ["attribute", "self_influence", "select"])
def test_the_servers_calls_and_http_bodies_follow_the_protocol(call):
    from gradstore.serve import http
    from gradstore.serve.service import ARGUMENT_TYPES, CALLS, SERVER_CHOSEN

    parameters = inspect.signature(getattr(StoreAPI, call)).parameters
    assert CALLS[call] == set(parameters) - SERVER_CHOSEN - {"self"}
    assert CALLS[call] <= set(ARGUMENT_TYPES)
    model = {"attribute": http.AttributeRequest, "self_influence": http.SelfInfluenceRequest}.get(
        call, http.SelectRequest
    )
    fields = model.model_fields
    assert set(fields) - {"vectors"} == CALLS[call]
    for name, field in fields.items():
        if name in ("vectors", "run"):
            continue
        expected = False if name == "write" else parameters[name].default  # a server writes only when asked
        assert field.default == expected, (call, name)


def test_no_module_of_the_package_is_imported_out_of_the_linters_sight():
    root = Path(__file__).resolve().parents[2]
    hidden = [
        str(path.relative_to(root))
        for package in ("gradstore", "ingest", "indexers")
        for path in (root / package).rglob("*.py")
        if re.search(r"import_module\(\s*[\"'](gradstore|ingest|indexers)\b", path.read_text(encoding="utf-8"))
    ]
    assert not hidden, f"imports hidden from import-linter (write a plain import statement): {hidden}"
