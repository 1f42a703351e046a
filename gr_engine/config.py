"""Typed engine configuration: model, cache, scheduler and engine settings (``msgspec.Struct``s with documented
defaults), and :func:`load_config`, which reads a JSON or TOML file and applies ``section.key=value`` overrides.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from cache_engine.config import CacheConfig
from scheduler.config import SchedulerConfig

from .serving.config import ServingConfig

if TYPE_CHECKING:
    from attention_backends.registry import BackendRegistry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTypeName = Literal["float32", "bfloat16", "float16"]
Architecture = Literal["hstu", "sasrec"]

__all__ = ["CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig", "check_config", "load_config"]


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The cache-consistent ranking model (docs/design.md section 4).

    Attributes:
        architecture: ``"hstu"`` (HSTU layers, SiLU attention) or ``"sasrec"`` (pre-norm softmax
            transformer blocks, SASRec-style); both use the same embeddings, heads, engine and cache.
        num_items: item vocabulary size; item ids are ``0 .. num_items - 1``.
        num_actions: action vocabulary size (ids ``0 .. num_actions - 1``); candidates use an extra action.
        d_model: embedding and residual width.
        num_layers, num_heads, head_dim: layers, attention heads, features per head (q, k, v and u).
        max_history_len: longest history accepted (events); also the number of position embeddings.
        max_candidates: most candidates per request.
        num_tasks: ranking head outputs per candidate (e.g. click, like, long-view).
        ranking_hidden: hidden width of the ranking MLP.
        scaling_seqlen: the fixed attention normaliser ``N`` in ``silu(alpha q.k) / N``; defaults to
            ``max_history_len``. Never the batch's length, so scores do not depend on batch-mates.
        attn_alpha: scale of ``q.k``; defaults to ``1 / sqrt(head_dim)``.
        concat_ua: output projection over ``[u, attn, u * LN(attn)]`` instead of ``u * LN(attn)``.
        time_bias_buckets: a learned relative time bias per layer and head added to ``alpha * q.k``, bucket
            ``min(floor(log2(1 + |t_query - t_key|)), buckets - 1)`` (a candidate's time is its request's last
            event); 0 disables it. Computed inside attention from the timestamps, so cached K/V stay valid.
        dtype: parameter, activation and KV dtype.
        seed: seed of the random initialisation (used when no weights file is given); 64 bits, signed or unsigned.
    """

    architecture: Architecture = "hstu"
    num_items: int = 1000
    num_actions: int = 16
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    max_history_len: int = 4096
    max_candidates: int = 128
    num_tasks: int = 3
    ranking_hidden: int = 128
    scaling_seqlen: int | None = None
    attn_alpha: float | None = None
    concat_ua: bool = False
    time_bias_buckets: int = 0
    dtype: DTypeName = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_items", "num_actions", "d_model", "num_layers", "num_heads", "head_dim",
                     "max_history_len", "max_candidates", "num_tasks", "ranking_hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.time_bias_buckets < 0:
            raise ValueError(f"model.time_bias_buckets must be >= 0, got {self.time_bias_buckets}")
        if self.scaling_seqlen is not None and self.scaling_seqlen <= 0:
            raise ValueError(f"model.scaling_seqlen must be positive, got {self.scaling_seqlen}")
        if self.attn_alpha is not None and not math.isfinite(self.attn_alpha):
            raise ValueError(f"model.attn_alpha must be finite, got {self.attn_alpha}")
        if not -2**63 <= self.seed < 2**64:  # torch's generator takes a 64-bit seed, signed or unsigned
            raise ValueError(f"model.seed must fit in 64 bits, [{-2**63}, {2**64 - 1}], got {self.seed}")

    @property
    def normaliser(self) -> int:
        """The length HSTU attention divides its SiLU weights by: ``scaling_seqlen``, else ``max_history_len``."""
        return self.scaling_seqlen if self.scaling_seqlen is not None else self.max_history_len

    @property
    def attention_kind(self) -> str:
        """The attention-backend kind the layers need: ``"hstu"`` or ``"softmax"``."""
        return "hstu" if self.architecture == "hstu" else "softmax"

    @property
    def alpha(self) -> float:
        """The factor of ``q k^T`` before the SiLU: ``attn_alpha``, else ``head_dim ** -0.5``."""
        return self.attn_alpha if self.attn_alpha is not None else self.head_dim**-0.5

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return getattr(torch, self.dtype)


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the engine needs.

    Attributes:
        model: the model's shape and numerics.
        cache: KV cache mode and pool size.
        scheduler: batch size and token budget per step.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when available).
        attention_backend: a registered backend name, or ``"auto"`` for the fastest usable one.
        weights_path: a safetensors file written by ``GRModel.save``; ``None``: random init from ``model.seed``.
        sync_phases: synchronise the device after each step phase so its time includes its device work (serialises).
        cuda_graph_max_rows: the largest step (rows) replayed from CUDA graphs (:mod:`.step_graphs`); 0: none.
        serving: the online path's settings (``gr-engine serve``, :class:`~gr_engine.serving.AsyncGREngine`).
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    device: str = "cpu"
    attention_backend: str = "torch_ref"
    weights_path: str | None = None
    sync_phases: bool = False
    cuda_graph_max_rows: int = 16384
    serving: ServingConfig = msgspec.field(default_factory=ServingConfig)

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.scheduler.max_num_batched_tokens <= self.model.max_candidates:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) must exceed "
                f"model.max_candidates ({self.model.max_candidates}) so a request's candidates fit in a step")
        if self.cuda_graph_max_rows < 0:
            raise ValueError(f"cuda_graph_max_rows ({self.cuda_graph_max_rows}) must be >= 0 (0: no CUDA graphs)")


