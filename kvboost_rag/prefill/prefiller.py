"""Prefill of a planned prompt: exact prefix hits, re-rotated document hits, CacheBlend repair.

:meth:`Prefiller.run` reads a :class:`~kvboost_rag.request.plan.PromptPlan`, loads what the cache
holds, runs the model once over the tokens that must be computed, and returns a
:class:`~kvboost_rag.prefill.outcome.PrefillOutcome` (last logits, a cache ready for decoding, and
what was reused). It stores nothing: write-back reads the outcome.

- Only prefix hits (or nothing cached): the prefix K/V goes into the buffers and the rest of
  the prompt is prefilled on top of it. Same logits as full prefill.
- Document hits: their K/V is re-rotated to the new positions and stitched with the prefix
  into full-length buffers. The attention strategy runs the tokens that are not cached once
  over the stitched cache and picks the cached tokens the last token attends to most;
  CacheBlend runs the non-prefix tokens through the first
  ``check_layer + 1`` layers into scratch buffers and picks the cached tokens whose K/V
  deviates most at ``check_layer``; the blend pass then runs only those plus the live tokens
  over the stitched cache, scattering their K/V into it with attention made causal by
  position. With ``blend_stages > 1`` the chosen set shrinks between layer spans to the
  tokens that still deviate most (gradual filtering). No pass over all cached tokens through
  the whole model.

The lookup (:meth:`Prefiller.lookup`) reads the tiers on the caller's thread; the rest
(:meth:`Prefiller.steps`) is prompt work for the engine loop: a generator that yields its
passes (:mod:`kvboost_rag.hf.passes`) and is sent their results, so the loop runs them in
slices beside the running answers' next tokens; the result is the whole pass's, to float
tolerance. Passes through part of the model (CacheBlend's selection and gradual filtering)
and captured passes run whole, each as a :class:`~kvboost_rag.hf.passes.ModelCall`.
:meth:`Prefiller.run` does both at once, without the loop (tools and tests).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from kvboost_rag.cache.codec import KVBlock
from kvboost_rag.cache.manager import CacheManager
from kvboost_rag.config import KVBoostSettings
from kvboost_rag.diagnosis.stage_times import stage
from kvboost_rag.hf import BufferedCache, ModelAdapter
from kvboost_rag.hf.captured import CapturedRows, Row, Slot
from kvboost_rag.hf.passes import ModelCall, PassResult, PassSteps, TokenPass, run_now
from kvboost_rag.prefill.outcome import PrefillOutcome
from kvboost_rag.prefill.stitch import Run, row_bytes, stitch_documents, stitch_prefix
from kvboost_rag.repair import RepairInputs, RepairStrategy, make_strategy
from kvboost_rag.repair.base import Selection
from kvboost_rag.repair.blend_pass import filtered_blend
from kvboost_rag.repair.lookahead import look_ahead_steps
from kvboost_rag.repair.runs import contiguous_runs
from kvboost_rag.repair.selection import leading_tokens, recompute_budget
from kvboost_rag.request.plan import PlacedDocument, PromptPlan

logger = logging.getLogger(__name__)

#: Rows past the prompt and its reserved new tokens in every prefill buffer: attention then
#: always reads a slice of the buffer, never the whole of it, so compiled attention sees one
#: stride pattern for the keys (a buffer read whole is a second variant, compiled again).
SPARE_ROWS = 1


@dataclass
class ContentHits:
    """Document chunks loaded for one prompt and where their rows go.

    Attributes:
        keys: Stored keys of the loaded chunks, in load order.
        blocks: Their blocks, in the same order.
        runs: Runs of block rows placed at prompt positions.
    """

    keys: list[str] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.runs)


@dataclass
class Lookup:
    """What the cache holds of a prompt, read before its passes run.

    Attributes:
        pieces: The stored prefix chunks of its exact prefix hit.
        documents: Documents after the prefix hit.
        hits: Document chunks loaded, and where their rows go.
    """

    pieces: list = field(default_factory=list)
    documents: list[PlacedDocument] = field(default_factory=list)
    hits: ContentHits = field(default_factory=ContentHits)

    @property
    def prefix_tokens(self) -> int:
        """Tokens the prefix hit serves."""
        return sum(piece.length for piece in self.pieces)


class Prefiller:
    """Runs prefill with whatever the cache can serve.

    Args:
        adapter: The model adapter.
        cache: The cache manager (lookups only; storing is the write-back's job).
        settings: Engine settings.
        captured: Captured prefill passes (``captured_prefill_buckets``): a prompt prefilled
            into a slot runs the tokens after its prefix hit, or its blend pass, through them
            when they fit the largest bucket; else (and without them) eagerly.
        captured_probe: Captured passes that record attention: the attention repair's probe
            of a prompt in a slot, when its live tokens fit; else the probe runs eagerly.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        cache: CacheManager,
        settings: KVBoostSettings,
        captured: CapturedRows | None = None,
        captured_probe: CapturedRows | None = None,
    ) -> None:
        self.adapter = adapter
        self.cache = cache
        self.settings = settings
        self.captured, self.captured_probe = captured, captured_probe
        self._strategies: dict[str, RepairStrategy] = {}

    @property
    def repair(self) -> RepairStrategy:
        """The repair strategy ``settings.recompute_strategy`` names (built once per name by
        :func:`~kvboost_rag.repair.make_strategy`, with its fallback; settings may change
        between calls)."""
        name = self.settings.recompute_strategy
        strategy = self._strategies.get(name)
        if strategy is None:
            strategy = self._strategies[name] = make_strategy(self.adapter, self.settings)
        return strategy

    def run(
        self,
        plan: PromptPlan,
        *,
        reuse: bool = True,
        buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        slot: Slot | None = None,
    ) -> PrefillOutcome:
        """Prefill the planned prompt at once, on this thread (no engine loop): look up,
        stitch, re-rotate, repair, compute the rest; see :meth:`steps`."""
        found = self.lookup(plan) if reuse else None
        return run_now(self.adapter, self.steps(plan, found, buffers=buffers, slot=slot))

    def lookup(self, plan: PromptPlan) -> Lookup:
        """What the cache holds of the planned prompt: its exact prefix hit and, with content
        reuse, the document chunks after it (loaded from the tiers)."""
        with stage("lookup", self.adapter.device):
            pieces = self.cache.match_prefix(plan)
            found = Lookup(pieces=pieces)
            found.documents = plan.documents_after(found.prefix_tokens)
            if plan.content_reuse and found.prefix_tokens < plan.num_tokens:
                found.hits = self._content_hits(plan, found.documents, found.prefix_tokens)
        return found

    def steps(
        self,
        plan: PromptPlan,
        found: Lookup | None,
        *,
        buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        slot: Slot | None = None,
    ) -> PassSteps[PrefillOutcome]:
        """The prompt work of the planned prompt's prefill (a generator of passes, see
        :mod:`kvboost_rag.hf.passes`): stitch what ``found`` holds, re-rotate, repair,
        compute the rest.

        Args:
            plan: The prompt's plan.
            found: What :meth:`lookup` found; ``None`` computes every token (the full-prefill
                baseline) and reads no cache.
            buffers: Gives the prompt's ``[layers, kv_heads, capacity, head_dim]`` K and V
                buffers for a capacity (a slot of the captured steps' pool, reused host
                buffers); default: new ones.
            slot: The captured steps' slot ``buffers`` gives, if it is one (its passes may then
                run captured).

        Returns:
            The outcome. When a warm's whole text was already stored, nothing is computed
            and ``logits`` is ``None``.
        """
        n = plan.num_tokens
        allocate = buffers or self.adapter.buffers
        if found is None:
            keys, values = allocate(n + plan.reserve + SPARE_ROWS)
            return (yield from self._exact(plan, keys, values, 0, (), None))
        h, prefix_keys = found.prefix_tokens, tuple(p.key for p in found.pieces)
        if h >= n:
            return PrefillOutcome(
                logits=None, cache=None, prefix_tokens=n, prefix_keys=prefix_keys, documents=found.documents,
                strategy="exact",
            )
        with stage("stitch", self.adapter.device):
            keys, values = allocate(n + plan.reserve + SPARE_ROWS)
            stitch_prefix(keys, values, [(piece.block, piece.length) for piece in found.pieces])
        if not found.hits:
            outcome = yield from self._exact(plan, keys, values, h, prefix_keys, slot)
        else:
            outcome = yield from self._blend(plan, keys, values, h, prefix_keys, found.hits, slot)
        outcome.documents = found.documents
        outcome.merged_tokens = sum(d.merged_tokens for d in found.documents)
        outcome.loaded_kv_bytes = (h + outcome.content_tokens) * row_bytes(keys, values)
        return outcome

    # ------------------------------------------------------------------ exact path
    def _exact(
        self,
        plan: PromptPlan,
        keys: torch.Tensor,
        values: torch.Tensor,
        h: int,
        prefix_keys: tuple[str, ...],
        slot: Slot | None,
    ) -> PassSteps[PrefillOutcome]:
        """Prefill the tokens after the prefix hit on top of it (same logits as full prefill).

        Where decode rounds activations (int8 rows, 4-bit runs) and the same prompt asked again
        would hit a prefix of all but its last token (:attr:`PromptPlan.repeat_hits_all_but_last`:
        this call's K/V, stored), the last token runs in a pass of its own, as the repeat runs
        it: the repeat gets bitwise this call's logits and K/V, and its answer this call's
        tokens (computed among the other tokens, the last token's rows round another way:
        ~1e-7, which rounded activations grow to a different answer after a near tie)."""
        ids = plan.tokens.ids
        n = len(ids)
        logits = (yield from self._captured_pass(slot, ids[h:], range(h, n))) if h else None
        if logits is not None:
            kv = self.adapter.cache_over(keys, values, n)
        else:
            kv = self.adapter.cache_over(keys, values, h)
            alone = plan.repeat_hits_all_but_last and self.adapter.small_rows.rounds_activations
            last = n - 1 if alone else h  # h <= n - 1 here
            if last > h:
                yield TokenPass(plan.tokens.id_tensor[h:last], torch.arange(h, last), kv)
            computed: PassResult = yield TokenPass(plan.tokens.id_tensor[last:], torch.arange(last, n), kv, logits=True)
            logits = computed.logits
        return PrefillOutcome(
            logits=logits,
            cache=kv,
            keys=keys,
            values=values,
            prefix_tokens=h,
            prefix_keys=prefix_keys,
            live_tokens=n - h,
            strategy="exact" if h else "full",
        )

    # ------------------------------------------------------------------ document hits
    def _content_hits(self, plan: PromptPlan, documents: list[PlacedDocument], h: int) -> ContentHits:
        """Load the chunks of the documents after the prefix hit and place their rows.

        The plan aligned each document row with a prompt token of the same id; a loaded chunk
        whose stored tokens differ from the document's (a colliding or tampered entry) is not
        used. Work is per chunk (bisection into the aligned rows), not per token; token ids
        are compared as host lists. The last prompt token is always computed (its logits
        are needed).
        """
        last = len(plan.tokens.ids) - 1
        hits = ContentHits()
        index: dict[str, int] = {}
        unusable: set[str] = set()
        for document in documents:
            for chunk, first, stop in _chunk_slices(document, h, last):
                record = document.record
                key = record.chunk_keys[chunk]
                if key in unusable:
                    continue
                slot = index.get(key)
                if slot is None:
                    block = self.cache.load(key)
                    lo = chunk * record.chunk_size
                    expected = record.spans[2][lo : lo + record.chunk_length(chunk)]  # host int64 ids
                    if block is None or block.token_ids.cpu().numpy().tobytes() != expected.tobytes():
                        unusable.add(key)
                        continue
                    slot = index[key] = len(hits.blocks)
                    hits.keys.append(key)
                    hits.blocks.append(block)
                base = chunk * record.chunk_size
                for row, position, length in _runs(document.rows, document.positions, first, stop):
                    hits.runs.append(Run(slot, row - base, position, length))
        return hits

    def _blend(
        self,
        plan: PromptPlan,
        keys: torch.Tensor,
        values: torch.Tensor,
        h: int,
        prefix_keys: tuple[str, ...],
        hits: ContentHits,
        slot: Slot | None,
    ) -> PassSteps[PrefillOutcome]:
        """Stitch re-rotated document K/V after the prefix, repair, prefill the rest.

        ``keys``/``values`` are ``[layers, heads, capacity, dim]`` buffers holding the prefix;
        every other prompt position is written here or by the model call (cached rows below,
        computed rows by the scatter), so the buffers need no zero-filling.
        """
        n = plan.num_tokens
        cached = torch.zeros(n, dtype=torch.bool)  # [n] host mask of the positions loaded
        with stage("stitch", self.adapter.device):
            cached[stitch_documents(self.adapter, keys, values, hits.blocks, hits.runs)] = True
        live, selection, keep = yield from self._choose(plan, keys, values, h, cached, slot)
        compute = live.clone()  # [n] bool: every position the blend pass runs
        compute[selection.positions] = True
        compute[keep] = True
        stitched = self.adapter.cache_over(keys, values, n)
        logits, recomputed = yield from self._blend_pass(plan, stitched, compute, selection, keep, slot)
        if not selection.stage_sizes[1:]:
            recomputed = float((cached & compute).sum())
        loaded = int(cached.sum())
        recomputed_tokens = round(recomputed)  # with gradual filtering: the mean per layer
        return PrefillOutcome(
            logits=logits,
            cache=stitched,
            keys=keys,
            values=values,
            prefix_tokens=h,
            prefix_keys=prefix_keys,
            loaded_chunks=frozenset(hits.keys),
            content_tokens=loaded,
            recomputed_tokens=recomputed_tokens,
            live_tokens=int(live.sum()),
            strategy=self.repair.name,
            recompute_ratio=recomputed_tokens / loaded if loaded else 0.0,
            follow_up=self._lookahead(plan, keys, values, stitched, cached & ~compute, loaded),
        )

    def _choose(
        self, plan: PromptPlan, keys: torch.Tensor, values: torch.Tensor, h: int, cached: torch.Tensor, slot: Slot | None
    ) -> PassSteps[tuple[torch.Tensor, Selection, torch.Tensor]]:
        """``(live, selection, keep)``: the positions computed whatever the repair (after the
        prefix, not loaded, and the last token), the cached ones the repair recomputes, and
        the first tokens of each document kept fresh (``keep_document_start``)."""
        n = plan.num_tokens
        content_positions = cached.nonzero().view(-1)  # [loaded] sorted
        ratio = self.settings.recompute_ratio
        budget = None if ratio == "auto" else recompute_budget(int(content_positions.numel()), ratio)
        live = ~cached  # [n] bool
        live[:h] = False
        live[n - 1] = True
        with stage("select", self.adapter.device):  # the probe inside it is timed apart
            probe = partial(self._captured_probe, slot, n) if self.captured_probe is not None and slot is not None else None
            inputs = RepairInputs(
                plan.tokens.id_tensor, h, live, keys, values, content_positions, budget, probe,
                self.settings.prefill_chunk_for(self.adapter.device.type),
            )
            selection = yield from self.repair.choose(inputs)
        keep_start = self.settings.keep_document_start
        keep = leading_tokens(contiguous_runs(content_positions) if keep_start else [], keep_start)
        return live, selection, keep

    def _blend_pass(
        self,
        plan: PromptPlan,
        stitched: BufferedCache,
        compute: torch.Tensor,
        selection: Selection,
        keep: torch.Tensor,
        slot: Slot | None,
    ) -> PassSteps[tuple[torch.Tensor, float]]:
        """Run the positions of ``compute`` over the stitched cache (in stages with gradual
        filtering; captured when it fits); returns the last logits and, for gradual filtering,
        the tokens recomputed per layer on average."""
        adapter, input_ids = self.adapter, plan.tokens.id_tensor
        positions = compute.nonzero().view(-1)  # [computed] sorted
        with stage("blend", adapter.device):
            if len(selection.stage_sizes) > 1:
                filtered = partial(
                    filtered_blend, adapter, self.settings.blend_stages, input_ids, positions, selection.positions,
                    keep, selection.stage_sizes, stitched,
                )
                return (yield ModelCall(filtered, int(positions.numel())))
            logits = yield from self._captured_pass(slot, input_ids[positions].tolist(), positions.tolist())
            if logits is not None:
                return logits, 0.0
            blended: PassResult = yield TokenPass(input_ids[positions], positions, stitched, logits=True)
            return blended.logits, 0.0

    def _captured_probe(
        self, slot: Slot, length: int, tokens: torch.Tensor, positions: torch.Tensor, queries: int
    ) -> list[torch.Tensor] | None:
        """The attention repair's probe as one captured pass: the live ``tokens`` at their
        ``positions`` over the slot as stitched, the attention of the last ``queries`` of them
        per layer over the prompt's ``length`` rows (:func:`~kvboost_rag.repair.probe.run_probe`'s
        result); ``None`` (run it eagerly) when the passes record another number of queries,
        there are fewer live tokens than that, or they do not fit the largest bucket."""
        probe = self.captured_probe
        count = len(tokens)
        if probe.record_queries != queries or count < queries or count > probe.max_tokens:
            return None
        probe.run([Row(slot, tokens.tolist(), positions=positions.tolist())])
        return probe.recorded(slot, length)

    def _captured_pass(
        self, slot: Slot | None, tokens: Sequence[int], positions: Sequence[int]
    ) -> PassSteps[torch.Tensor | None]:
        """The ``[vocab]`` logits of the last of ``tokens`` run at ``positions`` (ascending) in
        ``slot`` as captured passes (one per chunk of ``prefill_chunk_tokens``, each run whole):
        their K/V written at their positions, attention causal by position over the slot;
        ``None`` (run it eagerly) without captured passes, without a slot, or when the tokens
        do not fit the largest bucket."""
        captured = self.captured
        if captured is None or slot is None or not tokens or len(tokens) > captured.max_tokens:
            return None
        tokens, positions = list(tokens), list(positions)
        chunk = self.settings.prefill_chunk_for(self.adapter.device.type)
        logits = None
        for start in range(0, len(tokens), chunk):
            row = Row(slot, tokens[start : start + chunk], positions=positions[start : start + chunk])
            # The step's output buffer is reused by the next: the logits are copied out.
            logits = yield ModelCall(lambda row=row: captured.run([row]).last(0).clone(), len(row.tokens))
        return logits

    def _lookahead(
        self,
        plan: PromptPlan,
        keys: torch.Tensor,
        values: torch.Tensor,
        stitched: BufferedCache,
        stale: torch.Tensor,
        loaded: int,
    ) -> Callable[[int], PassSteps[int]] | None:
        """The lookahead repair to run once the first token is chosen (it reads the stale tokens
        it attends to most), or ``None`` without ``lookahead_ratio``."""
        extra = recompute_budget(loaded, self.settings.lookahead_ratio) if self.repair.name == "attention" else 0
        if not extra:
            return None
        return partial(
            look_ahead_steps, self.adapter, input_ids=plan.tokens.id_tensor, keys=keys, values=values,
            stitched=stitched, stale=stale, budget=extra,
        )


