"""A client that hangs up costs the server nothing more: over a real uvicorn server (in a
thread) on the tiny model, a request whose client leaves while its work waits in the engine
loop's queue leaves it without a prefill, streamed or not, one prompt or several; many such
clients leave no place, buffer or queued work behind, and the answers of the clients that
stay are unchanged.

The test holds the engine loop (busy with another piece of work) so that each request waits
in its queue for sure while its client leaves: nothing depends on timing."""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest
from server_helpers import MODEL, SETTINGS, server_engine

from kvboost_rag.server import BackgroundServer
from kvboost_rag.dev.threads import HUNG_SECONDS, wait_for
from loop_hooks import loop_held




@pytest.fixture(scope="module")
def engine():
    return server_engine()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(engine, SETTINGS) as running:
        yield running


@pytest.fixture
def prefills(engine, monkeypatch) -> list[int]:
    """Prompts the engine prefilled (their token counts) during the test."""
    seen: list[int] = []
    prefiller = engine._requests.prefiller
    steps = prefiller.steps

    def recording(plan, found, **kw):  # counted when the loop starts the work, not before
        seen.append(plan.num_tokens)
        return (yield from steps(plan, found, **kw))

    monkeypatch.setattr(prefiller, "steps", recording)
    return seen


def _chat(content: str, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "stream": stream}


def _held(server) -> int:
    return httpx.get(server.url.removesuffix("/v1") + "/health").json()["requests"]


def _send_raw(server, path: str, body: dict) -> socket.socket:
    """A POST over a plain socket, its answer never read (the test hangs up by closing it)."""
    url = urlsplit(server.url)
    payload = json.dumps(body).encode()
    connection = socket.create_connection((url.hostname, url.port), timeout=HUNG_SECONDS)
    head = (f"POST {url.path}{path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    connection.sendall(head + payload)
    return connection


model_held = loop_held


def _waiting_requests(engine) -> int:
    return engine._loop.queued  # work awaiting admission is queued too


def _assert_all_back(engine, server) -> None:
    wait_for(lambda: _held(server) == 0 and engine._places.admitted == 0 and _waiting_requests(engine) == 0)


def test_a_streaming_client_gone_after_its_first_event_costs_no_prefill(server, engine, prefills):
    with model_held(engine):
        with httpx.stream("POST", f"{server.url}/chat/completions", json=_chat("Hang up now.", True), timeout=HUNG_SECONDS) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would close the response at once
            assert next(lines).startswith("data: ")  # the role chunk
            wait_for(lambda: engine._loop.queued == 1)  # its work waits in the loop's queue
        wait_for(lambda: _waiting_requests(engine) == 0)  # it left the queue while the model was held
    _assert_all_back(engine, server)
    assert prefills == []


@pytest.mark.parametrize(("path", "body"), [
    ("/chat/completions", _chat("Leave before the answer.", False)),
    ("/completions", {"model": MODEL, "prompt": ["The pass statement", "The for statement"], "max_tokens": 6}),
])
def test_a_client_gone_before_its_answer_is_sent_cancels_its_request(server, engine, prefills, path, body):
    with model_held(engine):
        connection = _send_raw(server, path, body)
        wait_for(lambda: engine._loop.queued >= 1)  # one work a prompt
        connection.close()
        wait_for(lambda: _waiting_requests(engine) == 0)
    _assert_all_back(engine, server)
    assert prefills == []


def test_many_clients_hanging_up_leave_nothing_behind_and_change_no_answer(server, engine, prefills):
    questions = [f"What does statement number {i} do?" for i in range(3)]
    alone = [httpx.post(f"{server.url}/chat/completions", json=_chat(q, False), timeout=HUNG_SECONDS).json() for q in questions]
    prefills.clear()
    with model_held(engine):
        for i in range(12):  # each one queued, then gone
            with httpx.stream("POST", f"{server.url}/chat/completions", json=_chat(f"Leaving {i}.", True),
                              timeout=HUNG_SECONDS) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                wait_for(lambda: engine._loop.queued == 1)
            wait_for(lambda: _waiting_requests(engine) == 0)
    _assert_all_back(engine, server)
    assert prefills == []
    again = [httpx.post(f"{server.url}/chat/completions", json=_chat(q, False), timeout=HUNG_SECONDS).json() for q in questions]
    assert [a["choices"][0]["message"]["content"] for a in again] == [a["choices"][0]["message"]["content"] for a in alone]


def test_a_client_gone_during_a_warm_cancels_it(server, engine, prefills):
    texts = [f"Document {i} of a warm nobody waits for: the while statement repeats a block." for i in range(3)]
    with model_held(engine):
        connection = _send_raw(server, "/documents", {"documents": texts})
        wait_for(lambda: engine._loop.queued >= 1)  # its first prefill waits in the loop's queue
        connection.close()
        wait_for(lambda: _waiting_requests(engine) == 0)  # withdrawn while the model was held
    _assert_all_back(engine, server)
    assert prefills == []
    assert not any(engine.is_document_warm(text) for text in texts)
    again = httpx.post(f"{server.url}/documents", json=texts, timeout=HUNG_SECONDS).json()  # the next warm runs
    assert again["warmed"] == 3 and all(engine.is_document_warm(text) for text in texts)