def check_device(name: str, require_available: bool = False) -> None:
    """Raise ``ValueError`` unless ``name`` is ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (with
    ``require_available``: a CUDA device this machine has)."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one of 'cpu', 'cuda', 'cuda:N' or 'auto'")
    if require_available and device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r} requested but this machine has {count} CUDA device(s)")


def check_config(config: EngineConfig, backends: BackendRegistry | None = None) -> None:
    """Raise ``ValueError`` unless every field of ``config`` has its declared type and an allowed value, as
    :func:`load_config`'s decoding checks (a struct built in Python is not type-checked: ``mode="foo"`` or
    ``num_gpu_pages=True`` would pass), and its ``attention_backend`` is known (:func:`check_attention_backend`).
    numpy scalars count as the Python numbers they hold."""
    if not isinstance(config, EngineConfig):
        raise ValueError(f"expected an EngineConfig, got {type(config).__name__}")
    try:
        msgspec.convert(msgspec.to_builtins(config, enc_hook=_numpy_scalar), EngineConfig)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise ValueError(f"invalid config: {exc}") from exc
    check_attention_backend(config.attention_backend, backends)


def _numpy_scalar(value: Any) -> Any:
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return value.item()
    raise TypeError(f"a config value of type {type(value).__name__} is not a number, string, bool or list")


def check_attention_backend(name: str, backends: BackendRegistry | None = None) -> None:
    """Raise ``ValueError`` (listing the known names) unless ``name`` is ``"auto"`` or a name ``backends`` (default:
    the built-ins plus installed plugins) knows."""
    if name == "auto":
        return
    if backends is None:
        from attention_backends.registry import BackendRegistry

        backends = BackendRegistry()
    if name not in backends.names():
        raise ValueError(f"attention_backend {name!r} is unknown: use 'auto' or one of {', '.join(backends.names())}")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``"a.b=value"`` overrides to a nested dict (values parsed as JSON, else kept as strings)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form section.key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        try:
            node[leaf] = json.loads(value)
        except json.JSONDecodeError:
            node[leaf] = value.strip()
        except RecursionError:  # json's answer to values nested thousands deep
            raise ValueError(f"override {key.strip()!r}: its value is nested too deeply") from None
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: EngineConfig | None = None, backends: BackendRegistry | None = None, *,
                this_machine: bool = True) -> EngineConfig:
    """Build an :class:`EngineConfig` from an optional JSON/TOML file and ``key=value`` overrides, and check
    that this machine can run it (:func:`check_device`, :func:`check_attention_backend`) unless ``this_machine`` is
    false (a config written here for another machine, e.g. a GPU's on a CPU-only one: the values are checked, not the
    device's and attention backend's presence here).

    Args:
        path: a config file, JSON (``.json``) or TOML (``.toml``); its values replace ``base``'s entirely.
        overrides: ``section.key=value`` items applied on top (:func:`apply_overrides`).
        base: the configuration used when there is no file (default: every field's default).
        backends: where ``attention_backend`` is looked up (default: the built-ins plus installed plugins).

    Raises:
        ValueError: unreadable file, unknown key, wrong type or invalid value (the message says which).
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.suffix.lower() not in (".json", ".toml"):
            raise ValueError(f"config file {path}: unknown format {path.suffix or '(no extension)'!r}; "
                             "use .json (JSON) or .toml (TOML)")
        raw = path.read_bytes()
        try:
            data = tomllib.loads(raw.decode()) if path.suffix.lower() == ".toml" else json.loads(raw)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot parse config file {path}: {exc}") from exc
        except RecursionError:  # the parsers' answer to values nested thousands deep
            raise ValueError(f"cannot parse config file {path}: values nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} holds a JSON {type(data).__name__}, not an object of sections")
    elif base is not None:
        data = msgspec.to_builtins(base)
    data = apply_overrides(data, list(overrides or []))
    try:
        config = msgspec.convert(data, EngineConfig)
        check_device(config.device, require_available=this_machine)
        if this_machine:
            check_attention_backend(config.attention_backend, backends)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid config: {exc}") from exc
    return config
