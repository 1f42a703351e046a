"""The attention-backend interface (``docs/design.md`` section 6; ``docs/backends.md`` on writing one).

Request ``b`` owns rows ``query_start_loc[b]:query_start_loc[b + 1]`` of the flat batch: first its
``num_history_rows[b]`` new history rows, causal over its paged history (which already holds them), then its
``num_candidate_rows[b]`` candidate rows, each over the whole history and itself, never over other candidates
(candidate K/V are never written into pages).
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

AttentionKind = Literal["hstu", "softmax"]


@dataclass(frozen=True)
class AttentionSpec:
    """What the model asks of attention; a backend says whether it can serve it.

    Attributes:
        kind: ``"hstu"`` (``silu(alpha * q.k) / scaling_seqlen``, no softmax) or ``"softmax"``.
        num_heads, head_dim, page_size: query and KV heads (no GQA), features per head of q, k and v, tokens per page.
        dtype, device_type: of q/k/v and the paged cache; ``"cpu"`` or ``"cuda"``.
        alpha: scale applied to ``q.k`` (``1/sqrt(head_dim)`` by default in the model).
        scaling_seqlen: the fixed HSTU normaliser (a configured constant, never the batch's length).
        time_bias_buckets: buckets of the relative time bias added to ``alpha * q.k`` (0: none); :func:`time_bucket`.
    """

    kind: AttentionKind
    num_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device_type: str
    alpha: float
    scaling_seqlen: int
    time_bias_buckets: int = 0


def time_bucket(delta: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int64 ``min(floor(log2(1 + |delta|)), num_buckets - 1)`` of the int64 time differences ``delta`` (query time
    minus key time, any shape), same shape."""
    value = delta.abs() + 1
    guess = torch.log2(value.double()).floor().long()  # may be one off where value is near a power of two
    one = torch.ones_like(guess)
    guess = guess - (torch.bitwise_left_shift(one, guess) > value).long()
    guess = guess + (torch.bitwise_left_shift(one, guess + 1) <= value).long()
    return guess.clamp(max=num_buckets - 1)


@dataclass(frozen=True)
class BackendSupport:
    """What a backend can serve. ``None`` for ``head_dims``/``page_sizes`` means any value."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    kinds: frozenset[str]
    head_dims: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None
    time_bias: bool = False

    def reasons_unsupported(self, spec: AttentionSpec) -> list[str]:
        """Every reason this support set cannot serve ``spec`` (empty when it can)."""
        reasons = []
        if spec.device_type not in self.devices:
            reasons.append(f"device {spec.device_type!r} not in {sorted(self.devices)}")
        if spec.dtype not in self.dtypes:
            reasons.append(f"dtype {spec.dtype} not in {sorted(str(d) for d in self.dtypes)}")
        if spec.kind not in self.kinds:
            reasons.append(f"attention kind {spec.kind!r} not in {sorted(self.kinds)}")
        if self.head_dims is not None and spec.head_dim not in self.head_dims:
            reasons.append(f"head_dim {spec.head_dim} not in {sorted(self.head_dims)}")
        if self.page_sizes is not None and spec.page_size not in self.page_sizes:
            reasons.append(f"page_size {spec.page_size} not in {sorted(self.page_sizes)}")
        if spec.time_bias_buckets and not self.time_bias:
            reasons.append("no relative time bias support")
        return reasons


def package_reasons(package: str, module: str, install: str, check_import: bool) -> list[str]:
    """Why optional ``package`` is unusable: not installed (``pip install {install}``), or (``check_import``) its
    ``module`` fails to import."""
    if importlib.util.find_spec(package) is None:
        return [f"{package} is not installed (pip install {install})"]
    if check_import:
        try:
            importlib.import_module(module)
        except (ImportError, OSError, RuntimeError) as exc:
            return [f"{package} cannot be imported: {type(exc).__name__}: {exc}"]
    return []


@dataclass
class StepTimestamps:
    """Event times of one step, for the relative time bias, on the device: int64, or int32 offsets from the step's
    earliest time where it spans less than ``2**31 - 1`` units (the bias depends only on differences; cheaper).

    Attributes:
        query: ``[T]`` each row's time: a history row's event; a candidate's, its request's last (0 if none).
        keys: ``[sum(kv_seq_lens)]`` the times of every request's history, request after request.
        key_start: ``[B]`` int32, where request ``b``'s history starts in ``keys``.
    """

    query: torch.Tensor
    keys: torch.Tensor
    key_start: torch.Tensor

    @classmethod
    def from_host(cls, query_timestamps: np.ndarray, key_timestamps: np.ndarray, kv_seq_lens: np.ndarray,
               device: torch.device | str) -> StepTimestamps:
        """From host int arrays: ``query_timestamps [T]``, ``key_timestamps [sum(kv_seq_lens)]`` and the step's
        ``kv_seq_lens [B]``; two host-to-device copies."""
        times = np.concatenate([query_timestamps, key_timestamps]).astype(np.int64)
        if len(times) and int(times.max()) - int(times.min()) < 2**31 - 1:
            times = (times - times.min()).astype(np.int32)
        times = upload(times, device)
        key_start = upload(np.concatenate([[0], np.cumsum(kv_seq_lens)[:-1]]).astype(np.int32), device)
        return cls(times[: len(query_timestamps)], times[len(query_timestamps):], key_start)


@dataclass
class PagedBatchMetadata:
    """One step's page tables and row layout, built once by the model runner, shared by all layers.

    Tensors live on the model's device, index tensors int32. ``B`` requests, ``T`` query rows, ``N <= T`` new
    history rows. The page table describes each request's history *after* this step's append.

    Attributes:
        query_start_loc: ``[B + 1]`` row offsets of each request in the flat batch.
        num_history_rows: ``[B]`` new history rows of each request (appended to its pages).
        num_candidate_rows: ``[B]`` candidate rows of each request.
        kv_indptr: ``[B + 1]`` CSR offsets into ``kv_indices``.
        kv_indices: ``[num_pages_in_batch]`` physical page ids.
        kv_last_page_len: ``[B]`` valid tokens in each request's last page (0 if it has no page).
        kv_seq_lens: ``[B]`` history tokens in pages after the append.
        append_batch_indices: ``[N]`` request index of each new history row.
        append_positions: ``[N]`` position of each new history row in its request's history.
        append_pages: ``[N]`` physical page of each new history row (FlashInfer's slot formula, resolved on the
            host: ``kv_indices[(kv_indptr[b] * page_size + position) // page_size]``).
        append_entries: ``[N]`` entry of each new history row in its page.
        history_rows: ``[N]`` flat row index of each new history row.
        candidate_rows: ``[T - N]`` flat row index of each candidate row.
        candidate_batch_indices: ``[T - N]`` request index of each candidate row.
        page_size: tokens per page.
        max_query_len, max_kv_len, max_pages: largest per-request row count, ``kv_seq_lens`` and page count (ints).
        host: read-only int numpy copies of index tensors by field name, for host planning, or ``None``: every
            field from :meth:`from_layout`; a CUDA-graph replay or an eager step laid out on the device
            (``gr_engine.eager_layout``) has only ``query_start_loc``, ``num_history_rows``, ``num_candidate_rows``,
            ``kv_indptr`` and ``kv_seq_lens``.
        timestamps: event times for the relative time bias, or ``None`` when the model has none.
    """

    query_start_loc: torch.Tensor
    num_history_rows: torch.Tensor
    num_candidate_rows: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_seq_lens: torch.Tensor
    append_batch_indices: torch.Tensor
    append_positions: torch.Tensor
    append_pages: torch.Tensor
    append_entries: torch.Tensor
    history_rows: torch.Tensor
    candidate_rows: torch.Tensor
    candidate_batch_indices: torch.Tensor
    page_size: int
    max_query_len: int
    max_kv_len: int
    max_pages: int
    host: dict[str, np.ndarray] | None = None
    timestamps: StepTimestamps | None = None

    @property
    def num_requests(self) -> int:
        """Requests of the step."""
        return len(self.kv_last_page_len)

    @classmethod
    def from_layout(cls, history_start: np.ndarray, num_history_rows: np.ndarray, num_candidate_rows: np.ndarray,
                    kv_indptr: np.ndarray, kv_indices: np.ndarray, page_size: int, device: torch.device | str,
                    query_timestamps: np.ndarray | None = None,
                    key_timestamps: np.ndarray | None = None) -> PagedBatchMetadata:
        """Build the metadata from host arrays with one host-to-device copy (two with timestamps).

        Args:
            history_start: int ``[B]`` history tokens already in pages before this step.
            num_history_rows, num_candidate_rows: int ``[B]`` new history rows (appended this step), candidates.
            kv_indptr: int ``[B + 1]`` CSR offsets of the pages covering ``history_start + num_history_rows`` tokens.
            kv_indices: int ``[kv_indptr[-1]]`` physical page ids.
            query_timestamps: int ``[T]`` (see :class:`StepTimestamps`), with ``key_timestamps``.
            key_timestamps: int ``[sum(history_start + num_history_rows)]``.
        """
        arrays = layout_arrays(history_start, num_history_rows, num_candidate_rows, kv_indptr, kv_indices, page_size)
        timestamps = None
        if query_timestamps is not None and key_timestamps is not None:
            timestamps = StepTimestamps.from_host(query_timestamps, key_timestamps, arrays["kv_seq_lens"], device)
        rows = arrays["num_history_rows"] + arrays["num_candidate_rows"]
        return cls(**upload_int32(arrays, device), page_size=page_size, max_query_len=int(rows.max(initial=0)),
                   max_kv_len=int(arrays["kv_seq_lens"].max(initial=0)),
                   max_pages=int(np.diff(arrays["kv_indptr"]).max(initial=0)), host=arrays, timestamps=timestamps)


def layout_arrays(history_start: np.ndarray, num_history_rows: np.ndarray, num_candidate_rows: np.ndarray,
                  kv_indptr: np.ndarray, kv_indices: np.ndarray, page_size: int) -> dict[str, np.ndarray]:
    """Every index field of :class:`PagedBatchMetadata` (int64 numpy, by name) from :meth:`~.from_layout`'s args."""
    start, hist, cand, indptr, indices = (np.asarray(a, dtype=np.int64) for a in (
        history_start, num_history_rows, num_candidate_rows, kv_indptr, kv_indices))
    seq_lens = start + hist
    pages = np.diff(indptr)
    last = np.where(pages > 0, seq_lens - (pages - 1) * page_size, 0)
    qsl = np.concatenate([[0], np.cumsum(hist + cand)])
    hist_owner, hist_within = _segments(hist)
    cand_owner, cand_within = _segments(cand)
    positions = start[hist_owner] + hist_within
    slots = indptr[hist_owner] * page_size + positions
    return {
        "query_start_loc": qsl, "num_history_rows": hist, "num_candidate_rows": cand, "kv_indptr": indptr,
        "kv_indices": indices, "kv_last_page_len": last, "kv_seq_lens": seq_lens, "append_batch_indices": hist_owner,
        "append_positions": positions, "append_pages": indices[slots // page_size], "append_entries": slots % page_size,
        "history_rows": qsl[hist_owner] + hist_within,
        "candidate_rows": qsl[cand_owner] + hist[cand_owner] + cand_within, "candidate_batch_indices": cand_owner,
    }


def upload(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device`` (on CPU, no copy). To CUDA without blocking the host, through a pinned
    block of torch's caching host allocator (reused once copied; ``Tensor.pin_memory()`` would pin anew each call)."""
    tensor = torch.from_numpy(array)
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.numpy()[...] = array
        return staged.to(device, non_blocking=True)
    return tensor.to(device)


def upload_int32(arrays: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Several int arrays to ``device`` as int32 tensors, in one copy (see :func:`upload`)."""
    sizes = [len(a) for a in arrays.values()]
    flat = upload(np.concatenate(list(arrays.values())).astype(np.int32), device)
    return dict(zip(arrays, torch.split(flat, sizes), strict=True))


def _segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segment lengths ``counts [B]``: each element's segment index and its offset inside it."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[owner]


class AttentionBackend(abc.ABC):
    """Base of every attention backend (subclasses set ``name``, ``support``), made once per engine for a spec."""

    name: ClassVar[str]
    support: ClassVar[BackendSupport]
    #: Relative speed used by ``attention_backend="auto"`` (higher wins among usable backends).
    priority: ClassVar[int] = 0

    def __init__(self, spec: AttentionSpec) -> None:
        reasons = self.reasons_unsupported(spec)
        if reasons:
            raise ValueError(f"attention backend {self.name!r} cannot serve this model: " + "; ".join(reasons))
        self.spec = spec

    @classmethod
    def reasons_unsupported(cls, spec: AttentionSpec) -> list[str]:
        """Every reason this backend cannot serve ``spec``; override to add runtime checks (package, GPU)."""
        return cls.support.reasons_unsupported(spec)

    def build_metadata(self, common: PagedBatchMetadata) -> Any:
        """Derive the backend's own per-step metadata from ``common`` (called once per step)."""
        return common

    @abc.abstractmethod
    def append_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, metadata: Any) -> None:
        """Write the new history rows' K/V into their pages.

        Args:
            kv_cache: one layer's cache ``[num_pages, 2, page_size, H, D]`` (NHD), written in place.
            key, value: ``[T, H, D]`` K and V of every row of the step (as :meth:`attend` gets them; any row
                stride, unit last-dim stride); the rows at the common metadata's ``history_rows`` are appended.
            metadata: what :meth:`build_metadata` returned for this step.
        """

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
               time_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for every row of the flat batch (after :meth:`append_kv` for this layer).

        Args:
            q, k, v: ``[T, H, D]`` projections of all rows; candidates' own k/v come from here, history's from
                ``kv_cache``.
            kv_cache: one layer's cache ``[num_pages, 2, page_size, H, D]``.
            metadata: what :meth:`build_metadata` returned for this step.
            time_bias: float32 ``[time_bias_buckets, H]`` or ``None``: entry ``[time_bucket(t_query - t_key), h]``
                is added to ``alpha * q.k`` of head ``h`` (timestamps from the common metadata).

        Returns:
            ``[T, H, D]`` in ``q``'s dtype; for ``hstu``, ``sum_j silu(alpha q.k_j) / scaling_seqlen * v_j`` over
            the row's allowed keys.
        """


class NewRowsReadable(abc.ABC):
    """What an :class:`AttentionBackend` also implements to read, in a step where no request has keys before its new
    rows (recompute; a first visit), every key from the step's own K/V rows instead of the pages. The engine appends
    those rows wherever a later step reads them (every step of a caching engine, a chunk of a longer history)."""

    @abc.abstractmethod
    def reads_new_rows(self) -> bool:
        """Whether this instance's model can take :meth:`attend_new_rows` (e.g. its rows' alignment)."""

    @abc.abstractmethod
    def attend_new_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any,
                        time_bias: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`AttentionBackend.attend` of such a step, keys read from ``k`` and ``v`` (``[T, H, D]``); the same
        result as ``attend`` over the pages after the append."""


PlanWriter = Callable[[PagedBatchMetadata, torch.Tensor], None]
"""``writer(common, plan)``: write the plan of the step in ``common`` (its tensors padded to the capacities, on the
device) into the int32 ``plan`` buffer, on the current stream, capturable in a CUDA graph."""


class GraphReplayable(abc.ABC):
    """What an :class:`AttentionBackend` also implements to be replayed from CUDA graphs (gr_engine.step_graphs)."""

    @abc.abstractmethod
    def graph_plan(self, common_host: dict[str, np.ndarray], max_rows: int,
                   max_requests: int) -> tuple[Hashable, np.ndarray | PlanWriter]:
        """This step's metadata for CUDA-graph replay, from ``common_host`` (:attr:`PagedBatchMetadata.host` of a
        replayed step) and the capacities it is padded to (``T <= max_rows``, ``B <= max_requests``).

        Returns ``(key, plan)``: ``plan`` is a flat int32 array of :meth:`graph_plan_size` entries, laid out by
        ``key`` alone, uploaded for the replay; or a :data:`PlanWriter` that writes it on the device, captured
        before the first layer. A key always comes with the same kind. Equal keys and capacities share a graph.
        """

    @abc.abstractmethod
    def graph_plan_size(self, key: Hashable) -> int:
        """Entries of the plan array of ``key``."""

    @abc.abstractmethod
    def graph_metadata(self, common: PagedBatchMetadata, key: Hashable, plan: torch.Tensor) -> Any:
        """The metadata ``attend`` gets inside a captured graph: ``plan``, :meth:`graph_plan`'s array for ``key``
        on the device at a fixed address; ``common``'s tensors padded to the capacities (spare requests have no
        rows; spare append rows repeat the last). Launches read the step only from these, never from host values."""
