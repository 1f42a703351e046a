"""Counting Triton kernel compilations, the stalls a serving engine must not have after warm-up.

Compiling a Triton kernel takes from a fraction of a second to seconds; loading one from Triton's disk cache takes
milliseconds. Either, inside a step, delays every request of the batch. :class:`CompileWatch` counts both through
Triton's compilation listener, which is process-wide: an engine counts the compilations of every kernel its process
launches (its own, and any other engine's in the same process).
"""

from __future__ import annotations

import importlib.util
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StallCounts:
    """What an engine has compiled or captured since it was built (:meth:`~gr_engine.GREngine.stalls`): after
    :meth:`~gr_engine.GREngine.warmup`, serving must not change them.

    Attributes:
        kernel_compilations: Triton kernels compiled (:class:`CompileWatch`).
        kernel_cache_loads: Triton kernels loaded from Triton's disk cache.
        graph_captures: step graphs captured (:attr:`~gr_engine.step_graphs.StepGraphs.num_graphs`).
    """

    kernel_compilations: int
    kernel_cache_loads: int
    graph_captures: int


NAMES_KEPT = 16


class CompileWatch:
    """Counts this process's Triton compilations from its creation on.

    Args:
        listen: install the listener (an engine on CPU, or without Triton, does not: nothing compiles there).

    Attributes:
        compilations: kernels compiled (Triton's disk cache missed).
        cache_loads: kernels loaded from Triton's disk cache.
        last_names: the names of the latest :data:`NAMES_KEPT` kernels compiled or loaded (to tell which).
    """

    def __init__(self, listen: bool = True) -> None:
        self.compilations = 0
        self.cache_loads = 0
        self.last_names: deque[str] = deque(maxlen=NAMES_KEPT)
        if not listen or importlib.util.find_spec("triton") is None:
            return
        from triton import knobs

        previous: Callable[..., None] | None = knobs.compilation.listener

        def listener(*args: Any, cache_hit: bool, **kwargs: Any) -> None:
            self.last_names.append(str(kwargs.get("metadata", {}).get("name")))
            if cache_hit:
                self.cache_loads += 1
            else:
                self.compilations += 1
            if previous is not None:  # another watch (or a user's listener) installed before this one
                previous(*args, cache_hit=cache_hit, **kwargs)

        knobs.compilation.listener = listener
