"""Stage 5, decoding: token choice (:mod:`~kvboost_rag.decode.sampling`), one batched step of
several sequences (:mod:`~kvboost_rag.decode.step`), a request's view of its decoding sequence
(:mod:`~kvboost_rag.decode.handle`), constrained decoding, closings, tool calls and ReAct. The
engine loop (:mod:`kvboost_rag.engine_loop`) runs the steps."""
