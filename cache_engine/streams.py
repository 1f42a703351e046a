"""Cheap CUDA stream switching for the per-step transfer and staging code.

Torch's ``torch.cuda.stream(s)`` context and ``torch.cuda.current_stream()`` of a device without an index first
look the current device up through ``torch.cuda.is_available()`` (environment reads): ~10 us a call on the GPU
machine's host, several times per step. These helpers do the same with an indexed device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index (CUDA: the current device's when none is given). Torch looks the current stream
    of an indexed device up directly; for a bare ``"cuda"`` each lookup first asks whether CUDA is available
    (environment reads; ~10 us a call on the GPU machine's host)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


@contextmanager
def on_stream(stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
    """``torch.cuda.stream(stream)`` for a stream of ``device`` (indexed, see :func:`indexed`): the same effect
    without its two current-device lookups (``torch.cuda.stream`` cost ~10 us a use on the GPU machine's host)."""
    previous = torch.cuda.current_stream(device)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)
