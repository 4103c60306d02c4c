"""Bad requests get the OpenAI error object with a 4xx, never a 500, and the server answers the
next request; the API key, the body bound and admission (429/503 with ``Retry-After``)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from server_helpers import MODEL, SEARCH_TOOL, client, engine  # noqa: F401 - fixtures

from kvboost_rag.server import ServerSettings, create_app

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
    "unknown response format": (chat_body(response_format={"type": "yaml"}), 400, "response_format"),
    "tool_choice naming no tool": (chat_body(tools=[SEARCH_TOOL], tool_choice={"type": "function", "function": {"name": "x"}}),
                                   400, "tools"),
    "malformed tool": (chat_body(tools=[{"type": "function", "function": {"description": "no name"}}]), 400, "tools"),
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
