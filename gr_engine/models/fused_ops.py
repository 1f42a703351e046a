"""Row-wise Triton kernels of the HSTU layer's CUDA path (docs/design.md section 4): LayerNorm (optionally also
writing ``x + shift``, the residual plus a bias), and the gate ``u * LN(attn)`` (with ``concat_ua``: ``[u, attn, u *
LN(attn)]``) in one pass.

Each program normalises a tile of whole rows held in registers: statistics and arithmetic in float32, one read of each
input and one write of the output, so both kernels run at memory bandwidth. They allocate only their output (its
shape is the inputs'), never synchronise with the host and launch nothing for zero rows, so CUDA graphs capture them.
The row count is not specialised on (``do_not_specialize``): after a model's first launch, no other row count
compiles a new variant. Row strides are specialised on (divisibility by 16 lets rows load in 16-byte vectors); they are
the model's layout, the same every step.

This module imports Triton: :mod:`.layers` imports it only when a layer runs on CUDA. On CPU the kernels run only in
Triton's interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 4096
"""The widest row (``N``) the kernels take: a row is held in registers."""
# Launch shape, measured on an H200 at the bench's shape ([78k, 512] bf16): LN, gate and concat gate ran at 3.45, 3.72
# and 3.80 TB/s (a device-to-device copy: 3.68); 2,048 or 4,096 values with 2 to 8 warps were within ~10% of that,
# 8,192 up to 30% and 16,384 up to 7x slower.
TILE_VALUES = 4096
"""Values (rows x padded width) one program handles: more rows a program for narrower rows."""
NUM_WARPS = 4
"""Warps a program."""


@triton.jit
def _normalise(x, Weight, Bias, cols, eps, N: tl.constexpr):
    """``LN(x) * weight + bias`` in float32, per row of ``x`` (float32 ``[ROWS, BLOCK]``, zero in the padding columns
    ``cols >= N``; ``cols``: ``[1, BLOCK]`` column indices). ``Weight``, ``Bias``: ``[N]``, any float dtype. The
    variance is biased (divided by ``N``), as ``torch.nn.LayerNorm``'s."""
    in_row = cols < N
    mean = tl.sum(x, axis=1)[:, None] / N
    centred = tl.where(in_row, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1)[:, None] / N + eps)
    weight = tl.load(Weight + cols, mask=in_row, other=0.0).to(tl.float32)
    bias = tl.load(Bias + cols, mask=in_row, other=0.0).to(tl.float32)
    return centred * rstd * weight + bias


