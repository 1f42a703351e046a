"""Launching a Triton kernel repeatedly at little host cost.

A ``@triton.jit`` launch binds its arguments, computes the specialisation key and looks the compiled kernel up on
every call (34 us a launch on the GPU machine's host). :class:`CompiledKernels` keeps the compiled kernel the
first launch of each specialisation returns and calls it directly afterwards (13 us,
``benchmarks/results/host_api_costs.json``). This calls Triton's ``CompiledKernel`` with every argument, the
constexprs included, in the kernel's order, as Triton's own launch does; the GPU tests of the kernels that use it
fail if a Triton version changes that.

This module imports Triton.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from triton.compiler import CompiledKernel


class CompiledKernels:
    """The compiled kernels of one ``@triton.jit`` function, by specialisation.

    Args:
        kernel: the jitted function; its constexpr parameters must come after all the others.
        num_warps: warps per program of every launch.
    """

    def __init__(self, kernel: Any, num_warps: int) -> None:
        self.kernel, self.num_warps = kernel, num_warps
        self._compiled: dict[Hashable, CompiledKernel] = {}

    def __len__(self) -> int:
        return len(self._compiled)

    def launch(self, key: Hashable, grid: tuple[int, ...], args: tuple[Any, ...], constants: dict[str, Any]) -> None:
        """Launch on the current stream. ``key`` must hold everything Triton specialises the compiled kernel on
        (dtypes, constexpr values, the 16-byte alignment of pointers, integers equal to 1 or divisible by 16
        unless the kernel excludes them); ``constants`` are the constexprs, in the kernel's order. Under Triton's
        interpreter every launch goes through the JIT (it returns no compiled kernel)."""
        grid = (*grid, 1, 1)[:3]
        compiled = self._compiled.get(key)
        if compiled is not None:
            compiled[grid](*args, *constants.values())
            return
        compiled = self.kernel[grid](*args, **constants, num_warps=self.num_warps)
        if isinstance(compiled, CompiledKernel):
            self._compiled[key] = compiled
