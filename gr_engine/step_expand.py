"""A staged step's layout built on the device: the static buffer a bucket's graphs read, written by one Triton kernel.

A step replayed from a CUDA graph is written in *compact* form (:func:`write_compact`) into pinned host memory: its
per-request numbers, its tokens and its page ids, ``4 + 4 B + 2 T + P`` int32 values. The first work of each replay
(:func:`expand`, captured with the graphs, reading the compact step over PCIe) derives from them every index field of
:class:`~attention_backends.PagedBatchMetadata` and the token positions, padded to the bucket's capacities, as
:func:`~attention_backends.base.layout_arrays` derives them on the host: the host then builds no per-row array.
An eager step on CUDA (:mod:`.eager_layout`) is expanded by the same kernel, from its compact form uploaded to the
device, into a buffer whose per-row fields hold exactly its own rows.

The static buffer of a bucket of ``W`` rows for at most ``R`` requests holds, in :data:`FIELDS` order, each field at
its capacity (``R + 1``, ``R`` or ``W`` entries), then ``max_pages`` page ids. Padding is inert: spare requests have no
rows (``query_start_loc`` and ``kv_indptr`` repeat their last value, the other per-request fields are 0), spare append
rows repeat the step's last append (the same slot and values: ``hstu_triton``'s append skips them), other spare
rows are 0; page ids beyond the step's are left as they were (``kv_indptr`` bounds every read).

This module imports Triton; :mod:`.step_graphs` and :mod:`.eager_layout` import it when they are built.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

#: Per-step int32 fields of the static buffer, in order, and the capacity of each ("requests1": ``R + 1``,
#: "requests": ``R``, "rows": ``W``); the page ids (``kv_indices``) follow.
FIELDS = {
    "query_start_loc": "requests1", "kv_indptr": "requests1", "num_history_rows": "requests",
    "num_candidate_rows": "requests", "kv_last_page_len": "requests", "kv_seq_lens": "requests",
    "append_batch_indices": "rows", "append_positions": "rows", "append_pages": "rows", "append_entries": "rows",
    "history_rows": "rows", "candidate_rows": "rows", "candidate_batch_indices": "rows",
    "item_ids": "rows", "action_ids": "rows", "positions": "rows",
}
_HEADER = 3  # a compact step starts with B, T, P


def field_offsets(max_requests: int, bucket: int) -> tuple[dict[str, int], dict[str, int]]:
    """``(capacities, offsets)`` of every field of a bucket's static buffer (offsets include ``"kv_indices"``)."""
    sizes = {"requests": max_requests, "requests1": max_requests + 1, "rows": bucket}
    caps = {name: sizes[cap] for name, cap in FIELDS.items()}
    ends = itertools.accumulate(caps.values(), initial=0)  # (per eager step: cheaper than numpy for 16 numbers)
    return caps, dict(zip([*FIELDS, "kv_indices"], ends, strict=True))


def compact_size(max_requests: int, max_rows: int, max_pages: int) -> int:
    """Entries of the largest compact step."""
    return _HEADER + 4 * max_requests + 1 + 2 * max_rows + max_pages


def write_compact(out: np.ndarray, history_start: np.ndarray, num_history_rows: np.ndarray,
                  num_candidate_rows: np.ndarray, kv_indptr: np.ndarray, kv_indices: np.ndarray,
                  item_ids: Sequence[np.ndarray], action_ids: Sequence[np.ndarray]) -> int:
    """Write a step in compact form into ``out`` (int32, at least :func:`compact_size` entries); returns the entries
    used. The arguments are those of :meth:`~attention_backends.PagedBatchMetadata.from_layout` (``[B]`` per request,
    ``kv_indptr [B + 1]``, ``kv_indices [P]``) and the step's int ``[T]`` tokens, each in parts that are concatenated
    here (rows of each request in turn: its new history rows, then its candidates). Candidates come with a request's
    final chunk only, so they are placed one past its history in pages (position ``history_start +
    num_history_rows``)."""
    counts = (len(num_history_rows), sum(len(part) for part in item_ids), len(kv_indices))
    used = _HEADER + 4 * counts[0] + 1 + 2 * counts[1] + counts[2]
    np.concatenate([counts, history_start, num_history_rows, num_candidate_rows, kv_indptr, *item_ids, *action_ids,
                    kv_indices], out=out[:used])  # int64 -> int32, same_kind
    return used