@triton.jit(do_not_specialize=["num_rows"])
def _layer_norm_kernel(X, Weight, Bias, Out, Shift, Shifted, num_rows, stride_x, stride_out, eps,
                       N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SHIFT: tl.constexpr):
    """Program ``p`` writes rows ``p * ROWS ..`` (+ ``ROWS``, those below ``num_rows``) of ``Out = LN(X) * Weight +
    Bias`` and, with ``SHIFT``, of ``Shifted = X + Shift`` (``Shift``: ``[N]``; else both are never read). ``X``,
    ``Out``: ``[num_rows, N]`` rows ``stride_x`` / ``stride_out`` values apart (``Shifted`` as ``Out``), unit column
    stride; ``BLOCK``: ``N`` rounded up to a power of two."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    valid = (rows < num_rows) & (cols < N)
    x = tl.load(X + rows * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    y = _normalise(x, Weight, Bias, cols, eps, N)
    tl.store(Out + rows * stride_out + cols, y.to(Out.dtype.element_ty), mask=valid)
    if SHIFT:
        shifted = x + tl.load(Shift + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(Shifted + rows * stride_out + cols, shifted.to(Shifted.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["num_rows"])
def _gated_layer_norm_kernel(Attn, U, Weight, Bias, Out, num_rows, stride_attn, stride_u, stride_out, eps,
                             N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, CONCAT_UA: tl.constexpr):
    """Program ``p`` writes rows ``p * ROWS ..`` (+ ``ROWS``, those below ``num_rows``) of ``Out``: ``U * (LN(Attn) *
    Weight + Bias)``, or with ``CONCAT_UA`` ``[U, Attn, U * (LN(Attn) * Weight + Bias)]`` (``U`` and ``Attn`` copied
    exactly). ``Attn``, ``U``: ``[num_rows, N]``, ``Out``: ``[num_rows, N]`` or ``[num_rows, 3N]``, rows
    ``stride_*`` values apart, unit column stride; ``BLOCK``: ``N`` rounded up to a power of two."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    valid = (rows < num_rows) & (cols < N)
    attn = tl.load(Attn + rows * stride_attn + cols, mask=valid, other=0.0)
    u = tl.load(U + rows * stride_u + cols, mask=valid, other=0.0)
    gated = u.to(tl.float32) * _normalise(attn.to(tl.float32), Weight, Bias, cols, eps, N)
    out = Out + rows * stride_out + cols
    if CONCAT_UA:
        tl.store(out, u, mask=valid)
        tl.store(out + N, attn, mask=valid)
        out += 2 * N
    tl.store(out, gated.to(Out.dtype.element_ty), mask=valid)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise LayerNorm, ``torch.nn.functional.layer_norm(x, (N,), weight, bias, eps)`` of 2-D ``x`` in one kernel.

    Args:
        x: ``[T, N]`` bf16, fp16 or fp32 (``N <= MAX_WIDTH``), unit column stride, any row stride; CUDA (or CPU under
            Triton's interpreter).
        weight, bias: ``[N]`` contiguous, any float dtype (read as float32).
        eps: added to the variance.

    Returns:
        ``[T, N]`` contiguous, ``x``'s dtype and device; mean, variance and affine map in float32, rounded once.
    """
    return _layer_norm(x, weight, bias, eps, None)[0]


def layer_norm_and_shift(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                         shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`layer_norm` of ``x`` and ``x + shift`` from one read of ``x``: the HSTU layer's input norm and its
    residual plus the output Linear's bias, which the output GEMM then adds its product to (no add of its own).

    Args:
        x, weight, bias, eps: as :func:`layer_norm`.
        shift: ``[N]`` contiguous, any float dtype (added in float32).

    Returns:
        ``(LN(x), x + shift)``, each ``[T, N]`` contiguous in ``x``'s dtype, rounded once.
    """
    return _layer_norm(x, weight, bias, eps, shift)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                shift: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(LN(x), x + shift or None)`` in one launch (see :func:`layer_norm_and_shift`)."""
    num_rows, width = _check_rows("x", x)
    _check_affine(weight, bias, width)
    if shift is not None and (shift.shape != (width,) or not shift.is_contiguous()):
        raise ValueError(f"shift must be contiguous [{width}]: got {tuple(shift.shape)} strides {shift.stride()}")
    out = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    shifted = None if shift is None else torch.empty_like(out)
    if num_rows:
        block, rows = _tile(width)
        _layer_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x, weight, bias, out, x if shift is None else shift, out if shifted is None else shifted, num_rows,
            x.stride(0), out.stride(0), eps, N=width, BLOCK=block, ROWS=rows, SHIFT=shift is not None,
            num_warps=NUM_WARPS)
    return out, shifted


def gated_attn_norm(attn: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                    concat_ua: bool) -> torch.Tensor:
    """HSTU's output gate in one kernel: ``u * LN(attn)`` or, with ``concat_ua``, ``[u, attn, u * LN(attn)]``.

    Args:
        attn: ``[T, W]`` attention output (heads flattened), bf16, fp16 or fp32 (``W <= MAX_WIDTH``), unit column
            stride (contiguous in the model); CUDA (or CPU under Triton's interpreter).
        u: ``[T, W]``, ``attn``'s dtype and device, unit column stride, any row stride (in the model a column slice of
            the ``[T, 4W]`` projection, rows ``4W`` apart).
        weight, bias: ``[W]`` contiguous, the attention norm's affine parameters, any float dtype (read as float32).
        eps: added to the variance.
        concat_ua: also output ``u`` and ``attn``, before the gate.

    Returns:
        ``[T, W]`` (``[T, 3W]`` with ``concat_ua``) contiguous, ``attn``'s dtype and device; the norm and the product in
        float32, rounded once (the unfused ops round ``LN(attn)`` before the product).
    """
    num_rows, width = _check_rows("attn", attn)
    if u.shape != attn.shape or u.dtype != attn.dtype or u.device != attn.device or (num_rows and u.stride(1) != 1):
        raise ValueError(f"u must be like attn ({attn.dtype} {tuple(attn.shape)} on {attn.device}) with unit column "
                         f"stride: got {u.dtype} {tuple(u.shape)} strides {u.stride()} on {u.device}")
    _check_affine(weight, bias, width)
    out = torch.empty((num_rows, 3 * width if concat_ua else width), dtype=attn.dtype, device=attn.device)
    if num_rows:
        block, rows = _tile(width)
        _gated_layer_norm_kernel[(triton.cdiv(num_rows, rows),)](
            attn, u, weight, bias, out, num_rows, attn.stride(0), u.stride(0), out.stride(0), eps,
            N=width, BLOCK=block, ROWS=rows, CONCAT_UA=concat_ua,
            num_warps=NUM_WARPS)
    return out


def _check_rows(name: str, x: torch.Tensor) -> tuple[int, int]:
    """``(T, N)`` of a kernel input ``x`` ``[T, N]``; raises ``ValueError`` for another rank, a dtype other than
    bf16 / fp16 / fp32, ``N`` above :data:`MAX_WIDTH` or a non-unit column stride."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} must be 2-D bf16, fp16 or fp32: got {x.dtype} {tuple(x.shape)}")
    num_rows, width = x.shape
    if not 0 < width <= MAX_WIDTH:
        raise ValueError(f"{name} rows must have 1 to {MAX_WIDTH} values (held in registers): got {width}")
    if num_rows and x.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride: got strides {x.stride()}")
    return num_rows, width


def _check_affine(weight: torch.Tensor, bias: torch.Tensor, width: int) -> None:
    """Raises ``ValueError`` unless ``weight`` and ``bias`` are contiguous ``[width]``."""
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (width,) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{width}]: got {tuple(t.shape)} strides {t.stride()}")


def _tile(width: int) -> tuple[int, int]:
    """``(BLOCK, ROWS)`` of a launch over rows of ``width`` values: the width rounded up to a power of two, and the
    rows a program normalises (:data:`TILE_VALUES` values, at least one row)."""
    block = triton.next_power_of_2(width)
    return block, max(1, TILE_VALUES // block)
