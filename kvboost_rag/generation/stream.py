"""What ``KVBoost.stream`` returns: the text pieces of one request as the engine loop decodes them."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator

from kvboost_rag.cancellation import Cancellation
from kvboost_rag.results import GenerationResult


class GenerationStream:
    """Iterator over generated text pieces; ``result`` is set once it is exhausted.

    Attributes:
        cancellation: The request's cancellation (:meth:`close` sets it).
    """

    def __init__(self, pieces: Iterator[str], cancellation: Cancellation | None = None) -> None:
        self._pieces = pieces
        self.cancellation = cancellation or Cancellation()
        self.result: GenerationResult | None = None
        self._iterating = threading.Lock()  # held by the thread inside next()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        with self._iterating:
            return next(self._pieces)

    def close(self) -> None:
        """Stop the request early (the result stays ``None``); its place and buffers go back.

        Safe from any thread. While another thread is inside ``next()``, that call ends the
        iteration as soon as the request stops (the generator is never touched from two
        threads at once): at once while it waits for a place in the batch or while its prompt
        work waits in the engine loop's queue, at the loop's next step while it prefills or
        decodes. Otherwise the stream's generator is closed here.
        """
        self.cancellation.cancel()
        pieces = self._pieces
        if not inspect.isgenerator(pieces) or not self._iterating.acquire(blocking=False):
            return  # another thread is inside next(): it ends there, seeing the cancellation
        try:
            pieces.close()
        finally:
            self._iterating.release()
