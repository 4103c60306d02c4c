"""The attention kernels the model boundary's passes call, one module per kind, over plain
tensors (queries, the K/V of a cache, positions); nothing here imports transformers or the
model boundary (:mod:`kvboost_rag.hf` registers them with transformers and calls them). Each
takes a layer's scale, sliding window and softcap as one
:class:`~kvboost_rag.attention_backends.spec.AttentionSpec`:

- :mod:`~kvboost_rag.attention_backends.sparse`: queries at scattered positions over a full
  cache (a blend pass, the tokens after a prefix hit), with three interchangeable backends
  (masked SDPA, FlexAttention, blocks) and the last query's weights the attention repair reads;
- :mod:`~kvboost_rag.attention_backends.ragged`: short rows (decode and verify steps), a row's
  last tokens over its keys in one product per K/V head, or many rows in one padded call;
- :mod:`~kvboost_rag.attention_backends.row_rounding`: the fewest rows from which this CPU's
  float32 products round each row alike (measured once), so a short row's product rounds as a
  one-token step's.
"""

from kvboost_rag.attention_backends.spec import AttentionSpec

__all__ = ["AttentionSpec"]
