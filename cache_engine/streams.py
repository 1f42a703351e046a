"""Cheap CUDA stream lookups, switching and ordering: :class:`CurrentStream`, :func:`on_stream` and
:class:`StreamFence` do what ``torch.cuda.current_stream``, ``torch.cuda.stream`` and ``Stream.wait_stream`` do,
for a fraction of the host time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index (CUDA: the current device's if none), whose current stream torch looks up directly
    (for a bare ``"cuda"`` each lookup first asks whether CUDA is available)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


class CurrentStream:
    """``torch.cuda.current_stream(device)`` of one CUDA device, cheaply: the ``torch.cuda.Stream`` kept for the
    current stream's raw handle (the call Triton's launcher makes), made by torch when the handle is first seen."""

    def __init__(self, device: torch.device) -> None:
        self.index = indexed(device).index
        self._streams: dict[int, torch.cuda.Stream] = {}

    def __call__(self) -> torch.cuda.Stream:
        raw = torch._C._cuda_getCurrentRawStream(self.index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.index)
        return stream


@contextmanager
def on_stream(stream: torch.cuda.Stream, current: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.stream(stream)`` for ``current``'s device, whose current stream ``current`` is restored on exit,
    without the context's device and stream lookups."""
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(current)


class StreamFence:
    """``waiter.wait_stream(signaller)`` through one kept event (a wait binds to the record at the time of the call,
    so re-recording it never changes an earlier wait)."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event()

    def __call__(self, waiter: torch.cuda.Stream, signaller: torch.cuda.Stream) -> None:
        """Make work queued on ``waiter`` from now on wait for the work queued on ``signaller`` so far."""
        self._event.record(signaller)
        waiter.wait_event(self._event)