def _chunk_slices(document: PlacedDocument, h: int, last: int) -> Iterator[tuple[int, int, int]]:
    """``(chunk, first, stop)`` for each chunk of the document with aligned rows at prompt
    positions in ``[h, last)``: its pairs are ``rows[first:stop]`` / ``positions[first:stop]``
    (both ascending), found by bisection."""
    rows, positions = document.rows, document.positions
    size = document.record.chunk_size
    begin = bisect.bisect_left(positions, h)
    end = bisect.bisect_left(positions, last)  # the last prompt token is always computed
    while begin < end:
        chunk = rows[begin] // size
        stop = min(end, bisect.bisect_left(rows, (chunk + 1) * size, begin, end))
        yield chunk, begin, stop
        begin = stop


def _runs(rows: Sequence[int], positions: Sequence[int], first: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """``(row, position, length)`` runs of ``rows[first:stop]`` / ``positions[first:stop]``
    where both advance by one (one re-rotation shift per run): the whole slice at once when it
    is one run (the usual case), else split where either jumps."""
    count = stop - first
    if rows[stop - 1] - rows[first] == count - 1 and positions[stop - 1] - positions[first] == count - 1:
        yield rows[first], positions[first], count
        return
    start = first
    for i in range(first + 1, stop + 1):
        if i == stop or rows[i] != rows[i - 1] + 1 or positions[i] != positions[i - 1] + 1:
            yield rows[start], positions[start], i - start
            start = i
