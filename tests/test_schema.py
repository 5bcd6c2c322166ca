"""Schemathesis over the app's own OpenAPI schema: whatever a client sends, the server never answers 5xx,
and every documented answer has the shape the schema documents.

Bounded and repeatable: a fixed number of derandomized examples per operation, no example
database, and no network besides the in-process ASGI app (demo gateway included: turn streams
end by themselves). Most generated conversation ids would only ever meet a 404, so most cases
are pointed at one real conversation, which gets bodies, settings (tiny budgets that force
compression included) and turns thrown at it.
"""

from __future__ import annotations

import zlib

import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import response_schema_conformance

from chatserver.app import create_app
from chatserver.config import Settings

BASE_URL = "http://127.0.0.1"


@pytest.fixture
def api_schema(tmp_path):
    # No GATEWAY_BASE_URL: the built-in demo gateway answers every turn, and its streams end.
    app = create_app(Settings(_env_file=None, data_dir=tmp_path / "data", context_budget_tokens=4000,
                              keep_recent_messages=2))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"host": "127.0.0.1"})
    schema.config.generation.update(max_examples=20, deterministic=True, database="none", no_shrink=True)
    yield schema
    asgi.shutdown_lifespans()


# The live events answer never ends by design (a person's pages hold it open): it is tested in
# test_person_events.py, not fuzzed here. Adding an MCP server makes the server connect to the
# address given, and fuzzed addresses are not ours to reach: test_mcp.py tests that route.
schema = (schemathesis.pytest.from_fixture("api_schema").exclude(path="/api/events")
          .exclude(path="/api/tools/servers", method="POST"))


def a_conversation(case) -> str:
    """A conversation with an exchange in it, so Regenerate and Rewind have work; remade once deleted."""
    app = case.operation.app
    with asgi.get_client(app) as client:
        conv_id = getattr(app.state, "fuzzed_conversation", None)
        if conv_id and client.get(f"{BASE_URL}/api/conversations/{conv_id}").status_code == 200:
            return conv_id
        response = client.post(f"{BASE_URL}/api/conversations", json={})
        assert response.status_code == 201, response.text
        conv_id = app.state.fuzzed_conversation = response.json()["id"]
        client.post(f"{BASE_URL}/api/conversations/{conv_id}/messages", json={"content": "Hello there"})
        return conv_id


@schema.parametrize()
def test_no_input_makes_the_server_fail(case):
    params = case.path_parameters or {}
    # Two thirds of the cases (chosen from the generated id, so runs repeat) aim at a real one.
    if "conv_id" in params and zlib.crc32(str(params["conv_id"]).encode()) % 3:
        params["conv_id"] = a_conversation(case)
    case.call_and_validate(base_url=BASE_URL, checks=[not_a_server_error, response_schema_conformance])
