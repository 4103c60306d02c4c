"""The request lifecycle: one prompt through every stage in order (plan, prefill, first token,
decoding in the engine loop, result, write-back), and the parts of an engine it runs on."""
