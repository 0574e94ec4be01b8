"""schemathesis against a live ``gradstore serve`` (its own ``/openapi.json``, a read token): generated requests,
valid and invalid (schemathesis's positive and negative modes), never get a 5xx, and every answer fits the schema
(status codes, content types, bodies); invalid bodies are rejected with a 4xx. The budget is small (a few dozen
cases per operation and mode) so that it runs with the other tests. (schemathesis's pytest plugin does not load
under pytest 9 here, so each operation's strategy is run by hypothesis directly.)"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from served_store import READ, make_store

from gradstore.serve import Tokens, serve

CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
    schemathesis.checks.negative_data_rejection,
]
EXAMPLES = 25


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    local = make_store(tmp_path_factory.mktemp("serve-schema") / "store")
    with serve(local.uri, tokens=Tokens.parse(READ), flight_port=None, http_port=0, refresh_s=0.0) as running:
        yield running


@pytest.fixture(scope="module")
def operations(live):
    schema = schemathesis.openapi.from_url(live.http_url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda mode: mode.value)
def test_no_5xx_and_no_schema_violation(live, operations, mode):
    assert {operation.path for operation in operations} >= {"/api/attribute", "/api/sql", "/api/runs"}
    for operation in operations:
        if mode == schemathesis.GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no parameters: nothing to make invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(base_url=live.http_url, headers={"Authorization": f"Bearer {READ}"}, timeout=120)
            case.validate_response(response, checks=CHECKS)

        check()
