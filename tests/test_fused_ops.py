"""The fused kernels of the HSTU layer's CUDA path (:mod:`gr_engine.models.fused_ops`) against the unfused torch ops.
CPU runs them in Triton's interpreter (``TRITON_INTERPRET=1`` is set before the module imports Triton, as in
``test_onload_kernel``); the ``gpu`` tests check bf16 on CUDA, CUDA-graph capture and that new row counts compile
nothing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gr_engine import ModelConfig
from gr_engine.models import GRModel
from gr_engine.models.layers import HSTULayer
from tests.conftest import requires_cuda

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6

# float32: both sides compute LN in float32 but sum the mean and variance in different orders (torch's vectorised
# loops; the interpreter's numpy or the GPU's tree), so normalised values (|.| up to ~5) differ by a few float32 ulps,
# ~1e-6 absolute; the gate multiplies that by |u| (up to ~5 here), hence 1e-5 for it.
# bf16 / fp16: the kernels round once, the torch ops twice (LN(attn), then the product); the interpreter's float32 ->
# bf16 conversion truncates rather than rounds. Each costs at most one unit in the last place (at most 2**-7 relative
# for bf16, 2**-10 for fp16), so two: rtol 2**-6 (bf16), 2**-9 (fp16), and an absolute term of the same size for values
# near zero.
LN_TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2**-6, 2**-6), torch.float16: (2**-9, 2**-9)}
GATE_TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (2**-6, 2**-6), torch.float16: (2**-9, 2**-9)}


def affine(width: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A LayerNorm's ``weight, bias`` ``[width]`` as the model initialises them (``1 + 0.1 z``, ``0.1 z``)."""
    weight = 1.0 + 0.1 * torch.randn(width, generator=gen)
    bias = 0.1 * torch.randn(width, generator=gen)
    return weight.to(DEVICE, dtype), bias.to(DEVICE, dtype)


def rows(num_rows: int, width: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[num_rows, width]`` values with a per-row offset and scale (LN has something to remove)."""
    values = torch.randn(num_rows, width, generator=gen) * (1 + 3 * torch.rand(num_rows, 1, generator=gen))
    return (values + torch.randn(num_rows, 1, generator=gen)).to(DEVICE, dtype)


def unfused_gate(attn: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 concat_ua: bool) -> torch.Tensor:
    """``HSTULayer``'s torch ops: ``u * LN(attn)``, or ``[u, attn, u * LN(attn)]``."""
    normed = F.layer_norm(attn, (attn.shape[1],), weight, bias, EPS)
    return torch.cat([u, attn, u * normed], dim=-1) if concat_ua else u * normed


def assert_close(got: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert got.dtype == expected.dtype and got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [32, 48, 64, 512])  # 48: a padded row (masked columns)
@pytest.mark.parametrize("num_rows", [1, 7, 33, 300])
def test_layer_norm_equals_torch(num_rows, width, dtype):
    from gr_engine.models.fused_ops import layer_norm

    gen = torch.Generator().manual_seed(num_rows * width)
    x = rows(num_rows, width, dtype, gen)
    weight, bias = affine(width, dtype, gen)
    assert_close(layer_norm(x, weight, bias, EPS), F.layer_norm(x, (width,), weight, bias, EPS), LN_TOL[dtype])
    wide = rows(num_rows, 3 * width, dtype, gen)[:, width:2 * width]  # rows 3 * width apart, offset start
    assert_close(layer_norm(wide, weight, bias, EPS), F.layer_norm(wide, (width,), weight, bias, EPS), LN_TOL[dtype])


@pytest.mark.parametrize("concat_ua", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [32, 48, 64, 512])
@pytest.mark.parametrize("num_rows", [1, 7, 33, 300])
def test_gated_attn_norm_equals_torch_with_strided_u(num_rows, width, dtype, concat_ua):
    from gr_engine.models.fused_ops import gated_attn_norm

    gen = torch.Generator().manual_seed(num_rows * width + concat_ua)
    attn = rows(num_rows, width, dtype, gen)
    weight, bias = affine(width, dtype, gen)
    uvqk = rows(num_rows, 4 * width, dtype, gen)
    for u in uvqk.split(width, dim=1)[:2]:  # rows 4 * width apart, at the start of the row and past it
        got = gated_attn_norm(attn, u, weight, bias, EPS, concat_ua)
        expected = unfused_gate(attn, u, weight, bias, concat_ua)
        assert_close(got, expected, GATE_TOL[dtype])
        if concat_ua:  # u and attn are copied exactly
            torch.testing.assert_close(got[:, :2 * width], expected[:, :2 * width], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 512])
