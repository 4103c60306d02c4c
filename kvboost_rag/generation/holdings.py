"""A request's memory: its place in the batch, the bytes counted for it and its K/V buffers on loan.

:class:`RequestMemory` takes them together and gives them back in one place. It admits a
request (:meth:`~kvboost_rag.engine_loop.places.BatchPlaces.reserve`), then lends it K/V buffers
(a slot of the captured steps' pool, else buffers of the host pool): when the loan fails, the
place goes back before the error leaves. The loop's hold on the buffers ends when the place goes
back; a request admitted ``until_stored`` keeps its bytes counted until its lent buffers are
back in their pool, whoever read them last (the write-back's copier, a lookup that viewed a
staged chunk), so the batch's bytes bound every lent buffer. :func:`give_back` is the one way
back for a request that did not start.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvboost_rag.cancellation import Cancellation
from kvboost_rag.engine_loop import BatchPlaces, Reservation
from kvboost_rag.generation.host_buffers import HostBufferPool
from kvboost_rag.generation.slots import Lease, SlotLease
from kvboost_rag.hf.captured import SlotPool


class RequestMemory:
    """Places and K/V buffers for the requests of one engine.

    Args:
        places: The batch's places.
        kv_bytes_per_token: Bytes of K and V per position.
        slots: The captured steps' pool, when the engine decodes through captured steps.
        host_buffers: The host buffer pool (a model on the CPU).
    """

    def __init__(
        self, places: BatchPlaces, kv_bytes_per_token: int, slots: SlotPool | None = None,
        host_buffers: HostBufferPool | None = None,
    ) -> None:
        self.places, self.kv_bytes_per_token = places, kv_bytes_per_token
        self.slots, self.host_buffers = slots, host_buffers

    def admit(
        self, capacity: int, cancellation: Cancellation, on_wait: Callable[[], None] | None = None,
        until_stored: bool = True,
    ) -> tuple[Reservation, Lease | None]:
        """Wait for a place for ``capacity`` positions, then lend their buffers.

        Args:
            capacity: Positions of K/V the request writes.
            cancellation: Ends the wait once set.
            on_wait: Called once if it must wait for a place.
            until_stored: Its bytes stay counted after its place went back, until its lent
                buffers are back (else they go with the place).

        Returns:
            Its place and its buffers on loan (``None``: buffers of its own).

        Raises:
            RequestCancelled: ``cancellation`` was set before a place came.
        """
        reservation = self.places.reserve(self.reserved_bytes(capacity), cancellation, on_wait)
        reservation.until_stored = until_stored
        lease: Lease | None = None
        try:
            lease = self.lend(capacity)
            if lease is not None:
                reservation.on_release.append(partial(lease.release, "decode"))
                if until_stored:
                    lease.when_returned(partial(self.places.release_bytes, reservation))
        except BaseException:
            give_back(self.places, reservation, lease)
            raise
        return reservation, lease

    def lend(self, capacity: int) -> Lease | None:
        """K/V buffers of ``capacity`` tokens on loan: a slot of the captured steps' pool, else
        buffers of the host pool; ``None`` (buffers of its own) when neither lends any."""
        lease = None if self.slots is None else SlotLease.take(self.slots, capacity)
        if lease is None and self.host_buffers is not None:
            lease = self.host_buffers.lease(capacity)
        return lease

    def reserved_bytes(self, capacity: int) -> int:
        """Bytes the K/V buffers of ``capacity`` positions take: as the host pool rounds them
        when it lends them, else exactly."""
        if self.host_buffers is not None:
            capacity = self.host_buffers.capacity_for(capacity)
        return self.kv_bytes_per_token * capacity


def give_back(places: BatchPlaces, reservation: Reservation, lease: Lease | None) -> None:
    """Everything a request that did not start holds: its place, its counted bytes, its
    buffers (each given back once, whatever was given back before)."""
    try:
        places.release(reservation)  # its callbacks release the lease's "decode" hold
    finally:
        places.release_bytes(reservation)
        if lease is not None:
            lease.release("request")
