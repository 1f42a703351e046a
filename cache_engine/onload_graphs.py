"""Each step's kernel onload replayed from a CUDA graph: one launch for the host where there was one kernel launch
and one event record per layer (~30 us each on the GPU machine's host within a benchmark step: ~0.3 ms a step).

A graph is captured per capacity, a power of two of pages (at least ``min_capacity``): for each layer, the onload
kernel over index arrays of that capacity in a static pinned host buffer, which the kernels read over PCIe (each
index once), loading the first ``count`` entries (the step's page count, read on the device:
:meth:`~.onload_kernel.OnloadLauncher.all_layers`'s ``count``), then that layer's event recorded as an external event
node, which the model's layer waits for as for an eagerly recorded event. A step writes its indices and count into
the buffer with numpy and replays the graph on the transfer engine's scatter stream: no upload, no allocation. Each
capacity has one buffer per turn (two by default), each with its own graph, used in turn; a buffer is written again
only once the event recorded after its previous replay reports done. If a capture fails, graphs are turned off and
onloads are launched eagerly.

With the ``dma`` engine the kernels read a device staging buffer instead of host memory, and each layer's kernel
must first wait for that layer's copies into it: the graph of turn ``t`` holds, before layer ``l``'s kernel, a wait
on the external event ``waits[t][l]``, which the copies of an onload of that turn record just before its replay
(:meth:`OnloadGraphs.begin` tells the turn). An event of turn ``t`` is recorded again only once the previous replay of
that turn, which waits on it, is done.

Graphs are captured when a capacity is first used, or all at once up to a capacity before serving
(:meth:`OnloadGraphs.capture_all`): a capture costs milliseconds of host time, and the benchmark's first onloads
come only after its warm-up (first visits onload nothing), inside the measured batches.

This module imports Triton (through :mod:`.onload_kernel`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .onload_kernel import OnloadLauncher

logger = logging.getLogger(__name__)


class OnloadGraphs:
    """The captured onloads of one pool and host store.

    Args:
        launcher: launches the onload kernel.
        kv: the pool, ``[L, num_pages, 2, page_size, H, D]``.
        layer_bytes: bytes from one layer of a host page to the next (see
            :func:`~.transfer.host_page_addresses`).
        src_dtype: dtype of the host pages.
        scales: float32 ``[num_slots, L, 2, H]`` FP8 dequantisation scales, or ``None``.
        events: one per layer, created with ``external=True``; recorded by every replay.
        stream: where graphs are captured and replayed (a side stream, never the legacy default stream).
        min_capacity: the smallest capacity captured, in pages.
        waits: per turn, per layer, an external event layer ``l``'s kernel waits for inside the graph (the
            ``dma`` engine's copies into its staging buffer), or ``None``. There are ``len(waits)`` turns (index
            buffers and graphs per capacity, used in turn), else two.
    """

    def __init__(self, launcher: OnloadLauncher, kv: torch.Tensor, layer_bytes: int, src_dtype: torch.dtype,
                 scales: torch.Tensor | None, events: list[torch.cuda.Event], stream: torch.cuda.Stream,
                 min_capacity: int = 256, waits: list[list[torch.cuda.Event]] | None = None) -> None:
        self.launcher, self.kv, self.layer_bytes, self.src_dtype = launcher, kv, layer_bytes, src_dtype
        self.scales, self.events, self.stream, self.min_capacity = scales, events, stream, min_capacity
        self.waits = waits
        # (capacity, turn) -> (graph, its pinned indices as numpy)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, np.ndarray]] = {}
        self._turn = 0
        # per turn: recorded after its latest replay
        self._replayed = [torch.cuda.Event() for _ in range(2 if waits is None else len(waits))]
        self._pinned: list[torch.Tensor] = []  # every graph's index buffer
        self.enabled = True

    def serves(self, kv: torch.Tensor, layer_bytes: int, src_dtype: torch.dtype) -> bool:
        """Whether an onload into ``kv`` from host pages of this layout can be replayed from these graphs."""
        return self.enabled and kv is self.kv and layer_bytes == self.layer_bytes and src_dtype == self.src_dtype

    def begin(self) -> int:
        """The turn the next :meth:`replay` uses, once the previous replay of that turn is done (the host
        waits, rarely): its index buffers may then be written and its ``waits`` events recorded again."""
        replayed = self._replayed[self._turn]
        if not replayed.query():
            replayed.synchronize()
        return self._turn

    def replay(self, pages: np.ndarray, slot_ids: np.ndarray, addresses: np.ndarray) -> bool:
        """Queue the onload of ``pages`` (int64 ``[P]`` pool pages) from host ``addresses`` (int64 ``[P]``, each page's
        first layer) of slots ``slot_ids`` (int64 ``[P]``) on the scatter stream, which must be current; returns
        ``False`` (nothing queued: launch eagerly) if its graph could not be captured."""
        count = len(pages)
        capacity = max(self.min_capacity, 1 << max(count - 1, 0).bit_length())
        turn = self.begin()
        entry = self._graph(capacity, turn)
        if entry is None:
            return False
        self._turn = (turn + 1) % len(self._replayed)
        graph, flat = entry
        flat[:count] = pages  # rows of ``capacity``: pool pages, slot ids, host addresses; then the count
        flat[capacity:capacity + count] = slot_ids
        flat[2 * capacity:2 * capacity + count] = addresses
        flat[-1] = count
        graph.replay()
        self._replayed[turn].record(self.stream)
        return True

    def capture_all(self, max_capacity: int) -> int:
        """Capture the graph of every capacity up to ``max_capacity`` pages for every turn, on the scatter stream
        (current); returns how many graphs there are (0 if a capture failed: graphs are then off)."""
        capacity = self.min_capacity
        while capacity < 2 * max_capacity:
            if any(self._graph(capacity, turn) is None for turn in range(len(self._replayed))):
                return 0
            capacity *= 2
        return len(self._graphs)

    def _graph(self, capacity: int, turn: int) -> tuple[torch.cuda.CUDAGraph, np.ndarray] | None:
        """The graph of this capacity and turn and its indices as numpy, captured now if new; ``None`` if a capture
        failed (graphs are then off: never fail a step over a capture, launch eagerly from now on)."""
        key = (capacity, turn)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(capacity, turn)
            except Exception:
                logger.warning("CUDA graph capture of the onload failed; onloads launch eagerly", exc_info=True)
                self.enabled = False
                return None
        return self._graphs[key]

    def _capture(self, capacity: int, turn: int) -> tuple[torch.cuda.CUDAGraph, np.ndarray]:
        indices = torch.zeros(3 * capacity + 1, dtype=torch.long, pin_memory=True)  # count 0: loads nothing
        dst, slot_ids, src = indices[:capacity], indices[capacity:2 * capacity], indices[2 * capacity:3 * capacity]
        args = (self.kv, src, dst, self.layer_bytes, self.src_dtype, slot_ids if self.scales is not None else None,
                self.scales)
        self.launcher.all_layers(*args, None, self.stream, indices[-1:])  # compiles outside the capture
        waits = None if self.waits is None else self.waits[turn]
        graph = torch.cuda.CUDAGraph()
        # thread_local: the host tier's worker threads may call CUDA (pinning) during the capture
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            self.launcher.all_layers(*args, self.events, self.stream, indices[-1:],
                                     before_group=None if waits is None else lambda layer: self.stream.wait_event(
                                         waits[layer]))
        self._replayed[turn].record(self.stream)  # after the warm-up launches, which read the indices too
        self._pinned.append(indices)  # kept alive: the graph reads it; the numpy view below does not own it
        return graph, indices.numpy()