@pytest.mark.parametrize("num_rows", [1, 33, 300])
def test_layer_norm_and_shift_equals_torch(num_rows, width, dtype):
    """``LN(x)`` and ``x + shift`` (the residual plus the output bias) from one kernel, ``x`` strided too."""
    from gr_engine.models.fused_ops import layer_norm_and_shift

    gen = torch.Generator().manual_seed(num_rows + width)
    weight, bias = affine(width, dtype, gen)
    shift = (0.1 * torch.randn(width, generator=gen)).to(DEVICE, dtype)
    for x in (rows(num_rows, width, dtype, gen), rows(num_rows, 3 * width, dtype, gen)[:, width:2 * width]):
        normed, shifted = layer_norm_and_shift(x, weight, bias, EPS, shift)
        assert_close(normed, F.layer_norm(x, (width,), weight, bias, EPS), LN_TOL[dtype])
        # float32: one add, as torch's; bf16: one rounding (the interpreter truncates: one unit in the last place)
        assert_close(shifted, x + shift, (0, 0) if dtype == torch.float32 else (2**-7, 2**-7))


@pytest.mark.parametrize("concat_ua", [False, True])
def test_zero_rows_give_empty_outputs(concat_ua):
    from gr_engine.models.fused_ops import gated_attn_norm, layer_norm

    gen = torch.Generator().manual_seed(0)
    weight, bias = affine(64, torch.bfloat16, gen)
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    u = torch.empty(0, 256, dtype=torch.bfloat16, device=DEVICE)[:, :64]
    assert layer_norm(empty, weight, bias, EPS).shape == (0, 64)
    out = gated_attn_norm(empty, u, weight, bias, EPS, concat_ua)
    assert out.shape == (0, 192 if concat_ua else 64) and out.dtype == torch.bfloat16


def test_unsupported_inputs_raise_clear_errors():
    from gr_engine.models.fused_ops import MAX_WIDTH, gated_attn_norm, layer_norm, layer_norm_and_shift

    gen = torch.Generator().manual_seed(0)
    weight, bias = affine(32, torch.float32, gen)
    x = rows(4, 32, torch.float32, gen)
    with pytest.raises(ValueError, match="1 to 4096 values"):
        wide = torch.zeros(2, 2 * MAX_WIDTH, device=DEVICE)
        layer_norm(wide, *affine(2 * MAX_WIDTH, torch.float32, gen), EPS)
    with pytest.raises(ValueError, match="2-D"):
        layer_norm(x[None], weight, bias, EPS)
    with pytest.raises(ValueError, match="2-D bf16, fp16 or fp32"):
        layer_norm(x.double(), weight, bias, EPS)
    with pytest.raises(ValueError, match="unit column stride"):
        layer_norm(rows(32, 4, torch.float32, gen).T, weight, bias, EPS)
    with pytest.raises(ValueError, match=r"weight must be contiguous \[32\]"):
        layer_norm(x, weight[:16], bias, EPS)
    with pytest.raises(ValueError, match=r"shift must be contiguous \[32\]"):
        layer_norm_and_shift(x, weight, bias, EPS, bias[:16])
    with pytest.raises(ValueError, match="u must be like attn"):
        gated_attn_norm(x, x.bfloat16(), weight, bias, EPS, False)
    with pytest.raises(ValueError, match="u must be like attn"):
        gated_attn_norm(x, x[:3], weight, bias, EPS, False)


def dense_silu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      time_bias: torch.Tensor | None) -> torch.Tensor:
    """Causal SiLU attention over ``[T, H, D]`` (normaliser ``T``): the layer's attention, no cache."""
    length = q.shape[0]
    logits = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    weights = torch.where(causal, F.silu(logits), 0.0) / length
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


@pytest.mark.parametrize("concat_ua", [False, True])
def test_hstu_layer_fused_equals_unfused(concat_ua):
    config = ModelConfig(num_items=50, d_model=64, num_layers=2, num_heads=2, head_dim=16, concat_ua=concat_ua)
    model = GRModel(config).to(DEVICE)  # LayerNorm weights and biases away from 1 and 0
    x = rows(37, 64, torch.float32, torch.Generator().manual_seed(2))
    with torch.no_grad():
        for layer in model.layers:
            unfused, fused = layer(x, dense_silu_attend, fused=False), layer(x, dense_silu_attend, fused=True)
            assert_close(fused, unfused, (1e-5, 1e-5))  # float32: the norms' and gate's ulps through two Linears
            x = unfused
        assert_close(model.final_norm(x, fused=True), model.final_norm(x, fused=False), LN_TOL[torch.float32])


