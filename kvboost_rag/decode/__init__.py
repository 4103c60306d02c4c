"""Stage 5, decoding: token choice (:mod:`~kvboost_rag.decode.sampling`), one batched step of
several sequences (:mod:`~kvboost_rag.decode.step`), the decode worker
(:mod:`~kvboost_rag.decode.scheduler`), constrained decoding, closings, tool calls and ReAct."""
