"""Scoring options declared once (``gradstore.methods.ScoreOptions``) and passed in the open: every scoring call
takes ``options=`` or its keywords (same answers), a keyword that contradicts the options is refused with what to
do, and the facade's keywords and the CLI's options have the declaration's names, defaults and help."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch
import typer.main
from tiny_models import tiny_mlp
from torch import nn

import gradstore
from gradstore import cli
from gradstore.errors import InvalidArgumentError
from gradstore.methods import OPTION_HELP, ScoreOptions
from ingest import CaptureConfig

RUN, DIM = "r", 8
FIELDS = {f.name: f.default for f in dataclasses.fields(ScoreOptions)}
SCORING_CALLS = ("attribute", "score_matrix", "self_influence", "select", "build_index", "token_scores")
SPELLED = {"select": {"preconditioner": "method"}}  # a call's keyword -> its field


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    rng = np.random.default_rng(0)
    store = gradstore.open(tmp_path_factory.mktemp("options") / "store")
    store.create_run(RUN, dim=DIM)
    store.record_checkpoint(RUN, "c0", step=1, learning_rate=0.1)
    with store.writer(RUN) as writer:
        writer.append(
            rng.standard_normal((40, DIM), dtype=np.float32),
            [f"t{i}" for i in range(40)],
            checkpoint="c0",
            split="train",
        )
        writer.append(
            rng.standard_normal((3, DIM), dtype=np.float32), ["q0", "q1", "q2"], checkpoint="c0", split="query"
        )
    return store


def _option_parameters(call: str) -> dict[str, inspect.Parameter]:
    """The parameters of ``GradStore.<call>`` that are ScoreOptions fields, by field name."""
    parameters = inspect.signature(getattr(gradstore.GradStore, call)).parameters
    spelled = SPELLED.get(call, {})
    return {spelled.get(name, name): p for name, p in parameters.items() if spelled.get(name, name) in FIELDS}


@pytest.mark.parametrize("call", SCORING_CALLS)
def test_every_scoring_call_takes_options_and_its_keywords_have_the_declared_defaults(call):
    parameters = inspect.signature(getattr(gradstore.GradStore, call)).parameters
    assert parameters["options"].default is None and parameters["options"].kind is inspect.Parameter.KEYWORD_ONLY
    options = _option_parameters(call)
    assert "method" in options
    for name, parameter in options.items():
        expected = "grad-dot" if (call, name) == ("select", "method") else FIELDS[name]
        assert parameter.default == expected, (call, name)


def test_no_call_packs_its_locals():
    root = Path(__file__).parents[2]
    for path in (
        root / "gradstore/store.py",
        root / "gradstore/serve/client.py",
        *(root / "gradstore/cli").glob("*.py"),
    ):
        assert "locals()" not in path.read_text(), path
    assert not hasattr(ScoreOptions, "pick")


def test_options_give_the_answers_of_the_keywords(filled):
    keywords = dict(method="fisher", damping=0.3, blocks="full", where="example_id < 't3'")
    options = ScoreOptions(**keywords)
    columns = ["query_id", "example_id", "score", "rank", "method"]
    by_keywords = filled.attribute(run=RUN, k=4, write=False, **keywords).select(columns)
    assert filled.attribute(run=RUN, k=4, write=False, options=options).select(columns).equals(by_keywords)
    matrix = filled.score_matrix(run=RUN, options=options)
    np.testing.assert_allclose(matrix.scores, filled.score_matrix(run=RUN, **keywords).scores)
    assert filled.self_influence(run=RUN, write=False, options=options).equals(
        filled.self_influence(run=RUN, write=False, **keywords)
    )
    chosen = ScoreOptions(method="fisher", damping=0.3)
    assert filled.select(run=RUN, budget=5, options=chosen).equals(
        filled.select(run=RUN, budget=5, preconditioner="fisher", damping=0.3)
    )
    index = filled.build_index(RUN, name="by-options", options=ScoreOptions(method="grad-dot"))
    assert index.method.name == "grad-dot"
    # a keyword equal to the options' value, or left at its default, is no conflict
    filled.attribute(run=RUN, k=2, write=False, method="fisher", options=options)
    filled.attribute(run=RUN, k=2, write=False, checkpoints=None, options=options)


def test_a_keyword_that_contradicts_the_options_says_what_to_do(filled):
    options = ScoreOptions(method="fisher", damping=0.3)
    with pytest.raises(InvalidArgumentError, match=r"damping=0\.5.*options\.damping=0\.3.*dataclasses\.replace"):
        filled.attribute(run=RUN, write=False, damping=0.5, options=options)
    with pytest.raises(InvalidArgumentError, match=r"preconditioner='kfac'.*options\.method='fisher'"):
        filled.select(run=RUN, preconditioner="kfac", options=options)
    with pytest.raises(InvalidArgumentError, match=r"self_influence does not take kind="):
        filled.self_influence(run=RUN, write=False, options=ScoreOptions(kind="HNSW32,Flat"))
    with pytest.raises(InvalidArgumentError, match=r"options=ScoreOptions"):
        filled.attribute(run=RUN, write=False, options={"method": "fisher"})
    with pytest.raises(InvalidArgumentError, match="checkpoints takes a list"):
        ScoreOptions(checkpoints="c0")
    assert ScoreOptions(checkpoints=["c0"]).checkpoints == ("c0",)


def _cli_parameters(command: str) -> dict:
    click_command = typer.main.get_command(cli.app).commands[command]
    return {param.name: param for param in click_command.params}


@pytest.mark.parametrize("command", sorted(cli.SCORING_COMMANDS))
def test_the_cli_offers_each_scoring_option_with_the_declared_default_and_help(command):
    call = cli.SCORING_COMMANDS[command]
    parameters = _cli_parameters(command)
    spelled = {field: name for name, field in SPELLED.get(call, {}).items()}
    for field, facade in _option_parameters(call).items():
        if (call, field) in cli.NOT_ON_THE_COMMAND_LINE:
            continue
        name = spelled.get(field, field)
        assert name in parameters, f"gradstore {command} lacks --{name.replace('_', '-')} ({call} takes {field}=)"
        default = getattr(parameters[name].default, "value", parameters[name].default)
        assert default == facade.default, (command, name)
        if name == field:
            assert parameters[name].help.startswith(OPTION_HELP[field]), (command, name)
    for call_name, field in cli.NOT_ON_THE_COMMAND_LINE:  # each exception names an option its call has
        assert field in _option_parameters(call_name)


def _train(store, run: str, **capture):
    model = tiny_mlp()
    x, y = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3
    with store.capture(model, run, **capture) as session:
        session.set_ids([f"x{i}" for i in range(16)])
        nn.functional.cross_entropy(model(x), y).backward()
    return store.read_gradients(run)


def test_capture_takes_a_built_config_or_its_keywords(store):
    keywords = dict(projection="factorized", k_in=3, k_out=2, seed=7, checkpoint="c1", curvature=True)
    by_keywords = _train(store, "by-keywords", **keywords)
    config = CaptureConfig.from_options(**keywords)
    by_config = _train(store, "by-config", config=config)
    np.testing.assert_array_equal(np.asarray(by_config.vectors), np.asarray(by_keywords.vectors))
    assert store.core.run_config("by-config")["capture"]["k_out"] == 2
    _train(store, "by-config", config=config, k_in=3, curvature=True)  # keywords that agree with it are no conflict
    with pytest.raises(InvalidArgumentError, match=r"config= and k_in=5, which differs from the config's 3"):
        _train(store, "by-config", config=config, k_in=5)
    with pytest.raises(InvalidArgumentError, match=r"config=ingest\.CaptureConfig"):
        _train(store, "other", config={"k_in": 3})


def test_evaluations_take_score_options_as_a_methods_options():
    from gradstore.answers.evaluate.evaluations import check_methods

    chosen = check_methods({"f": ScoreOptions(method="fisher", damping=0.2), "g": {"method": "grad-dot"}})
    assert chosen == {"f": {"method": "fisher", "damping": 0.2}, "g": {"method": "grad-dot"}}
