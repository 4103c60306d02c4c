"""Prompt builders shared by the engine tests."""

SYSTEM_PROMPT = "You are a careful assistant. Answer only from the documents below."


def rag_prompt(docs: list[str], question: str = "What does it say?") -> str:
    """System prompt, documents, question: the shape of a RAG prompt."""
    return SYSTEM_PROMPT + "\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}\nAnswer:"