def test_fused_layer_runs_no_add_and_accumulates_the_output_gemm_in_place():
    """On the fused path the residual add is the output GEMM's own accumulation into ``x + bias`` (an in-place
    ``addmm_``: an out-of-place ``addmm`` with a full input would copy it first): the torch ops the layer dispatches,
    attention left out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    config = ModelConfig(num_items=50, d_model=64, num_layers=1, num_heads=2, head_dim=16)
    layer = GRModel(config).to(DEVICE).layers[0]
    x = rows(9, 64, torch.float32, torch.Generator().manual_seed(6))
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Ops():
        layer(x, lambda q, k, v, time_bias: q.clone(), fused=True)
    # (the interpreter's copies of kernel outputs aside: copy_ shows up here for them)
    assert ops[-1] == "addmm_" and ops.count("addmm") == 1 and not {"add", "add_"} & set(ops), ops


def test_state_dict_names_are_unchanged():
    config = ModelConfig(num_items=50, d_model=32, num_layers=1, num_heads=2, head_dim=16)
    assert sorted(HSTULayer(config).state_dict()) == [
        "attn_norm.bias", "attn_norm.weight", "input_norm.bias", "input_norm.weight", "output.bias", "output.weight",
        "uvqk.bias", "uvqk.weight"]
    assert {"final_norm.weight", "final_norm.bias"} <= set(GRModel(config).state_dict())


def test_cpu_model_imports_neither_triton_nor_the_kernels():
    code = ("import sys, torch; from gr_engine import ModelConfig; from gr_engine.models import GRModel; "
            "m = GRModel(ModelConfig(num_items=50)); "
            "m.forward_reference(torch.arange(5), torch.zeros(5), torch.arange(2)); "
            "print(sorted(n for n in sys.modules if n == 'triton' or n.endswith('fused_ops')))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("concat_ua", [False, True])
def test_bf16_layer_on_cuda_equals_the_torch_path(concat_ua):
    """The bench model's widths (d_model 512, 4 x 128) in bf16 with thousands of rows: one layer fused and not."""
    config = ModelConfig(num_items=50, d_model=512, num_layers=1, num_heads=4, head_dim=128, concat_ua=concat_ua)
    model = GRModel(config).to("cuda", torch.bfloat16)
    x = rows(3000, 512, torch.bfloat16, torch.Generator().manual_seed(3))
    layer = model.layers[0]
    with torch.no_grad():
        fused, unfused = layer(x, dense_silu_attend), layer(x, dense_silu_attend, fused=False)
        # the gate's rounding (GATE_TOL) goes through the output Linear (bf16 GEMM) into the residual stream
        assert_close(fused, unfused, (2**-5, 2**-5))
        assert_close(model.final_norm(x), model.final_norm(x, fused=False), LN_TOL[torch.bfloat16])


@pytest.mark.gpu
@requires_cuda
def test_new_row_counts_compile_nothing_and_graphs_capture():
    from gr_engine.compile_watch import CompileWatch
    from gr_engine.models.fused_ops import gated_attn_norm, layer_norm

    gen = torch.Generator().manual_seed(4)
    weight, bias = affine(512, torch.bfloat16, gen)

    def both(num_rows: int) -> tuple[torch.Tensor, ...]:
        x, attn = rows(num_rows, 512, torch.bfloat16, gen), rows(num_rows, 512, torch.bfloat16, gen)
        u = rows(num_rows, 2048, torch.bfloat16, gen)[:, :512]
        return x, attn, u, layer_norm(x, weight, bias, EPS), *(gated_attn_norm(attn, u, weight, bias, EPS, concat)
                                                                  for concat in (False, True))

    both(33)  # warm-up: the compilations of this shape of model
    watch = CompileWatch()
    for num_rows in (1, 7, 300, 4096, 78_001):
        x, attn, u, normed, gated, concat = both(num_rows)
        assert_close(normed, F.layer_norm(x, (512,), weight, bias, EPS), LN_TOL[torch.bfloat16])
        assert_close(concat, unfused_gate(attn, u, weight, bias, True), GATE_TOL[torch.bfloat16])
    assert (watch.compilations, watch.cache_loads) == (0, 0), list(watch.last_names)

    x, attn, u, *_ = both(1000)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        both(1000)  # warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, gated = layer_norm(x, weight, bias, EPS), gated_attn_norm(attn, u, weight, bias, EPS, False)
    for _ in range(2):  # replays read the inputs' new values
        x.copy_(rows(1000, 512, torch.bfloat16, gen))
        attn.copy_(rows(1000, 512, torch.bfloat16, gen))
        graph.replay()
        assert_close(normed, F.layer_norm(x, (512,), weight, bias, EPS), LN_TOL[torch.bfloat16])
        assert_close(gated, unfused_gate(attn, u, weight, bias, False), GATE_TOL[torch.bfloat16])
