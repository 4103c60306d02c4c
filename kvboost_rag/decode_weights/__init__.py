"""The decode-weight kernels: the linear layers of decode and verify steps on kernels made for
a few rows, over the weights as decode should read them.

The model boundary (:mod:`kvboost_rag.hf`) calls one entry point,
:class:`~kvboost_rag.decode_weights.small_rows.SmallRowLinears` (chosen once at load by
:func:`~kvboost_rag.decode_weights.small_rows.choose_kernel`); behind it: oneDNN over packed
weights (:mod:`~kvboost_rag.decode_weights.small_rows`), int8 copies with per-channel scales
(:mod:`~kvboost_rag.decode_weights.int8_rows`), the int8 layers that read one input as one
product (:mod:`~kvboost_rag.decode_weights.int8_siblings`), 4-bit runs read as stored
(:mod:`~kvboost_rag.decode_weights.four_bit_groups`), int8 weights a model already holds
(:mod:`~kvboost_rag.decode_weights.stored_int8`), and the memory the load hands back
(:mod:`~kvboost_rag.decode_weights.resident`). Nothing here imports the model boundary.
"""

from kvboost_rag.decode_weights.small_rows import DecodeWeights, SmallRowLinears, choose_kernel, decode_reads

__all__ = ["DecodeWeights", "SmallRowLinears", "choose_kernel", "decode_reads"]
