"""One conformance suite for every registered attention backend, and the registry's selection rules.

The suite is parametrized over ``BackendRegistry().names()`` (built-ins and installed plugins), so a newly
registered backend is covered without editing this file. For each backend, each attention kind it
supports, each device (CPU; CUDA as ``gpu`` tests) and each edge-case batch, it runs ``build_metadata`` ->
``append_kv`` -> ``attend`` and checks that the pages hold every history token afterwards and that the
output equals the dense float64 oracle within the dtype's tolerance. A backend that cannot serve the
configuration is skipped with its own reasons. On CPU, ``hstu_triton`` runs in Triton's interpreter
(``TRITON_INTERPRET=1`` is set below before anything imports its kernels, as in ``test_hstu_triton``).
"""

from __future__ import annotations

import os
import re

import msgspec
import pytest
import torch

if not torch.cuda.is_available():  # the Triton interpreter; read when hstu_triton's kernels are defined
    os.environ["TRITON_INTERPRET"] = "1"

from attention_backends import AttentionBackend, AttentionSpec, BackendRegistry
from attention_backends.hstu_triton import HSTUTritonBackend
from attention_backends.registry import BUILTIN_BACKENDS
from gr_engine import GREngine
from tests.attention_cases import (
    AttentionCase,
    build_case,
    check_cache_holds_history,
    history_slots,
    reference_attention,
)
from tests.conftest import requires_cuda, tiny_config

#: Largest error allowed, as a fraction of the largest |output| of the batch.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 3e-3, torch.bfloat16: 2e-2}
PREFERRED_DTYPES = {"cpu": (torch.float32, torch.float64), "cuda": (torch.bfloat16, torch.float16, torch.float32)}


def edge_cases(page_size: int) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """(tokens cached before the step, new history rows, candidate rows) per request, for page size ``P``."""
    p = page_size
    return {
        "last_page_full": ([p - 2, 2 * p], [2, 0], [1, 2]),
        "last_page_one_token": ([p, 2 * p - 1], [1, 2], [2, 0]),
        "append_crosses_pages": ([p - 1], [p + 2], [3]),
        "no_cached_history": ([0, 0], [p + 3, 1], [0, 2]),
        "one_new_token": ([3 * p], [1], [0]),
        "candidates_only": ([p + 5, 1], [0, 0], [4, 1]),
        "empty_history": ([0, 0, p], [0, 0, 0], [3, 1, 2]),
        "mixed_lengths": ([5, 0, 2 * p + 3, 7, 0], [3, p, 1, 0, 0], [2, 3, 0, 4, 2]),
    }


CASE_NAMES = list(edge_cases(16))
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, requires_cuda])]


def backend_kinds(registry: BackendRegistry) -> list:
    """``(name, kind)`` for every backend of ``registry`` and each kind it supports; a backend that cannot
    be imported gets one item that is skipped with the import error."""
    params = []
    for name in registry.names():
        try:
            kinds = sorted(registry.get(name).support.kinds)
        except ImportError as exc:
            params.append(pytest.param(name, None, id=f"{name}-unimportable", marks=pytest.mark.skip(reason=str(exc))))
            continue
        params += [pytest.param(name, kind, id=f"{name}-{kind}") for kind in kinds]
    return params


def conformance_spec(backend: type[AttentionBackend], kind: str, device: str, time_buckets: int = 0) -> AttentionSpec:
    """A small spec the backend declares it can serve, where possible (2 heads; head dim 16 on CPU and 64
    on CUDA; page size 16; float32 on CPU, bf16 on CUDA), else the nearest values it lists."""
    support = backend.support

    def pick(allowed: frozenset[int] | None, preferred: int) -> int:
        return preferred if allowed is None or preferred in allowed else min(allowed, key=lambda x: abs(x - preferred))

    dtype = next((d for d in PREFERRED_DTYPES[device] if d in support.dtypes), PREFERRED_DTYPES[device][0])
    head_dim = pick(support.head_dims, 16 if device == "cpu" else 64)
    return AttentionSpec(kind=kind, num_heads=2, head_dim=head_dim, page_size=pick(support.page_sizes, 16),
                         dtype=dtype, device_type=device, alpha=head_dim**-0.5, scaling_seqlen=17,
                         time_bias_buckets=time_buckets)


