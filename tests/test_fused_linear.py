"""The projection with its SiLU in the GEMM's epilogue (:mod:`gr_engine.models.fused_linear`) against cuBLAS (or
torch's CPU GEMM) then the SiLU. CPU runs the kernel in Triton's interpreter (``TRITON_INTERPRET=1`` set before the
module imports Triton), in float16: the interpreter's ``tl.dot`` misreads bfloat16. The ``gpu`` tests check bf16 and
fp16 on CUDA, the HSTU layer at the bench's widths, CUDA-graph capture and that new row counts compile nothing."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from gr_engine import ModelConfig
from gr_engine.models import GRModel
from tests.conftest import requires_cuda

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float16]
# The kernel rounds silu(x @ W.T + b), accumulated in float32, once; against the same sum in float64 rounded once it
# is at most one unit in the last place off (a float32 sum in another order can cross a rounding boundary): 2**-7
# relative for bf16, 2**-10 for fp16, with an absolute term of the same size for values near zero.
TOL = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


def operands(num_rows: int, width: int, out_width: int, dtype: torch.dtype,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [num_rows, width]``, ``weight [out_width, width]`` (nn.Linear's scale) and ``bias [out_width]``."""
    x = torch.randn(num_rows, width, generator=gen)
    weight = torch.randn(out_width, width, generator=gen) / width**0.5
    bias = 0.5 * torch.randn(out_width, generator=gen)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``silu(x @ weight.T + bias)`` in float64, rounded once to ``x``'s dtype."""
    return F.silu(F.linear(x.double(), weight.double(), bias.double())).to(x.dtype)


def assert_one_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    expected = exact(x, weight, bias)
    assert got.dtype == x.dtype and got.shape == expected.shape and got.is_contiguous()
    tol = TOL[x.dtype]
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "out_width"), [(64, 256), (72, 136), (32, 8)])  # 72 x 136: partial tiles
@pytest.mark.parametrize("num_rows", [1, 33, 300])
def test_linear_silu_rounds_once(num_rows, width, out_width, dtype):
    from gr_engine.models.fused_linear import linear_silu

    gen = torch.Generator().manual_seed(num_rows * width + out_width)
    x, weight, bias = operands(num_rows, width, out_width, dtype, gen)
    assert_one_rounding(linear_silu(x, weight, bias), x, weight, bias)
    strided = operands(num_rows, 3 * width, out_width, dtype, gen)[0][:, width:2 * width]  # rows 3 * width apart
    assert_one_rounding(linear_silu(strided, weight, bias), strided, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_silu_is_as_close_as_the_unfused_ops(dtype):
    """At the bench's widths (512 -> 2048), the kernel is no farther from the exact result than torch's GEMM then
    SiLU, which rounds twice."""
    from gr_engine.models.fused_linear import linear_silu

    x, weight, bias = operands(257, 512, 2048, dtype, torch.Generator().manual_seed(1))
    expected = exact(x, weight, bias).double()
    fused_error = (linear_silu(x, weight, bias).double() - expected).abs().max()
    unfused_error = (F.silu(F.linear(x, weight, bias)).double() - expected).abs().max()
    assert fused_error <= unfused_error


def test_zero_rows_and_unsupported_inputs():
    from gr_engine.models.fused_linear import linear_silu, supports

    x, weight, bias = operands(4, 64, 128, torch.float16, torch.Generator().manual_seed(2))
    empty = linear_silu(x[:0], weight, bias)
    assert empty.shape == (0, 128) and empty.dtype == torch.float16
    assert supports(x, weight)
    for bad_x, bad_w in ((x.float(), weight.float()), (x, weight.bfloat16()), (x[:, 1:57], weight[:, :56]),
                         (x[:, :60], weight[:, :60]), (x, weight[:100]), (x[None], weight), (x, weight.T)):
        assert not supports(bad_x, bad_w)
        with pytest.raises(ValueError, match="must be bf16 or fp16 alike"):
            linear_silu(bad_x, bad_w, bias[:bad_w.shape[0]])
    with pytest.raises(ValueError, match=r"bias must be contiguous \[128\]"):
        linear_silu(x, weight, bias[:64])


def test_fp16_layer_takes_the_kernel_and_equals_the_torch_path():
    """An HSTU layer in float16 on the fused path (the norms, the gate and the projection's kernel) against torch's
    ops; float32 layers keep torch's projection (their fused path is checked in ``test_fused_ops``)."""
    from gr_engine.models import fused_linear

    config = ModelConfig(num_items=50, d_model=64, num_layers=1, num_heads=2, head_dim=32)
    layer = GRModel(config).to(DEVICE, torch.float16).layers[0]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(45, 64, generator=gen).to(DEVICE, torch.float16)
    calls = []
    kernel = fused_linear.linear_silu

    def counted(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    def attend(q, k, v, time_bias):  # causal SiLU attention, no cache (normaliser T)
        logits = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * q.shape[-1] ** -0.5
        causal = torch.ones(len(q), len(q), dtype=torch.bool, device=q.device).tril()
        weights = torch.where(causal, F.silu(logits), 0.0) / len(q)
        return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)

    fused_linear.linear_silu = counted
    try:
        with torch.no_grad():
            fused, unfused = layer(x, attend, fused=True), layer(x, attend, fused=False)
            layer.float()(x.float(), attend, fused=True)
    finally:
        fused_linear.linear_silu = kernel
    assert calls == [(45, 64)]  # the float16 call only
    # the SiLU's and the gate's roundings (one fp16 unit each) through the output Linear into the residual
    torch.testing.assert_close(fused, unfused, rtol=2**-8, atol=2**-8)


@pytest.mark.gpu
@requires_cuda
def test_new_row_counts_compile_nothing_and_graphs_capture():
    from gr_engine.compile_watch import CompileWatch
    from gr_engine.models.fused_linear import linear_silu

    gen = torch.Generator().manual_seed(4)
    x, weight, bias = operands(33, 512, 2048, torch.bfloat16, gen)
    for num_rows in (33, 1000):  # warm-up: this shape of model's compilations, both tile shapes
        linear_silu(operands(num_rows, 512, 2048, torch.bfloat16, gen)[0], weight, bias)
    watch = CompileWatch()
    for num_rows in (1, 7, 256, 257, 300, 4096, 8292, 78_001):
        x = operands(num_rows, 512, 2048, torch.bfloat16, gen)[0]
        assert_one_rounding(linear_silu(x, weight, bias), x, weight, bias)
    assert (watch.compilations, watch.cache_loads) == (0, 0), list(watch.last_names)

    x = operands(1000, 512, 2048, torch.bfloat16, gen)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear_silu(x, weight, bias)  # warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear_silu(x, weight, bias)
    for _ in range(2):  # replays read the input's new values
        x.copy_(operands(1000, 512, 2048, torch.bfloat16, gen)[0])
        graph.replay()
        assert_one_rounding(out, x, weight, bias)
