"""Finding attention backends by name (``docs/design.md`` section 6, "Registry"; ``docs/backends.md``)."""

from __future__ import annotations

from importlib import metadata as importlib_metadata

from .base import AttentionBackend, AttentionSpec

ENTRY_POINT_GROUP = "gr_engine.attention_backends"

BUILTIN_BACKENDS: dict[str, str] = {
    "torch_ref": "attention_backends.torch_ref:TorchRefBackend",
    "hstu_triton": "attention_backends.hstu_triton:HSTUTritonBackend",
    "flashinfer": "attention_backends.flashinfer_backend:FlashInferBackend",
    "xformers": "attention_backends.xformers_backend:XFormersBackend",
}


class BackendRegistry:
    """Name -> backend class: built-ins, installed plugins (``load_entry_points``) and :meth:`register`."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self._sources: dict[str, str | type[AttentionBackend] | importlib_metadata.EntryPoint] = dict(BUILTIN_BACKENDS)
        if load_entry_points:
            for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
                self._sources.setdefault(ep.name, ep)

    def register(self, name: str, backend: type[AttentionBackend] | str) -> None:
        """Add (or replace) a backend: a class, or a ``"module:Class"`` string imported on first use."""
        if name == "auto":
            raise ValueError("'auto' is reserved for automatic selection")
        self._sources[name] = backend

    def names(self) -> list[str]:
        """Every known backend name, sorted (whether or not it can be imported)."""
        return sorted(self._sources)

    def get(self, name: str) -> type[AttentionBackend]:
        """The backend class ``name``; ``KeyError`` if unknown, ``ImportError`` if it does not import to one."""
        if name not in self._sources:
            raise KeyError(f"unknown attention backend {name!r}; known: {', '.join(self.names())}")
        source = self._sources[name]
        if isinstance(source, type):
            return source
        entry_point = (source if isinstance(source, importlib_metadata.EntryPoint)
                       else importlib_metadata.EntryPoint(name=name, value=source, group=ENTRY_POINT_GROUP))
        try:
            backend = entry_point.load()
        except Exception as exc:  # a missing package or a broken plugin only makes this backend unusable
            raise ImportError(f"attention backend {name!r} could not be imported from {entry_point.value!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise ImportError(f"attention backend {name!r}: {entry_point.value!r} is not an AttentionBackend subclass")
        self._sources[name] = backend
        return backend

    def reasons_unusable(self, name: str, spec: AttentionSpec) -> list[str]:
        """Why backend ``name`` cannot serve ``spec`` (empty when it can)."""
        try:
            backend = self.get(name)
        except ImportError as exc:
            return [str(exc)]
        return backend.reasons_unsupported(spec)

    def select(self, name: str, spec: AttentionSpec) -> str:
        """Resolve ``name`` to a backend that can serve ``spec``; ``"auto"``: the usable one of highest ``priority``
        (ties: the larger name). ``KeyError``: unknown; ``ValueError``: it (``"auto"``: every one) cannot, with why."""
        if name != "auto":
            reasons = self.reasons_unusable(name, spec)
            if reasons:
                raise ValueError(f"attention backend {name!r} cannot serve this model: " + "; ".join(reasons))
            return name
        reasons_by_name = {n: self.reasons_unusable(n, spec) for n in self.names()}
        usable = [n for n, reasons in reasons_by_name.items() if not reasons]
        if not usable:
            details = "\n".join(f"  {n}: " + "; ".join(r) for n, r in reasons_by_name.items())
            raise ValueError(f"no attention backend can serve this model:\n{details}")
        return max(usable, key=lambda n: (self.get(n).priority, n))

    def create(self, name: str, spec: AttentionSpec) -> AttentionBackend:
        """Instantiate backend ``name`` (``"auto"``: as :meth:`select`) for ``spec``; raises as :meth:`select`."""
        return self.get(self.select(name, spec))(spec)
