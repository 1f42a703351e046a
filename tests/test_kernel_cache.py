"""``cache_engine.kernel_cache.CompiledKernels``: the first launch of a specialisation compiles through the JIT, later
ones call the compiled kernel's launcher directly, with tensors given as their addresses (CPU, with a stand-in for
the jitted function and its compiled kernel; the real launcher runs in the GPU tests of the transfer kernels)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # as the kernels' own tests: Triton imported after this runs their interpreter
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton.compiler import CompiledKernel

from cache_engine.kernel_cache import CompiledKernels


class FakeJit:
    """``kernel[grid](*args, **constants, num_warps=..)`` records the call and returns a compiled kernel whose
    launcher records its arguments."""

    def __init__(self) -> None:
        self.jit_calls: list[tuple] = []
        self.run_calls: list[tuple] = []
        compiled = object.__new__(CompiledKernel)  # a real CompiledKernel's attributes, without compiling
        compiled.module, compiled.function, compiled.packed_metadata = object(), "function", "metadata"
        compiled._run = lambda *args: self.run_calls.append(args)
        self.compiled = compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return launch


def test_later_launches_call_the_launcher_with_addresses_for_tensors():
    jit = FakeJit()
    kernels = CompiledKernels(jit, num_warps=4)
    first, second = torch.zeros(4), torch.arange(6)[2:]
    args, constants = (first, second, 7, 1.5), {"BLOCK": 16, "FLAG": True}
    kernels.launch("key", (3, 2), args, constants, stream=99)
    assert len(jit.jit_calls) == 1 and not jit.run_calls  # compiled through the JIT, with the tensors themselves
    grid, jit_args, jit_kwargs = jit.jit_calls[0]
    assert grid == (3, 2, 1) and jit_args[0] is first and jit_kwargs == {**constants, "num_warps": 4}
    assert len(kernels) == 1

    kernels.launch("key", (5,), args, constants, stream=99)
    assert len(jit.jit_calls) == 1 and len(jit.run_calls) == 1
    launched = jit.run_calls[0]
    assert launched[:9] == (5, 1, 1, 99, "function", "metadata", None, None, None)
    # the tensors as their addresses (a view's own), the other arguments and the constexprs as given
    assert launched[9:] == (first.data_ptr(), second.data_ptr(), 7, 1.5, 16, True)
    assert all(type(value) is int for value in launched[9:11])


def test_a_new_key_compiles_again():
    jit = FakeJit()
    kernels = CompiledKernels(jit, num_warps=4)
    kernels.launch("a", (1,), (torch.zeros(1),), {}, stream=1)
    kernels.launch("b", (1,), (torch.zeros(1),), {}, stream=1)
    assert len(jit.jit_calls) == 2 and not jit.run_calls and len(kernels) == 2
