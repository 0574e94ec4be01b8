"""gradstore serve --model module:factory: text queries (prompt, completion) turned into a query gradient on
the operator's model with the run's projection; the answer equals ``store.attribute(QueryBatch(...))`` called
locally; typed 4xx without --model and for over-long text; the page's text box in Debian Chromium."""

from __future__ import annotations

import importlib
import sys
import textwrap

import httpx
import numpy as np
import pytest
from served_store import READ

import gradstore
from gradstore.methods.queries import QueryBatch
from gradstore.serve import Limits, Tokens, serve

RUN = "text-run"
FACTORY = textwrap.dedent(
    '''
    """A tiny factory for the tests: (model, tokenizer, loss_fn)."""
    import torch
    from torch import nn


    def tokenizer(prompt, completion):
        codes = [ord(c) % 17 / 17.0 for c in (prompt + " " * 6)[:6]]
        return {"x": torch.tensor([codes]), "y": torch.tensor([len(completion) % 3])}


    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


    def factory():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), tokenizer, loss_fn
    '''
)
TRAIN = [(f"prompt number {i}", "x" * (i % 5)) for i in range(24)]


@pytest.fixture(scope="module")
def factory_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("factory")
    (folder / "textfactory.py").write_text(FACTORY)
    sys.path.insert(0, str(folder))
    yield importlib.import_module("textfactory")
    sys.path.remove(str(folder))
    sys.modules.pop("textfactory", None)


@pytest.fixture(scope="module")
def local(tmp_path_factory, factory_module):
    store = gradstore.open(tmp_path_factory.mktemp("serve-model") / "store", storage_dtype="float32")
    model, tokenizer, loss_fn = factory_module.factory()
    with store.capture(model, RUN, checkpoint="c0", k_in=3, k_out=3, curvature=True) as cap:
        for i, (prompt, completion) in enumerate(TRAIN):
            cap.set_ids([f"x{i}"])
            loss_fn(model, tokenizer(prompt, completion)).backward()
            model.zero_grad()
    return store


@pytest.fixture(scope="module")
def server(local):
    limits = Limits(max_prompt=200)
    with serve(
        local.uri,
        tokens=Tokens.parse(READ),
        flight_port=None,
        http_port=0,
        refresh_s=0.0,
        limits=limits,
        model="textfactory:factory",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, headers={"Authorization": f"Bearer {READ}"}, timeout=120) as client:
        yield client


@pytest.mark.parametrize("method", ["grad-dot", "fisher"])
def test_text_query_equals_the_local_query_batch(http, local, factory_module, method):
    prompt, completion = "prompt number 7", "xx"
    body = {"prompt": prompt, "completion": completion, "run": RUN, "k": 5, "method": method}
    answer = http.post("/api/attribute_text", json=body)
    assert answer.status_code == 200, answer.text
    model, tokenizer, loss_fn = factory_module.factory()
    query = QueryBatch(model, tokenizer(prompt, completion), ids=["text"], loss_fn=loss_fn)
    expected = local.attribute(query, run=RUN, k=5, method=method, write=False).to_pylist()
    rows = answer.json()["rows"]
    assert [r["example_id"] for r in rows] == [r["example_id"] for r in expected]
    assert np.allclose([r["score"] for r in rows], [r["score"] for r in expected], rtol=1e-5, atol=1e-6)
    assert answer.json()["version"] == local.core.dataset("gradients").version


def test_text_queries_refuse_bad_requests(http, server):
    too_long = http.post("/api/attribute_text", json={"prompt": "p" * 300, "completion": "", "run": RUN})
    assert too_long.status_code == 413 and too_long.json()["error"] == "RequestTooLargeError"
    unknown = http.post("/api/attribute_text", json={"prompt": "a", "run": "no-such-run"})
    assert unknown.status_code == 404
    path = http.post("/api/attribute_text", json={"prompt": "a", "run": RUN, "model": "os:system"})
    assert path.status_code == 422  # no request names a model
    with httpx.Client(base_url=server.http_url, timeout=60) as anonymous:
        assert anonymous.post("/api/attribute_text", json={"prompt": "a", "run": RUN}).status_code == 401


def test_without_model_the_endpoint_says_so(local):
    with serve(local.uri, tokens=Tokens.parse(READ), flight_port=None, http_port=0, refresh_s=0.0) as running:
        answer = httpx.post(
            running.http_url + "/api/attribute_text",
            json={"prompt": "a", "completion": "b", "run": RUN},
            headers={"Authorization": f"Bearer {READ}"},
            timeout=60,
        )
        assert answer.status_code == 404 and "--model" in answer.json()["message"]
        page = httpx.get(running.http_url + "/report", cookies={"gradstore_token": READ}, timeout=60).text
        assert 'id="text-query"' not in page


def test_the_text_box_in_the_browser(browser, server, local, factory_module):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.http_url + "/")
    page.fill("#token", READ)
    page.click("#sign-in")
    page.wait_for_selector("#text-query")
    page.fill("#text-prompt", "prompt number 3")
    page.fill("#text-completion", "xxx")
    page.select_option("#text-method", "grad-dot")
    page.fill("#text-k", "4")
    page.click("#text-submit")
    page.wait_for_selector(".text-proponent")
    shown = [item.split()[0] for item in page.locator(".text-proponent").all_inner_texts()]
    model, tokenizer, loss_fn = factory_module.factory()
    query = QueryBatch(model, tokenizer("prompt number 3", "xxx"), ids=["text"], loss_fn=loss_fn)
    expected = local.attribute(query, run=RUN, k=4, method="grad-dot", write=False)
    assert shown == expected.column("example_id").to_pylist()
    assert "version" in page.inner_text("#text-status")
    assert errors == []
    page.close()
