"""Figures about a call, off its path: stage times (benchmarks), why documents were missed
(rate-limited warnings), and comparisons with full prefill (``verify_correctness``)."""
