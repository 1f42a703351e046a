"""``hstu_triton``'s K/V append: one Triton launch writes every new history row's K and V into its page.

Same result as :func:`~.paged.write_appended` (two indexed writes, each a slow generic indexing kernel), in
a single small kernel: program ``i`` copies row ``i`` of ``key`` and ``value`` (``[H, D]`` each, any
strides) to entry ``entries[i]`` of page ``pages[i]``. Duplicate (page, entry) targets must carry equal
rows (a CUDA-graph step pads its appends by repeating the last one). Imported by :mod:`.hstu_triton` only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["Pages", "Entries", "num_rows"])
def _append_kernel(
    Cache, Key, Value, Pages, Entries, num_rows,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_page, stride_kv, stride_token, stride_head, stride_dim,
    NUM_HEADS: tl.constexpr, HEADS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.arange(0, HEADS_POW2)
    dims = tl.arange(0, HEAD_DIM)
    valid = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    page = tl.load(Pages + row).to(tl.int64)
    entry = tl.load(Entries + row).to(tl.int64)
    src = row.to(tl.int64)
    key = tl.load(Key + src * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=valid)
    value = tl.load(Value + src * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=valid)
    dst = Cache + page * stride_page + entry * stride_token + heads[:, None] * stride_head + dims[None, :] * stride_dim
    tl.store(dst, key, mask=valid)
    tl.store(dst + stride_kv, value, mask=valid)


def append_rows(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                entries: torch.Tensor) -> None:
    """Write appended rows into their resolved slots.

    Args:
        kv_cache: ``[num_pages, 2, page_size, H, D]`` (NHD, any strides), written in place.
        key, value: ``[N, H, D]`` in the cache's dtype (any strides).
        pages, entries: int ``[N]`` page and entry of each row.
    """
    num_rows, num_heads, head_dim = key.shape
    if num_rows == 0:
        return
    _append_kernel[(num_rows,)](
        kv_cache, key, value, pages, entries, num_rows,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        NUM_HEADS=num_heads, HEADS_POW2=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim, num_warps=1,
    )
