"""Places in the running batch: requests admitted first come, first served.

A request reserves its place before its prefill (:meth:`BatchPlaces.reserve`) and waits while
the batch holds ``max_batch_size`` requests (prefilling or decoding), or while its K/V buffers
would take the requests' buffers past ``max_batch_cache_bytes`` (one request is always admitted
when no bytes are counted, however large). A place is given back when its sequence leaves the batch, or
when its request ends before decoding; a request's cancellation ends its wait.

The bytes a request reserves are those of the buffers it will be lent (a CPU's host buffers
are lent at exactly the rounded capacity reserved). A reservation made ``until_stored`` keeps its bytes
counted after its place went back, until :meth:`BatchPlaces.release_bytes` (its request handed
its buffers to the write-back, whose copier's queue counts them from there): a finished
request's buffers are never counted nowhere, and while they are held new requests wait for
room instead of memory growing.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvboost_rag import forking
from kvboost_rag.cancellation import Cancellation, wait_while
from kvboost_rag.config import KVBoostSettings


@dataclass(eq=False)
class Reservation:
    """A request's place in the batch, held from before its prefill until it leaves.

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
        self._state = threading.Condition()
        self._waiting: deque[Reservation] = deque()
        self._admitted = 0
        self._admitted_bytes = 0
        self._generation = 0
        forking.register(self)

    @property
    def admitted(self) -> int:
        """Requests holding a place now (prefilling or decoding)."""
        with self._state:
            return self._admitted

    @property
    def held_bytes(self) -> int:
        """Bytes of K/V buffers counted now: requests holding a place, and finished ones that
        have not handed their buffers to the write-back yet."""
        with self._state:
            return self._admitted_bytes

    @property
    def waiting(self) -> int:
        """Requests waiting for a place now."""
        with self._state:
            return len(self._waiting)

    def reserve(
        self, nbytes: int, cancellation: Cancellation | None = None, on_wait: Callable[[], None] | None = None
    ) -> Reservation:
        """Wait, in arrival order, for a place for a sequence of ``nbytes`` of K/V buffers.

        Args:
            nbytes: Bytes of the K/V buffers its prefill allocates.
            cancellation: The request's: once set, it leaves the line.
            on_wait: Called once (without the lock) if there is no place now, before waiting
                for one (a batch hands the engine loop the prompts it holds back, so their
                places can free up).

        Raises:
            RequestCancelled: ``cancellation`` was set before a place came.
        """
        reservation = Reservation(nbytes, generation=self._generation)
        with self._state:
            self._waiting.append(reservation)
            ready = self._waiting[0] is reservation and self._fits(nbytes)
        if not ready and on_wait is not None:
            try:
                on_wait()
            except BaseException:  # a raising callback must not leave a dead reservation ahead of the line
                with self._state:
                    self._waiting.remove(reservation)
                    self._state.notify_all()
                raise
        with self._state:
            try:
                wait_while(
                    self._state, lambda: self._waiting[0] is not reservation or not self._fits(nbytes), cancellation
                )
            except BaseException:  # interrupted while waiting: leave the line
                self._waiting.remove(reservation)
                self._state.notify_all()
                raise
            self._waiting.popleft()
            self._admitted += 1
            self._admitted_bytes += nbytes
            self._state.notify_all()
        return reservation

    def release(self, reservation: Reservation) -> None:
        """Give a place back (once; later calls do nothing), with its bytes unless it was made
        ``until_stored``; its ``on_release`` callbacks run here, outside the lock, every one
        of them even when one raises.

        Raises:
            Exception: The first exception a callback raised, once they all ran (the place
                is back whatever they did).
        """
        with self._state:
            if reservation.released:
                return
            reservation.released = True
            self._admitted -= reservation.generation == self._generation
            if not reservation.until_stored:
                self._free_bytes(reservation)
            self._state.notify_all()
        callbacks, reservation.on_release = reservation.on_release, []  # no cycle left with a lease
        first: Exception | None = None
        for callback in callbacks:
            try:
                callback()
            except Exception as error:  # noqa: BLE001 - the others still run; the first is raised
                first = first or error
        if first is not None:
            raise first

    def release_bytes(self, reservation: Reservation) -> None:
        """Stop counting the reservation's bytes (once; its place goes back on its own)."""
        with self._state:
            self._free_bytes(reservation)
            self._state.notify_all()

    def _free_bytes(self, reservation: Reservation) -> None:
        if not reservation.bytes_released:
            reservation.bytes_released = True
            if reservation.generation == self._generation:
                self._admitted_bytes -= reservation.nbytes

    def _after_fork_in_child(self) -> None:
        """In a forked child: no request of the parent's runs or waits here; every place is
        free and the parent's reservations count for nothing (a new generation)."""
        self._state = threading.Condition()
        self._waiting.clear()
        self._admitted = self._admitted_bytes = 0
        self._generation += 1

    def _fits(self, nbytes: int) -> bool:
        if self._admitted >= self._settings.max_batch_size:
            return False
        # Alone (nothing counted: no place held, no finished request's buffers on their way to
        # the write-back), a request is admitted however large; else only within the bound.
        return self._admitted_bytes <= 0 or self._admitted_bytes + nbytes <= self._settings.max_batch_cache_bytes
