"""Real clients over loopback against a real uvicorn server (in a thread) on the tiny model: the
``openai`` client (sync, async, streaming), LangChain ``ChatOpenAI`` (a chat and a tool-calling
agent), LlamaIndex ``OpenAILike`` in a query engine, a client that leaves mid-stream, a bounded
load of concurrent streams, and ``kvboost-rag warm --server``."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import warnings
from typing import Literal

import httpx
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from server_helpers import (  # noqa: F401 - fixture
    MODEL,
    SEARCH_TOOL,
    SETTINGS,
    engine,
    rag_messages,
    sse_payloads,
)

from kvboost_rag.dev.threads import wait_for
from kvboost_rag.server import BackgroundServer
from kvboost_rag.server.warm_client import warm_through_server


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(engine, SETTINGS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def test_openai_client_chat_completions_and_models(client, docs):
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.post("/documents", body=docs[:2], cast_to=object)  # the warm endpoint, through the same client
    reply = client.chat.completions.create(model=MODEL, messages=rag_messages(docs[:2]), max_tokens=6)
    assert isinstance(reply.choices[0].message.content, str)
    figures = reply.choices[0].model_extra["kvboost"]
    assert figures["documents_found"] == 2
    assert reply.usage.prompt_tokens_details.cached_tokens == figures["cached_tokens"] > 0
    completion = client.completions.create(model=MODEL, prompt="The pass statement", max_tokens=4)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 4
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pass " * 5000}])


def test_openai_client_streaming_with_usage(client):
    messages = [{"role": "user", "content": "What does the with statement do?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    tools = client.chat.completions.create(model=MODEL, messages=messages, tools=[SEARCH_TOOL], tool_choice="required",
                                           max_tokens=64, stream=True)
    calls = [d for c in tools if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert calls and json.loads(calls[0].function.arguments)["query"] is not None


def test_async_openai_client_concurrent_requests_match_sequential(server, client):
    questions = [f"What does statement number {i} do?" for i in range(4)]
    alone = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=6)
             .choices[0].message.content for q in questions]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0) as aclient:
            replies = await asyncio.gather(*[
                aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=6)
                for q in questions
            ])
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": questions[0]}], max_tokens=6, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return [r.choices[0].message.content for r in replies] + [streamed]

    answers = asyncio.run(together())
    assert answers == [*alone, alone[0]]  # batched greedy decoding gives each answer alone


def test_langchain_chat_openai_invoke_stream_and_usage(server, docs):
    chat = ChatOpenAI(model=MODEL, base_url=server.url, api_key="unused", temperature=0, max_tokens=6, max_retries=0)
    messages = [("system", "Use this context.\n\n" + docs[0]), ("human", "What does assert do?")]
    reply = chat.invoke(messages)
    assert isinstance(reply.content, str)
    assert reply.usage_metadata["input_token_details"]["cache_read"] >= 0
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in chat.stream(messages))
    assert streamed == reply.content


class Statement(BaseModel):
    name: Literal["pass", "break", "continue"]
    does_nothing: bool


def test_langchain_structured_output_through_the_openai_parse_path(server):
    chat = ChatOpenAI(model=MODEL, base_url=server.url, api_key="unused", temperature=0, max_tokens=48, max_retries=0)
    answer = chat.with_structured_output(Statement, method="json_schema").invoke("Which statement does nothing?")
    assert isinstance(answer, Statement)


def test_langchain_tool_calling_agent(server, engine, docs):
    from langgraph import prebuilt

    @tool
    def search_docs(query: str) -> str:
        """Search the Python reference documentation."""
        return "\n\n".join(docs[:2])

    chat = ChatOpenAI(model=MODEL, base_url=server.url, api_key="unused", temperature=0, max_tokens=64, max_retries=0)

    def model(state, runtime):
        searched = isinstance(state["messages"][-1], ToolMessage)
        return chat.bind_tools([search_docs], tool_choice="none" if searched else "any")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent is deprecated in LangGraph 1.x, still works
        agent = prebuilt.create_react_agent(model, [search_docs])
    state = agent.invoke({"messages": [HumanMessage("What does the assert statement do?")]})
    human, call, result, answer = state["messages"]
    [made] = call.tool_calls
    assert made["name"] == "search_docs" and isinstance(made["args"]["query"], str) and not call.invalid_tool_calls
    assert result.tool_call_id == made["id"] and isinstance(answer.content, str) and not answer.tool_calls


def test_llamaindex_openai_like_query_engine(server, engine, docs):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=server.url, api_key="unused", is_chat_model=False, context_window=4096,
                     max_tokens=8, temperature=0.0, max_retries=0)
    texts = [d[:300] for d in docs[2:5]]
    httpx.post(f"{server.url}/documents", json=texts).raise_for_status()  # ingest: each text read once
    index = VectorStoreIndex.from_documents([Document(text=t) for t in texts], embed_model=MockEmbedding(embed_dim=8))
    before = engine.cache_stats().counters.get("content_hit_tokens", 0)
    response = index.as_query_engine(llm=llm, similarity_top_k=2).query("What does the for statement do?")
    assert isinstance(response.response, str) and len(response.source_nodes) == 2
    assert engine.cache_stats().counters["content_hit_tokens"] > before  # the retrieved nodes came from cache


def test_a_client_leaving_mid_stream_frees_its_sequence(server, engine, monkeypatch):
    streams = []
    original = engine.stream

    def recording(*args, **kwargs):
        streams.append(original(*args, **kwargs))
        return streams[-1]

    monkeypatch.setattr(engine, "stream", recording)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]  # a few events, then the client leaves
    [stream] = streams
    wait_for(lambda: inspect.getgeneratorstate(stream._pieces) == inspect.GEN_CLOSED)
    assert stream.result is None  # closed before its end: its sequence left the batch
    wait_for(lambda: httpx.get(server.url.removesuffix("/v1") + "/health").json()["requests"] == 0, every=0.02)


def test_bounded_load_loses_no_request(server):
    clients, requests = 32, 200

    async def one(session: httpx.AsyncClient, i: int) -> list:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Question {i}: what does pass do?"}],
                "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        async with session.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            return sse_payloads([line async for line in response.aiter_lines()])

    async def run() -> list[list]:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as session:
            gate = asyncio.Semaphore(clients)

            async def bounded(i: int) -> list:
                async with gate:
                    return await one(session, i)

            return await asyncio.gather(*[bounded(i) for i in range(requests)])

    results = asyncio.run(run())
    assert len(results) == requests
    for events in results:
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert events[-1]["usage"]["completion_tokens"] == events[-2]["choices"][0]["kvboost"]["generated_tokens"]


def test_warm_command_through_a_running_server(server, tmp_path, docs):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"id": f"doc{i}", "text": t[::-1]}) + "\n" for i, t in enumerate(docs)))
    seen = []
    report = warm_through_server(source, server.url.removesuffix("/v1"), batch_size=4, on_progress=seen.append)
    assert report.documents == 6 and report.computed == 6 and report.failures == [] and report.computed_tokens > 0
    assert len(seen) == 2 and report.backend == "server"
    again = warm_through_server(source, server.url, batch_size=4)
    assert again.computed == 0 and again.skipped == 6
