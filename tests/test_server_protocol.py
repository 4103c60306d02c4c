"""The OpenAI protocol of the server, in process (FastAPI's TestClient), on the tiny model:
response shapes, streaming, usage, documents, tools and structured output."""

from __future__ import annotations

import json

import pytest
from langchain_kvboost import ChatKVBoost, KVBoostLLM
from server_helpers import (  # noqa: F401 - fixtures
    MODEL,
    SEARCH_TOOL,
    client,
    engine,
    rag_messages,
    sse_payloads,
)


def chat(client, **body):
    response = client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response


def stream_chat(client, **body):
    with client.stream("POST", "/v1/chat/completions", json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(response.iter_lines())


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/other").status_code == 404
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["requests"] == 0


def test_chat_completion_layout_usage_and_figures(client):
    response = chat(client, messages=[{"role": "user", "content": "What does pass do?"}], max_tokens=6)
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    figures, usage = choice["kvboost"], body["usage"]
    assert figures["generated_tokens"] == usage["completion_tokens"] <= 6
    assert usage["prompt_tokens"] == figures["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": figures["cached_tokens"]}
    assert float(response.headers["x-kvboost-ttft-ms"]) == pytest.approx(figures["ttft_ms"], abs=0.1)
    assert int(response.headers["x-kvboost-cached-tokens"]) == figures["cached_tokens"]
    assert int(response.headers["x-kvboost-drafted-tokens"]) == figures["drafted_tokens"] <= figures["generated_tokens"]
    assert figures["decode_steps"] + figures["drafted_tokens"] <= figures["generated_tokens"] + 1


def test_cached_tokens_count_only_what_was_loaded(client, docs):
    warmed = client.post("/v1/documents", json=docs[:3]).json()
    assert warmed["documents"] == 3 and warmed["warmed"] + warmed["already_warm"] == 3
    body = chat(client, messages=rag_messages(list(reversed(docs[:3]))), max_tokens=4).json()
    figures, usage = body["choices"][0]["kvboost"], body["usage"]
    assert figures["documents_found"] == 3 and figures["content_hit_tokens"] > 0
    assert figures["recomputed_tokens"] > 0  # the repair computed these: they are not cached tokens
    loaded = figures["prefix_hit_tokens"] + figures["content_hit_tokens"] - figures["recomputed_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == loaded < usage["prompt_tokens"]


def test_greedy_answers_match_the_in_process_integrations(client, engine, docs):
    messages = rag_messages(docs[3:5], "What does the for statement do?")
    served = chat(client, messages=messages, max_tokens=8).json()["choices"][0]["message"]["content"]
    local = ChatKVBoost(engine=engine, max_new_tokens=8, temperature=0.0)
    assert local.invoke([(m["role"].replace("user", "human"), m["content"]) for m in messages]).content == served
    prompt = docs[5][:200] + "\n\nQuestion: what is this about?\nAnswer:"
    completed = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8}).json()
    assert completed["choices"][0]["text"] == KVBoostLLM(engine=engine, max_new_tokens=8).invoke(prompt)


