"""Launching a Triton kernel repeatedly at little host cost (this module imports Triton).

A ``@triton.jit`` launch binds its arguments, computes the specialisation key and looks the compiled kernel up on
every call. :class:`CompiledKernels` keeps each specialisation's compiled kernel and then calls its launcher directly,
every argument (constexprs included) in the kernel's order as Triton's own launch does (the kernels' GPU tests catch a
Triton change there), tensors as addresses (the kernels here get only device or pinned host memory). While a launch
hook (a profiler) is registered, launches go through ``CompiledKernel[grid]``, which calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel

#: Triton's element type of each KV dtype the transfer kernels move (for raw addresses cast to pointers).
POINTER_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
                  torch.float8_e4m3fn: tl.float8e4nv}


class CompiledKernels:
    """The compiled kernels of one ``@triton.jit`` function, by specialisation.

    Args:
        kernel: the jitted function; its constexpr parameters must come after all the others.
        num_warps: warps per program of every launch.
    """

    def __init__(self, kernel: Any, num_warps: int) -> None:
        self.kernel, self.num_warps = kernel, num_warps
        # key -> (the compiled kernel, its launcher, its function handle, its packed metadata)
        self._compiled: dict[Hashable, tuple[CompiledKernel, Callable[..., None], Any, Any]] = {}

    def __len__(self) -> int:
        return len(self._compiled)

    def launch(self, key: Hashable, grid: tuple[int, ...], args: tuple[Any, ...], constants: dict[str, Any],
               stream: int | None = None) -> None:
        """Launch on the current stream. ``key`` holds everything Triton specialises on (dtypes, constexpr values,
        pointers' 16-byte alignment, integers equal to 1 or divisible by 16 unless excluded); ``constants``: the
        constexprs, in the kernel's order; ``stream``: the current stream's raw handle, if the caller has it. Under
        Triton's interpreter every launch goes through the JIT (it returns no compiled kernel)."""
        grid = (*grid, 1, 1)[:3]
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constants, num_warps=self.num_warps)
            if isinstance(compiled, CompiledKernel):
                self._compiled[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata)
            return
        compiled, run, function, metadata = entry
        if stream is None or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls:
            compiled[grid](*args, *constants.values(), stream=stream)
            return
        run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None,
            *[arg.data_ptr() if isinstance(arg, torch.Tensor) else arg for arg in args], *constants.values())
