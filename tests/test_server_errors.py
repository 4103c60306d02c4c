"""Bad requests get the OpenAI error object with a 4xx, never a 500, and the server answers the
next request; the API key, the body bound and admission (429/503 with ``Retry-After``)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from server_helpers import MODEL, SEARCH_TOOL, client, engine  # noqa: F401 - fixtures

from kvboost_rag.server import BackgroundServer, ServerSettings, create_app
from kvboost_rag.server.run import make_server
from kvboost_rag.server.settings import RequestLimits

USER = [{"role": "user", "content": "What does pass do?"}]


def chat_body(**fields):
    return json.dumps({"model": MODEL, "messages": USER, **fields})


BAD_CHAT = {
    "not json": ("{'model': 'tiny'", 400, None),
    "body not an object": ("[1, 2]", 400, None),
    "unknown model": (json.dumps({"model": "gpt-4o", "messages": USER}), 404, "model"),
    "no messages": (chat_body(messages=[]), 400, "messages"),
    "unknown role": (chat_body(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    "max_tokens as text": (chat_body(max_tokens="12"), 400, "max_tokens"),
    "stream as text": (chat_body(stream="yes"), 400, "stream"),
    "negative temperature": (chat_body(temperature=-1), 400, "temperature"),
    "too long a prompt": (chat_body(messages=[{"role": "user", "content": "pass " * 5000}]), 400, "messages"),
    "an image part": (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                      400, "messages.0.content.0.type"),
    "bad schema": (chat_body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}),
                   400, "response_format"),
    "unknown response format": (chat_body(response_format={"type": "yaml"}), 400, "response_format.type"),
    "tool_choice naming no tool": (chat_body(tools=[SEARCH_TOOL], tool_choice={"type": "function", "function": {"name": "x"}}),
                                   400, "tools"),
    "malformed tool": (chat_body(tools=[{"type": "function", "function": {"description": "no name"}}]), 400,
                       "tools.0.function.name"),
    "too small a budget for a tool call": (chat_body(tools=[SEARCH_TOOL], tool_choice="required", max_tokens=3),
                                           400, "max_tokens"),
    "n above 1": (chat_body(n=2), 400, "n"),
    "presence penalty": (chat_body(presence_penalty=0.5), 400, "presence_penalty"),
    "logprobs": (chat_body(logprobs=True), 400, "logprobs"),
    "conflicting budgets": (chat_body(max_tokens=4, max_completion_tokens=5), 400, "max_tokens"),
    "repetition penalty below 1": (chat_body(repetition_penalty=0.5), 400, None),
    "empty stop string": (chat_body(stop=[""]), 400, None),
}

BAD_COMPLETIONS = {
    "token prompt": ({"prompt": [1, 2, 3]}, 400, "prompt"),
    "several prompts streamed": ({"prompt": ["a", "b"], "stream": True}, 400, "prompt"),
    "empty prompt": ({"prompt": ""}, 400, "prompt"),
    "one too long prompt of several": ({"prompt": ["fine", "pass " * 5000]}, 400, "prompt.1"),
    "echo": ({"prompt": "x", "echo": True}, 400, "echo"),
}


def assert_error(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def assert_alive(client):
    assert client.get("/health").json()["requests"] == 0
    answer = client.post("/v1/chat/completions", content=chat_body(max_tokens=2), headers={"Content-Type": "application/json"})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("case", sorted(BAD_CHAT))
def test_bad_chat_requests_get_a_4xx_and_the_server_goes_on(client, case):
    body, status, param = BAD_CHAT[case]
    response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(response, status, param)
    assert_alive(client)


def test_bad_streamed_request_fails_before_the_stream(client):
    body = chat_body(stream=True, messages=[{"role": "user", "content": "pass " * 5000}])
    response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(response, 400, "messages")
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert_alive(client)


@pytest.mark.parametrize("case", sorted(BAD_COMPLETIONS))
def test_bad_completion_requests_get_a_4xx(client, case):
    fields, status, param = BAD_COMPLETIONS[case]
    assert_error(client.post("/v1/completions", json={"model": MODEL, **fields}), status, param)
    assert_alive(client)


def test_bad_warm_requests(client):
    assert_error(client.post("/v1/documents", content="{nope"), 400, None)
    assert_error(client.post("/v1/documents", json={"documents": "one string"}), 400, "documents")
    upload = client.post("/v1/documents", content='{"text": "a"}\n{"body": "b"}', headers={"Content-Type": "application/jsonl"})
    assert_error(upload, 400, "body")
    assert "line 2" in upload.json()["error"]["message"]
    assert_alive(client)


def test_unknown_routes_and_methods_get_error_objects(client):
    missing = client.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert client.get("/v1/chat/completions").status_code == 405
    assert "error" in client.get("/v1/chat/completions").json()


def test_api_key(engine):
    client = TestClient(create_app(engine, ServerSettings(model_names=(MODEL,), api_key="s3cret", max_new_tokens=2)))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200  # for load balancers: no key


def test_body_bound(engine):
    client = TestClient(create_app(engine, ServerSettings(model_names=(MODEL,), max_body_bytes=2048)))
    big = chat_body(messages=[{"role": "user", "content": "x" * 4000}])
    response = client.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield big[:1500].encode()
        yield big[1500:].encode()

    streamed = client.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413
    assert client.post("/v1/chat/completions", content=chat_body(max_tokens=2),
                       headers={"Content-Type": "application/json"}).status_code == 200


def test_full_admission_gets_429_and_shutdown_503_with_retry_after(engine):
    app = create_app(engine, ServerSettings(model_names=(MODEL,), max_pending=1, retry_after_seconds=3, max_new_tokens=2))
    client = TestClient(app)
    admission = app.state.kvboost.admission
    held = admission.admit()  # one request in flight: the bound
    busy = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert busy.status_code == 429 and busy.headers["retry-after"] == "3"
    assert busy.json()["error"]["code"] == "rate_limit_exceeded"
    assert client.post("/v1/documents", json=["a text"]).status_code == 429
    held.release()
    held.release()  # once only
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER}).status_code == 200
    assert admission.active == 0
    admission.close()
    closing = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert closing.status_code == 503 and closing.headers["retry-after"] == "3"
    assert client.get("/health").status_code == 503


# ---------------------------------------------------------------- input limits

LIMITS = RequestLimits(max_stop_sequences=4, max_stop_chars=8, max_prompts=2, max_request_documents=2,
                       max_warm_documents=2, max_logit_bias_entries=2, max_tools=1, max_schema_bytes=1024)
DOC = "The pass statement does nothing; it is used where a statement is required syntactically."
BIG_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "description": "x" * 2000}}}
PINNED = [{"role": "user", "content": [{"type": "text", "text": DOC + " (pinned)", "cache_control": {"type": "ephemeral"}},
                                       {"type": "text", "text": "What does pass do?"}]}]

#: name -> (path, fields over the bound, the param, the limit named, fields at the bound)
OVER_AND_AT = {
    "stop count": ("/v1/chat/completions", {"stop": list("abcde")}, "stop", "max_stop_sequences=4",
                   {"stop": list("abcd")}),
    "stop length": ("/v1/chat/completions", {"stop": ["x" * 9]}, "stop.0", "max_stop_chars=8", {"stop": ["x" * 8]}),
    "stop string length": ("/v1/completions", {"prompt": "The pass", "stop": "y" * 9}, "stop", "max_stop_chars=8",
                           {"prompt": "The pass", "stop": "y" * 8}),
    "prompts": ("/v1/completions", {"prompt": ["a b", "c d", "e f"]}, "prompt", "max_prompts=2",
                {"prompt": ["a b", "c d"]}),
    "documents": ("/v1/chat/completions", {"documents": [DOC, DOC + " 2", DOC + " 3"]}, "documents",
                  "max_request_documents=2", {"documents": [DOC, DOC + " 2"]}),
    "documents with pinned parts": ("/v1/chat/completions", {"messages": PINNED, "documents": [DOC, DOC + " 2"]},
                                    "documents", "max_request_documents=2", {"messages": PINNED, "documents": [DOC]}),
    "tools": ("/v1/chat/completions", {"tools": [SEARCH_TOOL, SEARCH_TOOL]}, "tools", "max_tools=1",
              {"tools": [SEARCH_TOOL], "tool_choice": "none"}),
    "tool schema": ("/v1/chat/completions",
                    {"tools": [{**SEARCH_TOOL, "function": {**SEARCH_TOOL["function"], "description": "x" * 2000}}]},
                    "tools.0", "max_schema_bytes=1024", {"tools": [SEARCH_TOOL], "tool_choice": "none"}),
    "response format schema": ("/v1/completions", {"prompt": "The pass", "response_format": BIG_SCHEMA},
                               "response_format", "max_schema_bytes=1024",
                               {"prompt": "The pass", "response_format": {"type": "text"}}),
}


@pytest.fixture(scope="module")
def limited(engine):
    """A client of a server with small input limits."""
    return TestClient(create_app(engine, ServerSettings(model_names=(MODEL,), temperature=0.0, max_new_tokens=2,
                                                        limits=LIMITS)))


def _post(client, path, fields):
    base = {"model": MODEL} if path == "/v1/completions" else {"model": MODEL, "messages": USER}
    return client.post(path, json={**base, **fields})


@pytest.mark.parametrize("case", sorted(OVER_AND_AT))
def test_an_input_over_its_limit_gets_a_400_naming_it_and_one_at_it_passes(limited, case):
    path, over, param, named, at = OVER_AND_AT[case]
    refused = _post(limited, path, over)
    assert_error(refused, 400, param)
    assert named in refused.json()["error"]["message"]
    accepted = _post(limited, path, at)
    assert accepted.status_code == 200, accepted.text


def test_logit_bias_over_its_limit_names_the_limit_before_the_unsupported_field(limited):
    over = _post(limited, "/v1/chat/completions", {"logit_bias": {"1": 1.0, "2": 1.0, "3": 1.0}})
    assert_error(over, 400, "logit_bias")
    assert "max_logit_bias_entries=2" in over.json()["error"]["message"]
    at = _post(limited, "/v1/chat/completions", {"logit_bias": {"1": 1.0, "2": 1.0}})
    assert_error(at, 400, "logit_bias")  # within the bound: refused as unsupported, not as too long
    assert "max_logit_bias_entries" not in at.json()["error"]["message"]
    assert "not supported" in at.json()["error"]["message"]


def test_warm_calls_over_the_document_limit_get_a_400_before_any_warm(limited, engine):
    texts = [f"{DOC} Warm limit {i}." for i in range(3)]
    refused = limited.post("/v1/documents", json=texts)
    assert_error(refused, 400, "documents")
    assert "max_warm_documents=2" in refused.json()["error"]["message"]
    upload = "\n".join(json.dumps({"id": str(i), "text": t}) for i, t in enumerate(texts))
    refused_jsonl = limited.post("/v1/documents", content=upload, headers={"Content-Type": "application/jsonl"})
    assert_error(refused_jsonl, 400, "documents")
    assert not any(engine.is_document_warm(t) for t in texts)
    accepted = limited.post("/v1/documents", json={"documents": texts[:2]})
    assert accepted.status_code == 200 and accepted.json()["documents"] == 2, accepted.text
    assert all(engine.is_document_warm(t) for t in texts[:2])


@pytest.fixture
def streams_started(engine, monkeypatch):
    """How many engine streams (prompt work) requests started during the test."""
    started = []
    real = engine.stream

    def counting(*args, **kwargs):
        started.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "stream", counting)
    return started


@pytest.mark.parametrize(("seed", "code"), [(2**64, "integer_above_max_value"), (2**63, "integer_above_max_value"),
                                            (-(2**63) - 1, "integer_below_min_value")])
def test_a_seed_outside_the_signed_64_bit_range_is_a_400_before_any_work(client, streams_started, seed, code):
    for path, fields in (("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "The pass"})):
        response = _post(client, path, {**fields, "seed": seed, "temperature": 1.0})
        assert_error(response, 400, "seed")
        assert response.json()["error"]["code"] == code and str(seed) in response.json()["error"]["message"]
    assert streams_started == []


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_seeds_in_the_signed_64_bit_range_sample(client, streams_started, seed):
    response = _post(client, "/v1/chat/completions", {"seed": seed, "temperature": 1.0, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert streams_started == [1]


def test_limits_are_validated_and_their_defaults_documented():
    with pytest.raises(ValidationError):
        RequestLimits(max_stop_sequences=0)
    with pytest.raises(ValidationError):
        ServerSettings(limits={"max_prompts": 2, "max_stops": 3})  # an unknown limit
    with pytest.raises(ValidationError):
        ServerSettings(seed=2**64)
    assert ServerSettings(limits={"max_prompts": 3}).limits.max_prompts == 3
    table = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    defaults = RequestLimits()
    for name in RequestLimits.model_fields:
        row = re.search(rf"^\| `{name}` \| ([\d,]+) \|", table, re.MULTILINE)
        assert row is not None, f"docs/server.md has no row for {name}"
        assert int(row.group(1).replace(",", "")) == getattr(defaults, name), name
    assert defaults.max_stop_sequences == 4 and defaults.max_tools == 128  # the OpenAI API's bounds


# ---------------------------------------------------------------- authentication before the body


def _raw_call(app, path: str, headers: dict[str, str]) -> tuple[int, dict, int]:
    """Call ``app`` as an ASGI server would with a body of ``Content-Length`` bytes that never
    comes; returns the status, the error body and how many times the app asked for the body."""
    pulled = 0
    sent: list[dict] = []

    async def receive():
        nonlocal pulled
        pulled += 1
        await asyncio.sleep(3600)  # the body never comes: a server waiting for it hangs here

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), pulled


THIRTY_MIB = str(30 * 1024 * 1024)


def test_a_request_without_the_key_is_refused_before_its_body_is_read(engine):
    settings = ServerSettings(model_names=(MODEL,), api_key="s3cret-key", max_body_bytes=40 * 1024 * 1024)
    app = create_app(engine, settings)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"}):
        for path in ("/v1/documents", "/v1/chat/completions", "/v1/nowhere", "/anywhere"):
            status, body, pulled = _raw_call(app, path, {"Content-Length": THIRTY_MIB, **headers})
            assert (status, body["error"]["code"], pulled) == (401, "invalid_api_key", 0), (path, headers)


def test_the_key_is_checked_before_the_body_bound(engine):
    app = create_app(engine, ServerSettings(model_names=(MODEL,), api_key="s3cret-key", max_body_bytes=1024 * 1024))
    status, body, pulled = _raw_call(app, "/v1/documents", {"Content-Length": THIRTY_MIB})
    assert (status, pulled) == (401, 0)
    status, body, pulled = _raw_call(app, "/v1/documents",
                                     {"Content-Length": THIRTY_MIB, "Authorization": "Bearer s3cret-key"})
    assert (status, body["error"]["code"], pulled) == (413, "request_too_large", 0)


def test_uvicorn_answers_an_unauthenticated_upload_at_once(engine):
    settings = ServerSettings(model_names=(MODEL,), api_key="s3cret-key", max_new_tokens=2)
    with BackgroundServer(engine, settings) as server:
        with socket.create_connection((server.host, server.port), timeout=10) as connection:
            connection.sendall((f"POST /v1/documents HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json"
                                f"\r\nContent-Length: {THIRTY_MIB}\r\n\r\n").encode())
            started = time.monotonic()
            head = connection.recv(4096).decode("latin-1")  # no body sent: a server reading it would hang
            assert head.startswith("HTTP/1.1 401"), head
            assert time.monotonic() - started < 5
        health = httpx.get(server.url.removesuffix("/v1") + "/health", timeout=10)
        assert health.status_code == 200
        models = httpx.get(f"{server.url}/models", headers={"Authorization": "Bearer s3cret-key"}, timeout=10)
        assert models.status_code == 200


def test_uvicorn_config_carries_the_connection_limits(engine):
    server = make_server(engine, ServerSettings(max_connections=7, keep_alive_seconds=3), "127.0.0.1", 0, "warning")
    assert (server.config.limit_concurrency, server.config.timeout_keep_alive) == (7, 3)
    default = make_server(engine, None, "127.0.0.1", 0, "warning")
    assert (default.config.limit_concurrency, default.config.timeout_keep_alive) == (1024, 5)
    with pytest.raises(ValidationError):
        ServerSettings(max_connections=0)
