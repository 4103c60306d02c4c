"""``generate_batch``: several prompts prefilled and decoded together.

:class:`Batches` prepares every prompt of a call through the engine's
:class:`~kvboost_rag.generation.lifecycle.Requests` and hands them to the engine loop together
(their passes then share its steps); when a prompt has to wait for a place, those prepared so
far are handed over first and reach their first token, so places can free up. A prompt that
fails (its set-up, its prefill, its decoding) fails alone, with its error in its entry; an
interrupt ends the call, and every prompt already handed over is drained first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
        firsts: dict[int, Request] = {}  # reached their first token while a later prompt waited
        started: list[Request] = []
        waited = 0

        def first_tokens() -> None:
            """A later prompt waits for a place: the prompts handed over reach their first
            token, and those that end there give their places back (nothing else would)."""
            for i, waiting in pending:
                if i not in firsts and outputs[i] is None:
                    try:
                        firsts[i] = waiting.wait(self.places)
                    except Exception as error:  # noqa: BLE001 - it ends this prompt alone
                        outputs[i] = error

        try:
            self._submit_batch(tokenized, resolved, start, cancellation, outputs, pending, first_tokens)
            for waited, (i, waiting) in enumerate(pending, start=1):
                if outputs[i] is not None:
                    continue
                try:
                    request = firsts.pop(i) if i in firsts else waiting.wait(self.places)
                except Exception as error:  # noqa: BLE001 - it ends this prompt alone
                    outputs[i] = error
                    continue
                started.append(request)
                outputs[i] = self._follow_to_end(request)
        finally:
            cancellation.cancel()  # what was not followed (an error above) stops
            for i, waiting in pending[waited:]:
                if i not in firsts and outputs[i] is None:
                    drain(waiting, self.places)
            for request in [*started, *firsts.values()]:
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
        on_full: Callable[[], None],
    ) -> None:
        """Prepare every prompt of a batch and hand them to the loop together (their passes
        then share its steps), each appended to ``pending``; when a prompt has to wait for a
        place, those prepared so far are handed over first and ``on_full`` runs, so places
        can free up. A prompt refused alone gets its error in ``outputs``."""
        held: list[Pending] = []

        def hand_over() -> None:
            self.requests.hand_over(held)
            held.clear()

        def make_room() -> None:
            hand_over()
            on_full()

        try:
            for i, tokens in tokenized:
                try:
                    prepared = self.requests.prepare(
                        tokens, options, start, cancellation=cancellation, on_wait=make_room, until_stored=False
                    )
                except Exception as error:  # noqa: BLE001 - its set-up gave back what it held; it fails alone
                    outputs[i] = error
                    continue
                held.append(prepared)
                pending.append((i, prepared))
        finally:
            hand_over()

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
