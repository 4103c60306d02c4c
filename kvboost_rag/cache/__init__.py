"""Stage 2, the cache: the index of stored documents and prefixes, lookups and write-back
(:mod:`~kvboost_rag.cache.manager`), the codec between K/V blocks and stored entries, their
quantization, and the tier stack (:mod:`~kvboost_rag.cache.storage`: device, pinned, memory,
disk, Redis). Metadata lives on the host; device tiers hold K/V only."""
