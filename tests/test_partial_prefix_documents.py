"""A document whose first words match the warm's lead-in is still served from cache."""

from __future__ import annotations

from rag_prompts import SYSTEM_PROMPT, rag_prompt

from kvboost_rag.request import plan as plan_module

CONTEXT = "The garden keeps its apples in a cold cellar through the winter months until spring. " * 3
SHARED_START = "The river carries boats past the old mill and the bridge near the northern town. " * 3
SECOND = "Quiet meadows stretch beyond the hills where shepherds rest their flocks at noon. " * 3
OTHER = "Lanterns were lit along the harbour wall every evening before the fishing fleet returned. " * 3


def test_a_document_starting_like_the_context_document_is_served_by_content(make_engine):
    engine = make_engine("llama")
    engine.warm(SYSTEM_PROMPT + "\n\n")  # the document context documents are warmed behind
    # the first two documents warmed are the context documents: the others are warmed behind
    # the lead-in "system prompt + CONTEXT"
    engine.warm_documents([CONTEXT, SECOND, SHARED_START, OTHER])
    prompt = rag_prompt([SHARED_START, OTHER])
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    lead_in = engine.tokenizer(rag_prompt([CONTEXT]), add_special_tokens=False)["input_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(ids, lead_in)) if a != b)
    system_only = len(engine.tokenizer(SYSTEM_PROMPT + "\n\n", add_special_tokens=False)["input_ids"])
    assert shared > system_only  # the prompt's first document shares its first token(s) with CONTEXT

    result = engine.generate(prompt, max_new_tokens=1)

    assert result.documents_found == 2
    assert result.prefix_hit_tokens >= shared  # the shared tokens come from the lead-in, exactly
    doc_tokens = sum(engine.count_tokens(d) for d in (SHARED_START, OTHER))
    # every document token after the prefix hit is loaded but boundary merges and the last token
    assert result.content_hit_tokens >= doc_tokens - (result.prefix_hit_tokens - system_only) - 4


def test_documents_after_keeps_a_document_the_prefix_covers_in_part():
    class Placed:
        def __init__(self, first: int, last: int) -> None:
            self.first_token, self.positions = first, tuple(range(first, last + 1))

    plan = plan_module.PromptPlan.__new__(plan_module.PromptPlan)
    covered, partly, after = Placed(5, 20), Placed(21, 60), Placed(61, 90)
    object.__setattr__(plan, "documents", [covered, partly, after])
    assert plan.documents_after(23) == [partly, after]
    assert plan.documents_after(21) == [partly, after]
    assert plan.documents_after(61) == [after]
