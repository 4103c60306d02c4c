"""Stage 3, prefill: loaded K/V stitched into a prompt's buffers in a fixed number of
operations (:mod:`~kvboost_rag.prefill.stitch`), then the repair and the pass over the tokens
that must be computed (:mod:`~kvboost_rag.prefill.prefiller`); its
:class:`~kvboost_rag.prefill.outcome.PrefillOutcome` is what decoding and write-back read."""
