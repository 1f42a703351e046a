"""Each step's kernel onload replayed from a CUDA graph: one launch for the host where there was one kernel launch
and one event record per layer (~30 us each on the GPU machine's host within a benchmark step: ~0.3 ms a step).

A graph is captured per capacity, a power of two of pages (at least ``min_capacity``): for each layer, the onload
kernel over index arrays of that capacity in a static pinned host buffer, which the kernels read over PCIe (each
index once), loading the first ``count`` entries (the step's page count, read on the device:
:meth:`~.onload_kernel.OnloadLauncher.all_layers`'s ``count``), then that layer's event recorded as an external event
node, which the model's layer waits for as for an eagerly recorded event. A step writes its indices and count into
the buffer with numpy and replays the graph on the transfer engine's scatter stream: no upload, no allocation. Each
capacity has two buffers, each with its own graph, used in turn; a buffer is written again only once the event
recorded after its previous replay reports done. If a capture fails, graphs are turned off and onloads are launched
eagerly.

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
    """

    def __init__(self, launcher: OnloadLauncher, kv: torch.Tensor, layer_bytes: int, src_dtype: torch.dtype,
                 scales: torch.Tensor | None, events: list[torch.cuda.Event], stream: torch.cuda.Stream,
                 min_capacity: int = 256) -> None:
        self.launcher, self.kv, self.layer_bytes, self.src_dtype = launcher, kv, layer_bytes, src_dtype
        self.scales, self.events, self.stream, self.min_capacity = scales, events, stream, min_capacity
        # (capacity, turn) -> (graph, its pinned indices as numpy, the event recorded after its last replay)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, np.ndarray, torch.cuda.Event]] = {}
        self._turn = 0
        self._pinned: list[torch.Tensor] = []  # every graph's index buffer
        self.enabled = True

    def serves(self, kv: torch.Tensor, layer_bytes: int, src_dtype: torch.dtype) -> bool:
        """Whether an onload into ``kv`` from host pages of this layout can be replayed from these graphs."""
        return self.enabled and kv is self.kv and layer_bytes == self.layer_bytes and src_dtype == self.src_dtype

    def replay(self, pages: np.ndarray, slot_ids: np.ndarray, addresses: np.ndarray) -> bool:
        """Queue the onload of ``pages`` (int64 ``[P]`` pool pages) from host ``addresses`` (int64 ``[P]``, each page's
        first layer) of slots ``slot_ids`` (int64 ``[P]``) on the scatter stream, which must be current; returns
        ``False`` (nothing queued: launch eagerly) if its graph could not be captured."""
        count = len(pages)
        capacity = max(self.min_capacity, 1 << max(count - 1, 0).bit_length())
        key = (capacity, self._turn)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(capacity)
            except Exception:  # never fail a step over a capture: launch eagerly from now on
                logger.warning("CUDA graph capture of the onload failed; onloads launch eagerly", exc_info=True)
                self.enabled = False
                return False
        self._turn ^= 1
        graph, flat, replayed = self._graphs[key]
        if not replayed.query():
            replayed.synchronize()  # its previous replay (two onloads ago) may still read the indices
        flat[:count] = pages  # rows of ``capacity``: pool pages, slot ids, host addresses; then the count
        flat[capacity:capacity + count] = slot_ids
        flat[2 * capacity:2 * capacity + count] = addresses
        flat[-1] = count
        graph.replay()
        replayed.record(self.stream)
        return True

    def _capture(self, capacity: int) -> tuple[torch.cuda.CUDAGraph, np.ndarray, torch.cuda.Event]:
        indices = torch.zeros(3 * capacity + 1, dtype=torch.long, pin_memory=True)  # count 0: loads nothing
        dst, slot_ids, src = indices[:capacity], indices[capacity:2 * capacity], indices[2 * capacity:3 * capacity]
        args = (self.kv, src, dst, self.layer_bytes, self.src_dtype, slot_ids if self.scales is not None else None,
                self.scales)
        self.launcher.all_layers(*args, None, self.stream, indices[-1:])  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        # thread_local: the host tier's worker threads may call CUDA (pinning) during the capture
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            self.launcher.all_layers(*args, self.events, self.stream, indices[-1:])
        replayed = torch.cuda.Event()
        replayed.record(self.stream)  # after the warm-up launches, which read the indices too
        self._pinned.append(indices)  # kept alive: the graph reads it; the numpy view below does not own it
        return graph, indices.numpy(), replayed
