"""Fixed registered buffers handed out one request at a time: the RDMA memory budget.

A ``SlotPool`` cuts one registered region into ``count`` slots of
``slot_bytes`` each.  ``acquire`` waits, first come first served, for a free
slot; ``release`` hands it back.  A slot that a work request may still read
or write (``in_flight``) must not be released: its owner parks it until the
queue pair is destroyed.  Breaking these rules is a bug, so it asserts.
``copy_in`` / ``copy_out`` move a payload into and out of a slot, big ones in
a worker thread so the trio loop never stalls on an 8 MiB memcpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from .._limits import HASH_INLINE_BYTES_MAX


@dataclass(eq=False)
class Slot:
    index: int
    offset: int  # in the pool's region
    view: memoryview
    in_flight: bool = False  # a posted work request may still touch it


class SlotPool:
    def __init__(self, view: memoryview, count: int, slot_bytes: int):
        assert count >= 1 and slot_bytes >= 1 and len(view) >= count * slot_bytes
        self.slot_bytes = slot_bytes
        self.slots = [Slot(i, i * slot_bytes, view[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(count)]
        self._free = list(reversed(self.slots))  # a stack: the slot used last is reused first (still warm)
        self._taken: set[int] = set()
        self._available = trio.Semaphore(count)

    @property
    def count(self) -> int:
        return len(self.slots)

    @property
    def free(self) -> int:
        return len(self._free)

    async def acquire(self) -> Slot:
        """A free slot, waiting for one if needed (cancellation leaves nothing taken)."""
        await self._available.acquire()
        slot = self._free.pop()
        assert slot.index not in self._taken and not slot.in_flight
        self._taken.add(slot.index)
        return slot

    def release(self, slot: Slot) -> None:
        assert slot.index < len(self.slots) and self.slots[slot.index] is slot, "a slot of another pool"
        assert slot.index in self._taken, f"slot {slot.index} released twice"
        assert not slot.in_flight, f"slot {slot.index} released while a work request may still use it"
        self._taken.discard(slot.index)
        self._free.append(slot)
        self._available.release()


def _landed(view: memoryview) -> bytearray:
    """A payload copied out of the registered slot it landed in (tests corrupt it here)."""
    return bytearray(view)


def _fill(view: memoryview, data) -> None:
    with memoryview(data) as source:
        view[: source.nbytes] = source.cast("B")


async def copy_out(view: memoryview, limiter: trio.CapacityLimiter) -> bytearray:
    if len(view) > HASH_INLINE_BYTES_MAX:  # a big copy would stall every other task of the node
        return await trio.to_thread.run_sync(_landed, view, limiter=limiter)
    return _landed(view)


async def copy_in(view: memoryview, data, limiter: trio.CapacityLimiter) -> None:
    if len(data) > HASH_INLINE_BYTES_MAX:
        await trio.to_thread.run_sync(_fill, view, data, limiter=limiter)
    else:
        _fill(view, data)
