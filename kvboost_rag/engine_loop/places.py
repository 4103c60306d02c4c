"""Places in the running batch, taken when the engine loop admits a request's prompt work.

The loop admits queued prompt work in arrival order (:mod:`kvboost_rag.engine_loop.loop`): a
request's work takes its place (:meth:`BatchPlaces.try_reserve`) when the batch holds fewer
than ``max_batch_size`` requests (prefilling or decoding) and its K/V buffers keep the
requests' buffers within ``max_batch_cache_bytes`` (one request is always admitted when no
bytes are counted, however large); otherwise it stays queued in the loop, holding nothing. A
place is given back when its sequence leaves the batch, or when its request ends before
decoding. Every change that may make room is told to the listeners (the loop, which then
admits what waits).

The bytes a request reserves are those of the buffers it will be lent (a CPU's host buffers
are lent at exactly the rounded capacity reserved). A reservation made ``until_stored`` keeps its bytes
counted after its place went back, until :meth:`BatchPlaces.release_bytes` (its request handed
its buffers to the write-back, whose copier's queue counts them from there): a finished
request's buffers are never counted nowhere, and while they are held new requests wait for
room instead of memory growing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvboost_rag import forking
from kvboost_rag.config import KVBoostSettings

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Reservation:
    """A request's place in the batch, held from its admission until it leaves.

    Attributes:
        nbytes: Bytes of the K/V buffers its sequence holds.
        released: Whether the place was given back.
        until_stored: Its bytes stay counted after the place went back, until
            :meth:`BatchPlaces.release_bytes`.
        bytes_released: Whether its bytes were given back.
        on_release: Called once when the place is given back (nothing steps its sequence any
            more): what the sequence's steps used may be handed on.
        generation: The places' generation it was made in (a forked child starts a new one:
            a reservation of the parent's counts for nothing there).
    """

    nbytes: int
    released: bool = False
    until_stored: bool = False
    bytes_released: bool = False
    on_release: list[Callable[[], None]] = field(default_factory=list)
    generation: int = 0


class BatchPlaces:
    """The batch's places, shared by every request of one engine; thread-safe.

    Args:
        settings: Engine settings: ``max_batch_size`` and ``max_batch_cache_bytes``, read at
            every admission.
    """

    def __init__(self, settings: KVBoostSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._admitted = 0
        self._admitted_bytes = 0
        self._generation = 0
        self._listeners: list[Callable[[], None]] = []
        forking.register(self)

    @property
    def admitted(self) -> int:
        """Requests holding a place now (prefilling or decoding)."""
        with self._lock:
            return self._admitted

    @property
    def held_bytes(self) -> int:
        """Bytes of K/V buffers counted now: requests holding a place, and finished ones that
        have not handed their buffers to the write-back yet."""
        with self._lock:
            return self._admitted_bytes

    def listen(self, on_room: Callable[[], None]) -> None:
        """Call ``on_room()`` (without the places' lock, on the releasing thread) whenever a
        place or counted bytes are given back."""
        self._listeners.append(on_room)

    def try_reserve(self, nbytes: int) -> Reservation | None:
        """A place for a sequence of ``nbytes`` of K/V buffers if the batch has room for it now,
        else ``None`` (nothing taken). The engine loop calls it, in arrival order."""
        with self._lock:
            if not self._fits(nbytes):
                return None
            self._admitted += 1
            self._admitted_bytes += nbytes
            return Reservation(nbytes, generation=self._generation)

    def release(self, reservation: Reservation) -> None:
        """Give a place back (once; later calls do nothing), with its bytes unless it was made
        ``until_stored``; its ``on_release`` callbacks run here, outside the lock, every one
        of them even when one raises.

        Raises:
            Exception: The first exception a callback raised, once they all ran (the place
                is back whatever they did).
        """
        with self._lock:
            if reservation.released:
                return
            reservation.released = True
            self._admitted -= reservation.generation == self._generation
            if not reservation.until_stored:
                self._free_bytes(reservation)
        callbacks, reservation.on_release = reservation.on_release, []  # no cycle left with a lease
        first: Exception | None = None
        for callback in callbacks:
            try:
                callback()
            except Exception as error:  # noqa: BLE001 - the others still run; the first is raised
                first = first or error
        self._tell_listeners()
        if first is not None:
            raise first

    def release_bytes(self, reservation: Reservation) -> None:
        """Stop counting the reservation's bytes (once; its place goes back on its own)."""
        with self._lock:
            freed = self._free_bytes(reservation)
        if freed:
            self._tell_listeners()

    def _free_bytes(self, reservation: Reservation) -> bool:
        if reservation.bytes_released:
            return False
        reservation.bytes_released = True
        if reservation.generation == self._generation:
            self._admitted_bytes -= reservation.nbytes
        return True

    def _tell_listeners(self) -> None:
        for on_room in self._listeners:
            try:
                on_room()
            except Exception:  # noqa: BLE001 - a listener's fault is not the releasing request's
                logger.exception("a listener of the batch's places failed")

    def _after_fork_in_child(self) -> None:
        """In a forked child: no request of the parent's runs here; every place is free and
        the parent's reservations count for nothing (a new generation)."""
        self._lock = threading.Lock()
        self._admitted = self._admitted_bytes = 0
        self._generation += 1

    def _fits(self, nbytes: int) -> bool:
        if self._admitted >= self._settings.max_batch_size:
            return False
        # Alone (nothing counted: no place held, no finished request's buffers on their way to
        # the write-back), a request is admitted however large; else only within the bound.
        return self._admitted_bytes <= 0 or self._admitted_bytes + nbytes <= self._settings.max_batch_cache_bytes
