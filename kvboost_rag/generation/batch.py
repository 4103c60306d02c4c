"""``generate_batch``: several prompts prefilled and decoded together.

:class:`Batches` prepares every prompt of a call through the engine's
:class:`~kvboost_rag.generation.lifecycle.Requests` and hands them to the engine loop together
(their passes then share its steps); the loop admits them in order as places free up (a
prompt whose first token ends it gives its place back at once). A prompt that
fails (its set-up, its prefill, its decoding) fails alone, with its error in its entry; an
interrupt ends the call, and every prompt already handed over is drained first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvboost_rag.cancellation import Cancellation, ambient
from kvboost_rag.errors import InvalidInputError, KVBoostError
from kvboost_rag.generation.lifecycle import Requests
from kvboost_rag.generation.started import Pending, Request, drain
from kvboost_rag.request.inputs import check_documents
from kvboost_rag.request.options import GenerationOptions
from kvboost_rag.request.plan import PromptTokens
from kvboost_rag.results import GenerationResult


class Batches:
    """Runs ``generate_batch`` calls for one engine.

    Args:
        requests: The engine's requests.
    """

    def __init__(self, requests: Requests) -> None:
        self.requests = requests
        self.places, self.constraints, self.settings = requests.places, requests.constraints, requests.settings
        self.planner, self.prefiller, self.loop, self.cache = requests.planner, requests.prefiller, requests.loop, requests.cache

    def generate_batch(
        self, prompts: Sequence[str], resolved: GenerationOptions, start: float
    ) -> list[GenerationResult | Exception]:
        """Prefill each prompt, decode them together (see :meth:`kvboost_rag.KVBoost.generate_batch`)."""
        if isinstance(prompts, (str, bytes)):
            raise InvalidInputError("generate_batch takes a list of prompts, not one string: pass [prompt]")
        prompts = list(prompts)
        check_documents(resolved.documents)
        if resolved.constraint is not None:
            # Shared by every prompt: a bad one, or too small a budget for it, fails the call.
            self.constraints.compile(resolved.constraint, resolved.max_new_tokens)
        outputs: list[GenerationResult | Exception | None] = [None] * len(prompts)
        tokenized: list[tuple[int, PromptTokens]] = []
        for i, prompt in enumerate(prompts):
            try:
                tokenized.append((i, self.requests.tokenize(prompt, resolved, f"prompt {i}")))
            except KVBoostError as error:
                outputs[i] = error
        if resolved.reuse:
            self._store_common_beginning([tokens for _, tokens in tokenized])
        cancellation = Cancellation()
        unfollow = cancellation.follow(ambient())
        pending: list[tuple[int, Pending]] = []
        started: list[Request] = []
        waited = 0
        try:
            self._submit_batch(tokenized, resolved, start, cancellation, outputs, pending)
            for waited, (i, waiting) in enumerate(pending, start=1):
                try:
                    request = waiting.wait(self.places)
                except Exception as error:  # noqa: BLE001 - it ends this prompt alone
                    outputs[i] = error
                    continue
                started.append(request)
                outputs[i] = self._follow_to_end(request)
        finally:
            cancellation.cancel()  # what was not followed (an error above) stops
            for _, waiting in pending[waited:]:
                drain(waiting, self.places)
            for request in started:
                request.close(self.places)
                request.release_slot()
            unfollow()
        return cast("list[GenerationResult | Exception]", outputs)  # every entry is set above

    def _submit_batch(
        self,
        tokenized: Sequence[tuple[int, PromptTokens]],
        options: GenerationOptions,
        start: float,
        cancellation: Cancellation,
        outputs: list[GenerationResult | Exception | None],
        pending: list[tuple[int, Pending]],
    ) -> None:
        """Prepare every prompt of a batch and hand them to the loop together (it admits them
        in order as places free up; their passes share its steps), each appended to
        ``pending``. A prompt refused alone gets its error in ``outputs``."""
        try:
            for i, tokens in tokenized:
                try:
                    prepared = self.requests.prepare(tokens, options, start, cancellation=cancellation, until_stored=False)
                except Exception as error:  # noqa: BLE001 - its set-up held nothing yet; it fails alone
                    outputs[i] = error
                    continue
                pending.append((i, prepared))
        finally:  # an interrupt mid-way: those prepared go over too, and are drained by the caller
            self.requests.hand_over([prepared for _, prepared in pending])

    def _follow_to_end(self, request: Request) -> GenerationResult | Exception:
        """A batch prompt's result, or what ended its decoding."""
        follow = self.requests.follow(request, end_at_last_token=True)
        try:
            while True:
                next(follow)
        except StopIteration as stop:
            return stop.value
        except Exception as error:  # noqa: BLE001 - what ended this prompt's decoding ends it alone
            return error

    def _store_common_beginning(self, prompts: Sequence[PromptTokens]) -> None:
        """Compute once, and store, the leading tokens several prompts share (at least one
        chunk), so that each of them reads it as an exact prefix hit instead of computing it;
        nothing is computed when it is stored already."""
        if len(prompts) < 2:
            return
        first = prompts[0]
        common = min(len(p) for p in prompts) - 1  # every prompt computes its last token
        for other in prompts[1:]:
            common = next((j for j in range(common) if other.ids[j] != first.ids[j]), common)
        if common < self.settings.chunk_size:
            return
        tokens = PromptTokens(first.text[: first.offsets[common - 1][1]], first.ids[:common], first.offsets[:common])
        plan = self.planner.plan(tokens, find_documents=False, content_reuse=False, lookup_limit=common)
        outcome = self.loop.run(self.prefiller.steps(plan, self.prefiller.lookup(plan)))
        if outcome.logits is not None:  # something was computed: store it
            self.cache.write_back(plan, outcome, store_documents=False)
