"""The pinned index ring (:class:`cache_engine.transfer.PinnedIndexRing`): buffers handed out in turn, a buffer
rewritten only once its last reader is done, grown when too small."""

from __future__ import annotations

import pytest

from cache_engine.transfer import PinnedIndexRing


class FakeEvent:
    """An event that reports done only after ``polls`` queries, or once waited for."""

    def __init__(self, polls: int) -> None:
        self.polls, self.waited = polls, False

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.waited = True


def test_buffers_are_used_in_turn_and_rewritten_only_after_their_reader():
    ring = PinnedIndexRing(depth=3, pin=False)
    taken, readers = [], [FakeEvent(polls=100), FakeEvent(polls=0), FakeEvent(polls=100)]  # busy, done, busy
    for reader in readers:
        taken.append(ring.take(10))
        ring.guard(reader)
    assert len({t.data_ptr() for t in taken}) == 3 and not any(r.waited for r in readers)
    assert ring.take(10).data_ptr() == taken[0].data_ptr() and readers[0].waited  # its reader is busy: waited for
    ring.guard(None)
    assert ring.take(10).data_ptr() == taken[1].data_ptr() and not readers[1].waited  # done: taken at once
    ring.guard(None)


def test_a_done_reader_is_not_waited_for_and_small_buffers_grow():
    ring = PinnedIndexRing(depth=1, pin=False)
    first = ring.take(3)
    assert first.numel() == 3 and first.dtype.is_floating_point is False
    done = FakeEvent(polls=0)
    ring.guard(done)
    grown = ring.take(1000)
    assert not done.waited and grown.numel() == 1000
    grown[:] = 7  # the whole view is writable memory of the buffer
    ring.guard(None)  # nothing reads it: never waited for
    assert ring.take(1000).data_ptr() == grown.data_ptr()


def test_a_ring_needs_a_buffer():
    with pytest.raises(ValueError, match="at least one"):
        PinnedIndexRing(depth=0)