def test_streamed_chat_matches_the_answer_and_ends_with_usage(client):
    messages = [{"role": "user", "content": "What does the with statement do?"}]
    whole = chat(client, messages=messages, max_tokens=8).json()
    events = stream_chat(client, messages=messages, max_tokens=8, stream_options={"include_usage": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["object"] == "chat.completion.chunk"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finish, usage = events[-2], events[-1]
    assert finish["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert finish["choices"][0]["kvboost"]["generated_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    without = stream_chat(client, messages=messages, max_tokens=8)
    assert "usage" not in without[-1] and without[-1]["choices"][0]["finish_reason"]


def test_completions_one_several_and_streamed(client):
    one = client.post("/v1/completions", json={"model": MODEL, "prompt": "The pass statement", "max_tokens": 5}).json()
    assert one["object"] == "text_completion" and one["id"].startswith("cmpl-")
    several = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["The pass statement", "The for loop"], "max_tokens": 5}
    ).json()
    assert [c["index"] for c in several["choices"]] == [0, 1]
    assert several["choices"][0]["text"] == one["choices"][0]["text"]  # batched greedy = alone
    assert several["usage"]["completion_tokens"] == sum(c["kvboost"]["generated_tokens"] for c in several["choices"])
    body = {"model": MODEL, "prompt": "The pass statement", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = sse_payloads(response.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == one["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == one["usage"]["completion_tokens"]


def test_documents_field_and_cache_control_parts_are_documents(client, docs):
    fresh = [d[::-1] for d in docs[:2]]  # never warmed
    named = chat(client, messages=rag_messages(fresh), documents=fresh, max_tokens=2).json()
    assert named["choices"][0]["kvboost"]["documents_found"] == 2
    # Stored by the first request: found again by content, in another order and another layout.
    again = chat(client, messages=rag_messages(list(reversed(fresh)), "Another question?"), max_tokens=2).json()
    assert again["choices"][0]["kvboost"]["content_hit_tokens"] > 0
    pinned = docs[1][::-1][:200] + " (pinned)"
    parts = [{"type": "text", "text": "Answer from this:"}, {"type": "text", "text": pinned, "cache_control": {"type": "ephemeral"}}]
    marked = chat(client, messages=[{"role": "system", "content": parts}, {"role": "user", "content": "Why?"}], max_tokens=2)
    assert marked.json()["choices"][0]["kvboost"]["documents_found"] == 1


def test_warm_endpoint_takes_texts_objects_and_jsonl(client, docs):
    first = client.post("/v1/documents", json={"documents": [{"id": "a", "text": docs[4]}, docs[4], ""]}).json()
    assert first["object"] == "kvboost.warm" and first["documents"] == 3
    assert first["duplicates"] == 1 and first["empty"] == 1 and first["failed"] == 0
    lines = "\n".join(json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(docs[:5]))
    upload = client.post("/v1/documents", content=lines, headers={"Content-Type": "application/x-ndjson"}).json()
    assert upload["documents"] == 5 and upload["already_warm"] + upload["warmed"] == 5
    again = client.post("/v1/documents", content=lines, headers={"Content-Type": "application/jsonl"}).json()
    assert again["already_warm"] == 5 and again["warmed"] == again["new_tokens"] == 0
    assert client.get("/v1/documents").json()["documents"] >= 5


def test_tool_calls_follow_the_schema_streamed_or_not(client):
    messages = [{"role": "user", "content": "Find what pass does."}]
    body = chat(client, messages=messages, tools=[SEARCH_TOOL], tool_choice="required", max_tokens=64).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "search_docs" and c["id"].startswith("call_") for c in calls)
    assert all(isinstance(json.loads(c["function"]["arguments"])["query"], str) for c in calls)
    named = {"type": "function", "function": {"name": "search_docs"}}
    events = stream_chat(client, messages=messages, tools=[SEARCH_TOOL], tool_choice=named, max_tokens=64,
                         parallel_tool_calls=False)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    [streamed] = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert len(streamed) == 1 and streamed[0]["index"] == 0 and streamed[0]["function"]["name"] == "search_docs"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The call and its result go back in the history; "none" answers in text.
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": calls[:1]},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "pass does nothing."}]
    answer = chat(client, messages=history, tools=[SEARCH_TOOL], tool_choice="none").json()["choices"][0]
    assert "tool_calls" not in answer["message"] and not answer["message"]["content"].startswith("<")


def test_response_formats_give_json(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = chat(client, messages=[{"role": "user", "content": "Name one."}], response_format=fmt, max_tokens=48).json()
    value = json.loads(body["choices"][0]["message"]["content"])
    assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
    assert body["choices"][0]["finish_reason"] == "stop"
    mode = chat(client, messages=[{"role": "user", "content": "JSON"}], response_format={"type": "json_object"},
                max_tokens=16).json()
    assert isinstance(json.loads(mode["choices"][0]["message"]["content"]), dict)
    completed = client.post("/v1/completions", json={"model": MODEL, "prompt": "JSON:", "max_tokens": 48,
                                                      "response_format": fmt}).json()
    assert set(json.loads(completed["choices"][0]["text"])) == {"name", "ok"}