def create_or_skip(registry: BackendRegistry, name: str, spec: AttentionSpec) -> AttentionBackend:
    """The backend for ``spec``, or a skip that carries the backend's reasons."""
    reasons = registry.reasons_unusable(name, spec)
    if reasons:
        pytest.skip(f"{name} cannot serve {spec.kind}/{spec.dtype}/{spec.device_type}: " + "; ".join(reasons))
    return registry.create(name, spec)


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` equals ``expected`` (float64) within ``TOLERANCE[dtype]`` of the output's scale."""
    got = got.double().cpu()
    assert torch.isfinite(got).all(), "non-finite output"
    scale = expected.abs().max().clamp(min=1e-6) if expected.numel() else torch.tensor(1.0, dtype=torch.float64)
    err = float((got - expected).abs().max() / scale) if expected.numel() else 0.0
    assert err <= TOLERANCE[dtype], f"max error {err:.3g} x output scale exceeds {TOLERANCE[dtype]}"


def check_backend(backend: AttentionBackend, case: AttentionCase) -> None:
    """The conformance checks: append the case's new history rows, attend, compare with the dense oracle."""
    spec = backend.spec
    meta = backend.build_metadata(case.metadata)
    backend.append_kv(case.kv_cache, case.k, case.v, meta)
    check_cache_holds_history(case)
    out = backend.attend(case.q, case.k, case.v, case.kv_cache, meta, time_bias=case.time_bias)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, reference_attention(case, spec.alpha, spec.scaling_seqlen, spec.kind), spec.dtype)


def case_for(spec: AttentionSpec, case_name: str, other_pages: int = 0) -> AttentionCase:
    cached, new, candidates = edge_cases(spec.page_size)[case_name]
    return build_case(cached, new, candidates, heads=spec.num_heads, dim=spec.head_dim, page_size=spec.page_size,
                      dtype=spec.dtype, device=spec.device_type, seed=len(case_name),
                      time_buckets=spec.time_bias_buckets, other_pages=other_pages)


def poison_unused_slots(case: AttentionCase) -> None:
    """Fill K and V of every cache slot that holds no history of the batch (the unwritten tail of last pages,
    free pages, other users' pages) with +inf, -inf and NaN, in turn."""
    unused = ~history_slots(case).to(case.kv_cache.device)
    values = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=case.kv_cache.dtype)
    slots = case.kv_cache.permute(0, 2, 1, 3, 4)[unused]  # [slots, 2, H, D]
    poison = values.repeat(-(-slots.numel() // 3))[: slots.numel()].reshape(slots.shape)
    case.kv_cache.permute(0, 2, 1, 3, 4)[unused] = poison.to(case.kv_cache.device)


@pytest.mark.parametrize("time_buckets", [0, 12], ids=["plain", "time_bias"])
@pytest.mark.parametrize("case_name", CASE_NAMES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "kind"), backend_kinds(BackendRegistry()))
def test_backend_conforms(name, kind, device, case_name, time_buckets):
    registry = BackendRegistry()
    spec = conformance_spec(registry.get(name), kind, device, time_buckets)
    backend = create_or_skip(registry, name, spec)
    check_backend(backend, case_for(spec, case_name))


@pytest.mark.parametrize("time_buckets", [0, 12], ids=["plain", "time_bias"])
@pytest.mark.parametrize("case_name", CASE_NAMES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "kind"), backend_kinds(BackendRegistry()))
def test_non_finite_garbage_outside_histories_is_ignored(name, kind, device, case_name, time_buckets):
    """inf/NaN in slots no request of the batch owns (page 0 among them: another user's) change nothing."""
    registry = BackendRegistry()
    spec = conformance_spec(registry.get(name), kind, device, time_buckets)
    check_ignores_garbage(create_or_skip(registry, name, spec), case_name)


def check_ignores_garbage(backend: AttentionBackend, case_name: str) -> None:
    """The case run twice, with random and with non-finite garbage outside the batch's histories (pages 0 and
    1 belong to no request of the batch): both outputs are finite, bit-identical and match the oracle."""
    spec = backend.spec
    outputs = []
    for poisoned in (False, True):
        case = case_for(spec, case_name, other_pages=2)
        if poisoned:
            poison_unused_slots(case)
            assert not torch.isfinite(case.kv_cache[0]).any()  # page 0 belongs to no request of the batch
        meta = backend.build_metadata(case.metadata)
        backend.append_kv(case.kv_cache, case.k, case.v, meta)
        outputs.append(backend.attend(case.q, case.k, case.v, case.kv_cache, meta, time_bias=case.time_bias))
    clean, dirty = outputs
    assert_close(dirty, reference_attention(case, spec.alpha, spec.scaling_seqlen, spec.kind), spec.dtype)
    assert torch.equal(dirty, clean)


# ---- the registry ----------------------------------------------------------------------------------


def cpu_spec(kind: str = "hstu", page_size: int = 16, head_dim: int = 16, dtype: torch.dtype = torch.float32):
    return AttentionSpec(kind=kind, num_heads=2, head_dim=head_dim, page_size=page_size, dtype=dtype,
                         device_type="cpu", alpha=0.25, scaling_seqlen=17)


def test_builtins_are_listed_and_import_without_optional_packages():
    registry = BackendRegistry(load_entry_points=False)
    assert registry.names() == sorted(BUILTIN_BACKENDS) == ["flashinfer", "hstu_triton", "torch_ref", "xformers"]
    for name in registry.names():
        backend = registry.get(name)  # flashinfer / xformers / triton are imported lazily, if at all
        assert issubclass(backend, AttentionBackend) and backend.name == name
    # The usable-first order `auto` uses: the Triton kernel, then FlashInfer's append + it, then the oracle.
    priority = {name: registry.get(name).priority for name in registry.names()}
    assert priority["hstu_triton"] > priority["flashinfer"] > priority["torch_ref"]
    assert priority["xformers"] > priority["torch_ref"]


def test_unknown_backend_lists_known_names():
    """The message lists every known name: the built-ins, and any installed plugin's."""
    registry = BackendRegistry()
    with pytest.raises(KeyError, match="unknown attention backend 'nope'; known: ") as info:
        registry.create("nope", cpu_spec())
    listed = re.search(r"known: ([^'\"]*)", str(info.value)).group(1).split(", ")
    assert set(BUILTIN_BACKENDS) <= set(listed)
    assert listed == registry.names()


def test_backend_whose_import_fails_reports_why():
    registry = BackendRegistry(load_entry_points=False)
    registry.register("broken", "gr_engine_no_such_module:Backend")
    registry.register("not_a_backend", "attention_backends.paged:get_seq_lens")
    [reason] = registry.reasons_unusable("broken", cpu_spec())
    assert "could not be imported" in reason and "No module named 'gr_engine_no_such_module'" in reason
    with pytest.raises(ValueError, match=r"'broken' cannot serve this model: .*ModuleNotFoundError"):
        registry.create("broken", cpu_spec())
    assert "not an AttentionBackend subclass" in registry.reasons_unusable("not_a_backend", cpu_spec())[0]
    assert registry.select("auto", cpu_spec(page_size=4)) == "torch_ref"  # broken ones are skipped
    with pytest.raises(ValueError, match="reserved"):
        registry.register("auto", "x:y")


def test_auto_on_cpu_picks_hstu_triton_only_when_usable(monkeypatch):
    registry = BackendRegistry(load_entry_points=False)
    spec = cpu_spec()
    expected = "torch_ref" if HSTUTritonBackend.reasons_unsupported(spec) else "hstu_triton"
    assert registry.select("auto", spec) == expected
    assert type(registry.create("auto", spec)).name == expected
    # Configurations hstu_triton cannot serve fall back to the oracle.
    assert registry.select("auto", cpu_spec(page_size=4)) == "torch_ref"
    assert registry.select("auto", cpu_spec(head_dim=8)) == "torch_ref"
    assert registry.select("auto", cpu_spec(kind="softmax")) == "torch_ref"  # xformers is CUDA-only
    assert registry.select("auto", cpu_spec(dtype=torch.float64)) == "torch_ref"
    import attention_backends.hstu_triton as hstu_triton

    monkeypatch.setattr(hstu_triton, "INTERPRETED", False)  # compiled Triton on a CPU: not usable
    assert registry.select("auto", spec) == "torch_ref"


def test_auto_with_no_usable_backend_lists_every_reason():
    spec = cpu_spec(dtype=torch.int8)
    with pytest.raises(ValueError, match="no attention backend can serve") as info:
        BackendRegistry(load_entry_points=False).select("auto", spec)
    for name in BUILTIN_BACKENDS:
        assert f"  {name}: " in str(info.value)
    assert "dtype torch.int8" in str(info.value)


@pytest.mark.parametrize(("name", "reason"), [
    ("xformers", "attention kind 'hstu' not in ['softmax']"),
    ("flashinfer", "device 'cpu' not in ['cuda']"),
    ("hstu_triton", "page_size 4 not in [16, 32, 64]"),
])
def test_engine_start_fails_with_the_backends_reasons(name, reason):
    config = msgspec.structs.replace(tiny_config(), attention_backend=name)
    with pytest.raises(ValueError, match=f"attention backend '{name}' cannot serve this model: .*{re.escape(reason)}"):
        GREngine(config)


def test_engine_auto_selects_a_usable_backend():
    engine = GREngine(msgspec.structs.replace(tiny_config(), attention_backend="auto"),
                      backends=BackendRegistry(load_entry_points=False))
    assert engine.backend.name == "torch_ref"  # tiny_config's page size 4 and head dim 8 rule out hstu_triton
