"""An eager step's row layout built on the device (docs/design.md section 3, step 4).

A step launched op by op (larger than the step graphs' buckets, without new history rows, or of a model with a time
bias) is written in compact form (:func:`.step_expand.write_compact`: its per-request numbers, tokens and page ids)
into a pinned block, uploaded in one copy, and expanded by :func:`.step_expand.expand`, with its own row count as the
bucket (one compiled kernel for every size), into every index field of
:class:`~attention_backends.PagedBatchMetadata` and the token positions. The host builds only ``[B]``-sized arrays
and the concatenated tokens it uploads anyway; the backend plans from the per-request host arrays.

Imports Triton: the engine builds a :class:`DeviceLayout` only on CUDA with a graph-replayable backend.
"""

from __future__ import annotations

import numpy as np
import torch

from attention_backends import PagedBatchMetadata
from attention_backends.base import StepTimestamps

from . import step_expand
from .step_graphs import LENGTHS, TOKEN_FIELDS


class DeviceLayout:
    """Lays out eager steps on the device.

    Args:
        device: the model's device (CUDA; the CPU only in Triton's interpreter, for tests).
        page_size: tokens per KV page.
        max_requests: the most requests a step holds (the expansion kernel is compiled for this many).
    """

    def __init__(self, device: torch.device, page_size: int, max_requests: int) -> None:
        self.device, self.page_size, self.max_requests = device, page_size, max_requests
        self._pinned = device.type == "cuda"

    def build(self, layout: dict[str, np.ndarray], item_ids: list[np.ndarray], action_ids: list[np.ndarray],
              times: tuple[np.ndarray | None, np.ndarray | None]) -> tuple[dict[str, torch.Tensor],
                                                                           PagedBatchMetadata]:
        """Upload a step and queue its expansion on the current stream; nothing waits for the device.

        Args:
            layout: int ``history_start``, ``num_history_rows``, ``num_candidate_rows`` (``[B]``), ``kv_indptr``
                (``[B + 1]``) and ``kv_indices`` (``[P]``): the arguments of
                :meth:`~attention_backends.PagedBatchMetadata.from_layout`.
            item_ids, action_ids: the int ``[T]`` tokens in parts (each request's new history rows, then its
                candidates), concatenated straight into the compact step.
            times: int query ``[T]`` and key timestamps for the relative time bias (as
                :meth:`~attention_backends.PagedBatchMetadata.from_layout`), or ``None``s.

        Returns:
            int32 ``[T]`` tokens by :data:`~.step_graphs.TOKEN_FIELDS` and the metadata, views of one int32 device
            buffer; the metadata's ``host`` holds the per-request arrays only.
        """
        start, hist, cand = layout["history_start"], layout["num_history_rows"], layout["num_candidate_rows"]
        indptr, pages = layout["kv_indptr"], layout["kv_indices"]
        num_requests, rows, num_pages = len(hist), sum(len(part) for part in item_ids), len(pages)
        if num_requests > self.max_requests:
            raise ValueError(f"a step of {num_requests} requests; the layout holds {self.max_requests}")
        staged = torch.empty(step_expand.compact_size(num_requests, rows, num_pages), dtype=torch.int32,
                             pin_memory=self._pinned)  # a block of torch's caching host allocator, as upload()
        step_expand.write_compact(staged.numpy(), start, hist, cand, indptr, pages, item_ids, action_ids)
        compact = staged.to(self.device, non_blocking=True)  # the CPU: the same tensor
        _, offsets = step_expand.field_offsets(self.max_requests, rows)
        buffer = self.expand(compact, rows, offsets["kv_indices"] + num_pages)
        query_start_loc = np.zeros(num_requests + 1, dtype=np.int64)
        np.add.accumulate(hist + cand, dtype=np.int64, out=query_start_loc[1:])
        seq_lens = start + hist
        history = int(np.add.reduce(hist, dtype=np.int64))
        lengths = {"requests1": num_requests + 1, "requests": num_requests, "history": history,
                   "candidates": rows - history, "rows": rows}
        views = {name: buffer[offsets[name]:offsets[name] + lengths[kind]] for name, kind in LENGTHS.items()}
        tokens = {name: views.pop(name) for name in TOKEN_FIELDS}
        host = {"query_start_loc": query_start_loc, "num_history_rows": hist, "num_candidate_rows": cand,
                "kv_indptr": indptr, "kv_seq_lens": seq_lens}
        timestamps = None if times[0] is None else StepTimestamps.from_host(*times, seq_lens, self.device)
        common = PagedBatchMetadata(
            **views, kv_indices=buffer[offsets["kv_indices"]:], page_size=self.page_size,
            max_query_len=int((hist + cand).max()), max_kv_len=int(seq_lens.max()),
            max_pages=int((indptr[1:] - indptr[:-1]).max()), host=host, timestamps=timestamps)
        return tokens, common

    def expand(self, compact: torch.Tensor, rows: int, size: int) -> torch.Tensor:
        """A new int32 ``[size]`` device buffer laid out as :func:`.step_expand.field_offsets` for ``rows`` rows, then
        the page ids, and the queued expansion of the compact step (int32, on the device) into it."""
        buffer = torch.empty(size, dtype=torch.int32, device=self.device)
        step_expand.expand(compact, buffer, self.max_requests, rows, self.page_size)
        return buffer