def expand(compact: torch.Tensor, buffer: torch.Tensor, max_requests: int, bucket: int, page_size: int) -> None:
    """Write the static buffer of ``bucket`` (int32, :func:`field_offsets` layout) from a compact step (int32,
    :func:`write_compact`; in device memory or pinned host memory), on the current stream (capturable). The step must
    fit the capacities (``T <= bucket``, ``B <= max_requests``); without new history rows the append fields are
    left unwritten. ``bucket`` is read at run time: one compiled kernel serves every bucket, and eager steps (their
    own row count as the bucket)."""
    r_p2 = triton.next_power_of_2(max_requests + 1)
    block = min(256, max(16, 4096 // r_p2))
    _expand_kernel[(triton.cdiv(bucket, block),)](
        compact, buffer, bucket, PAGE_SIZE=page_size, MAX_REQUESTS=max_requests, R_P2=r_p2, BLOCK=block)


@triton.jit
def _pick(values, owner, b):
    """``values[owner]`` per row: ``values [R_P2]`` per request, ``owner [BLOCK]`` (0 where out of range)."""
    return tl.sum(tl.where(b[None, :] == owner[:, None], values[None, :], 0), 1)


@triton.jit
def _owner(ends, t, real):
    """Per row ``t [BLOCK]``: the first request whose exclusive end (``ends [R_P2]``, cumulative) lies beyond it."""
    return tl.sum(((ends[None, :] <= t[:, None]) & real[None, :]).to(tl.int32), 1)


@triton.jit(do_not_specialize=["bucket"])  # any row count, one kernel (no recompilation per bucket or eager step)
def _expand_kernel(Compact, Out, bucket, PAGE_SIZE: tl.constexpr, MAX_REQUESTS: tl.constexpr, R_P2: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program ``p`` writes rows ``[p * BLOCK, (p + 1) * BLOCK)`` of every per-row field (``bucket`` entries each)
    and a share of the page ids; program 0 also writes the per-request fields."""
    pid = tl.program_id(0)
    num_requests = tl.load(Compact)
    num_rows = tl.load(Compact + 1)
    num_pages = tl.load(Compact + 2)
    b = tl.arange(0, R_P2)
    real = b < num_requests
    start = tl.load(Compact + 3 + b, mask=real, other=0)
    hist = tl.load(Compact + 3 + num_requests + b, mask=real, other=0)
    cand = tl.load(Compact + 3 + 2 * num_requests + b, mask=real, other=0)
    indptr_at = Compact + 3 + 3 * num_requests
    page_first = tl.load(indptr_at + b, mask=real, other=0)
    page_end = tl.load(indptr_at + b + 1, mask=real, other=0)
    tokens_at = indptr_at + num_requests + 1
    pages_at = tokens_at + 2 * num_rows
    q_end, h_end, c_end = tl.cumsum(hist + cand, 0), tl.cumsum(hist, 0), tl.cumsum(cand, 0)
    q_start, h_start, c_start = q_end - hist - cand, h_end - hist, c_end - cand
    seq_lens = start + hist
    # The fields at their offsets (FIELDS order): two of R + 1 entries, four of R, then the per-row ones.
    R = MAX_REQUESTS
    ROWS = 6 * MAX_REQUESTS + 2
    if pid == 0:
        upto = b <= R
        tl.store(Out + b, q_start, mask=upto)  # spare requests start (and end) at the step's last row
        tl.store(Out + R + 1 + b, tl.load(indptr_at + tl.minimum(b, num_requests)), mask=upto)
        held = page_end - page_first
        tl.store(Out + 2 * R + 2 + b, hist, mask=b < R)
        tl.store(Out + 3 * R + 2 + b, cand, mask=b < R)
        tl.store(Out + 4 * R + 2 + b, tl.where(held > 0, seq_lens - (held - 1) * PAGE_SIZE, 0), mask=b < R)
        tl.store(Out + 5 * R + 2 + b, seq_lens, mask=b < R)
    t = pid * BLOCK + tl.arange(0, BLOCK)
    keep = t < bucket
    # New history rows; spare ones repeat the last (none at all: nothing to write).
    num_history = tl.sum(hist, 0)
    row = tl.minimum(t, num_history - 1)
    append = keep & (num_history > 0)
    owner = _owner(h_end, row, real)
    within = row - _pick(h_start, owner, b)
    position = _pick(start, owner, b) + within
    slot = _pick(page_first, owner, b) * PAGE_SIZE + position
    tl.store(Out + ROWS + t, owner, mask=append)
    tl.store(Out + ROWS + bucket + t, position, mask=append)
    tl.store(Out + ROWS + 2 * bucket + t, tl.load(pages_at + slot // PAGE_SIZE, mask=append, other=0), mask=append)
    tl.store(Out + ROWS + 3 * bucket + t, slot % PAGE_SIZE, mask=append)
    tl.store(Out + ROWS + 4 * bucket + t, _pick(q_start, owner, b) + within, mask=append)
    # Candidate rows; spare ones 0.
    is_candidate = t < tl.sum(cand, 0)
    owner = _owner(c_end, t, real)
    candidate_row = _pick(q_start + hist, owner, b) + t - _pick(c_start, owner, b)
    tl.store(Out + ROWS + 5 * bucket + t, tl.where(is_candidate, candidate_row, 0), mask=keep)
    tl.store(Out + ROWS + 6 * bucket + t, tl.where(is_candidate, owner, 0), mask=keep)
    # Tokens: a history row sits at its event's position, a candidate one past the request's last event.
    is_row = t < num_rows
    tl.store(Out + ROWS + 7 * bucket + t, tl.load(tokens_at + t, mask=is_row, other=0), mask=keep)
    tl.store(Out + ROWS + 8 * bucket + t, tl.load(tokens_at + num_rows + t, mask=is_row, other=0), mask=keep)
    owner = _owner(q_end, t, real)
    within = t - _pick(q_start, owner, b)
    position = tl.where(within < _pick(hist, owner, b), _pick(start, owner, b) + within, _pick(seq_lens, owner, b))
    tl.store(Out + ROWS + 9 * bucket + t, tl.where(is_row, position, 0), mask=keep)
    # Page ids, shared out between the programs.
    step = tl.num_programs(0) * BLOCK
    for first in range(pid * BLOCK, num_pages, step):
        j = first + tl.arange(0, BLOCK)
        tl.store(Out + ROWS + 10 * bucket + j, tl.load(pages_at + j, mask=j < num_pages), mask=j < num_pages)
