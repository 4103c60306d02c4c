"""Stage 1, the request: text to tokens (the prompt exactly as full prefill sees it), the chat
template, the call's options and input checks, the documents the prompt holds (registry,
records, token alignment) and the pure :class:`~kvboost_rag.request.plan.PromptPlan`
(prefix hash chain, placed documents). No model, no cache."""
