"""A request's memory: its place in the batch, the bytes counted for it and its K/V buffers on loan.

:class:`RequestMemory` takes them together and gives them back in one place. The engine loop
admits a request's work (:meth:`RequestMemory.admission`) when the batch has room for it
(:meth:`~kvboost_rag.engine_loop.places.BatchPlaces.try_reserve`), then lends it K/V buffers
(a slot of the captured steps' pool, else buffers of the host pool): when the loan fails, the
place goes back before the error leaves. The loop's hold on the buffers ends when the place goes
back; a request admitted ``until_stored`` keeps its bytes counted until its lent buffers are
back in their pool, whoever read them last (the write-back's copier, a lookup that viewed a
staged chunk), so the batch's bytes bound every lent buffer. :func:`give_back` is the one way
back for a request that did not start.
"""

from __future__ import annotations

from functools import partial

from kvboost_rag.engine_loop import Admission, BatchPlaces, Reservation
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

    def admission(self, capacity: int, until_stored: bool = True) -> Admission[tuple[Reservation, Lease | None]]:
        """What a request's work must be granted before the loop starts it: a place for
        ``capacity`` positions and their buffers (:meth:`try_admit`).

        Args:
            capacity: Positions of K/V the request writes.
            until_stored: Its bytes stay counted after its place went back, until its lent
                buffers are back (else they go with the place).
        """
        return Admission(partial(self.try_admit, capacity, until_stored))

    def try_admit(self, capacity: int, until_stored: bool = True) -> tuple[Reservation, Lease | None] | None:
        """A place for ``capacity`` positions and their buffers on loan if the batch has room
        now, else ``None`` (nothing taken).

        Returns:
            Its place and its buffers on loan (``None``: buffers of its own), or ``None``.

        Raises:
            Exception: Lending the buffers failed (the place went back first).
        """
        reservation = self.places.try_reserve(self.reserved_bytes(capacity))
        if reservation is None:
            return None
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
