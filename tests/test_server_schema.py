"""The server's ``/openapi.json`` says what it does: Schemathesis runs over every endpoint of it
in process (ASGI), with the key, on the tiny model, and finds no 5xx, no crash and no response
the schema does not describe.

The run is Schemathesis's engine, as its command line runs it (examples, coverage and fuzzing
phases, positive and negative requests, every built-in check), called from a plain test: its
pytest plugin's lazy fixture loader (``schemathesis.pytest.from_fixture``) fails on pytest 9.2
(it sets ``Function._nodeid``), and the app needs an engine built in a fixture.

Requests reach generation: ``model`` is an enum of the served names and the key is sent. One
refusal the schema cannot state is allowed to schema-valid requests: a 400 whose ``param`` is a
field whose content only the model can judge (a prompt over the context window, a chat
template refusing the messages, a tool's schema the constraint compiler refuses, a budget below
the shortest valid tool call). Every other 400 of a schema-valid request fails the run.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.engine import Status, events, from_schema
from server_helpers import MODEL, server_engine

from kvboost_rag.server import ServerSettings, create_app

logger = logging.getLogger(__name__)

KEY = "schema-test-key"

#: Greedy, at most 4 tokens per answer (the schema's ``maximum`` of ``max_tokens``); at most 16
#: prompts per completion request, the engine's ``max_batch_size``: ``generate_batch`` of more
#: prompts than that hangs (found by this run, an engine bug, not the schema's).
SETTINGS = ServerSettings(model_names=(MODEL, "tiny-alias"), api_key=KEY, temperature=0.0, max_new_tokens=4,
                          max_tokens_limit=4, limits={"max_prompts": 16})

#: Examples per operation and phase at most: about 1,170 requests, 12 s on 2 cores.
MAX_EXAMPLES = 60

#: Fields whose content only the model or the constraint compiler can judge.
CONTENT_PARAMS = ("messages", "prompt", "tools", "tool_choice", "response_format", "max_tokens")


@schemathesis.serializer("application/jsonl", "application/x-ndjson")
def _jsonl(ctx: Any, value: Any) -> bytes:
    """JSONL bodies: the schema describes them as the array of their lines."""
    lines = value if isinstance(value, list) else [value]
    return "\n".join(json.dumps(line) for line in lines).encode()


def _refused_for_content(response: Any) -> bool:
    try:
        param = (json.loads(response.content).get("error") or {}).get("param") or ""
    except (ValueError, AttributeError):
        return False
    return param.split(".")[0] in CONTENT_PARAMS


@schemathesis.check
def schema_valid_requests_accepted(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schemathesis's ``positive_data_acceptance``, save a 400 for content only the model judges."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    if not _refused_for_content(response):
        raise AssertionError(f"a schema-valid request got a 400: {response.content[:300]!r}")
    return None


def _config() -> schemathesis.Config:
    return schemathesis.Config.from_dict({
        "seed": 73,
        "headers": {"Authorization": f"Bearer {KEY}"},
        "generation": {"max-examples": MAX_EXAMPLES},
        "workers": 1,
        "continue-on-failure": True,
        "request-timeout": 120,
        "phases": {"stateful": {"enabled": False}},
        "checks": {"positive_data_acceptance": {"enabled": False}},
    })


def _record(event: Any, statuses: Counter, failures: list[str]) -> None:
    recorder = event.recorder
    for interaction in recorder.interactions.values():
        statuses[(recorder.label, interaction.response.status_code if interaction.response else None)] += 1
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.status == Status.FAILURE:
                info = check.failure_info
                detail = f"{info.failure.title}: {info.failure.message[:300]}\n{info.code_sample[:800]}" if info else ""
                failures.append(f"{recorder.label} {check.name} {detail}")


def run_schemathesis(app: Any) -> tuple[Counter, list[str]]:
    """Schemathesis over every operation of ``app``'s ``/openapi.json``.

    Returns:
        Responses counted by (operation, status), and each failure or error found.
    """
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=_config())
    statuses: Counter = Counter()
    failures: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            _record(event, statuses, failures)
        elif isinstance(event, events.NonFatalError):
            failures.append(f"{event.label} error: {event.value!r}")
        elif isinstance(event, events.FatalError):
            failures.append(f"fatal: {event.exception!r}")
    return statuses, failures


@pytest.fixture(scope="module")
def app():
    return create_app(server_engine(), SETTINGS)


def test_openapi_lists_the_served_models_and_every_status(app):
    schema = TestClient(app).get("/openapi.json").json()
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        fields = schema["components"]["schemas"][name]["properties"]
        assert fields["model"]["enum"] == [MODEL, "tiny-alias"]
        assert fields["max_tokens"]["anyOf"][0]["maximum"] == 4
    paths = schema["paths"]
    codes = {f"{method.upper()} {path}": sorted(op["responses"]) for path, item in paths.items()
             for method, op in item.items()}
    assert codes["POST /v1/chat/completions"] == ["200", "400", "401", "404", "413", "429", "503"]
    assert codes["POST /v1/documents"] == ["200", "400", "401", "413", "429", "503"]
    assert codes["GET /v1/models/{name}"] == ["200", "401", "404"]
    assert codes["GET /health"] == ["200", "503"]
    assert not any("422" in listed for listed in codes.values())
    error = paths["/v1/completions"]["post"]["responses"]["429"]
    assert error["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/Error"
    assert "Retry-After" in error["headers"]
    assert set(paths["/v1/documents"]["post"]["requestBody"]["content"]) >= {"application/json", "application/jsonl"}
    assert paths["/v1/models"]["get"]["security"] == [{"bearer": []}] and "security" not in paths["/health"]["get"]


def test_a_405_allows_every_method_of_its_path(app):
    response = TestClient(app).request("DELETE", "/v1/documents", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    assert {m.strip() for m in response.headers["allow"].split(",")} >= {"GET", "POST"}


def test_schemathesis_finds_no_server_error_and_no_schema_break(app):
    started = time.monotonic()
    statuses, failures = run_schemathesis(app)
    requests = sum(statuses.values())
    logger.info("schemathesis: %d requests in %.1f s: %s", requests, time.monotonic() - started, dict(statuses))
    assert not failures, "\n\n".join(failures[:20])
    assert not [key for key in statuses if key[1] is None or key[1] >= 500], statuses
    generated = sum(n for (label, status), n in statuses.items() if status == 200 and "completions" in label)
    assert generated >= 50, statuses  # requests reached generation
