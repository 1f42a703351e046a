"""Long-lived processes of the online path (the engine core, API servers, load generators) freeze their start-up
heap out of the garbage collector's reach, so that a generation-2 collection during serving walks only what serving
allocated, not the hundreds of thousands of objects of the model, the engine's tables and the imported modules."""

from __future__ import annotations

import gc
import time


def freeze_heap() -> tuple[int, float]:
    """Run a full collection, then freeze every object still alive (``gc.freeze``). Returns how many objects are
    frozen and the seconds the full collection took (what each generation-2 pause would cost without the freeze)."""
    t0 = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - t0
    gc.freeze()
    return gc.get_freeze_count(), seconds
