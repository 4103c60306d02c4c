"""Quickstart: warm a system prompt and a few documents, then ask with the documents shuffled.

Run: ``python examples/quickstart.py``. Prints the answer, time to first token with reuse
next to full prefill of the same prompt, and where the reused tokens came from.
"""

from __future__ import annotations

import argparse
import logging
import random

from kvboost_rag import KVBoost
from kvboost_rag.corpus import python_reference_topics

SYSTEM_PROMPT = "You are a concise assistant. Answer from the reference documents below."
TOPICS = ["assert", "pass", "raise", "for", "while"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="What does the pass statement do?")
    parser.add_argument("--doc-chars", type=int, default=800, help="characters kept per document")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    topics = python_reference_topics()
    docs = [topics[name][: args.doc_chars] for name in TOPICS]

    engine = KVBoost.from_pretrained(warm_prefix=SYSTEM_PROMPT + "\n\n")
    engine.warm(SYSTEM_PROMPT)  # the shared beginning: exact reuse, pinned in memory
    engine.warm_documents(docs)  # each document once, at ingest

    random.Random(0).shuffle(docs)  # retrieval returns them in another order
    prompt = SYSTEM_PROMPT + "\n\n" + "\n\n".join(docs) + f"\n\nQuestion: {args.question}\nAnswer:"
    full = engine.generate(prompt, max_new_tokens=args.max_new_tokens, reuse=False)
    fast = engine.generate(prompt, max_new_tokens=args.max_new_tokens)

    print(f"answer: {fast.output_text.strip()}")
    print(f"prompt tokens: {fast.prompt_tokens}")
    print(f"TTFT full prefill: {full.ttft_ms:.0f} ms   TTFT with reuse: {fast.ttft_ms:.0f} ms ({full.ttft_ms / fast.ttft_ms:.1f}x)")
    print(
        f"reused {fast.kv_reuse_ratio:.0%}: {fast.prefix_hit_tokens} prefix tokens (exact), "
        f"{fast.content_hit_tokens} document tokens (re-rotated), {fast.recomputed_tokens} recomputed by the repair"
    )


if __name__ == "__main__":
    main()
