"""Finding attention backends by name.

Built-in backends are listed by qualified name so their (possibly GPU-only) modules are imported only
when used. Third-party packages add backends through the entry-point group
``gr_engine.attention_backends``: each entry point's name is the backend name and its object is the
backend class (``my-pkg = "my_pkg.attention:MyBackend"``). A program can also register a class on its
own :class:`BackendRegistry` and hand that registry to the engine. There is no global registry.
"""

from __future__ import annotations

import importlib
from importlib import metadata as importlib_metadata

from .base import AttentionBackend, AttentionSpec

ENTRY_POINT_GROUP = "gr_engine.attention_backends"

BUILTIN_BACKENDS: dict[str, str] = {
    "torch_ref": "attention_backends.torch_ref:TorchRefBackend",
    "hstu_triton": "attention_backends.hstu_triton:HSTUTritonBackend",
}


def _import_qualname(qualname: str) -> type[AttentionBackend]:
    module_name, _, attr = qualname.partition(":")
    return getattr(importlib.import_module(module_name), attr)


class BackendRegistry:
    """Name -> backend class, from the built-ins, entry points and explicit registrations."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self._sources: dict[str, str | type[AttentionBackend]] = dict(BUILTIN_BACKENDS)
        if load_entry_points:
            for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
                self._sources.setdefault(ep.name, ep.value)

    def register(self, name: str, backend: type[AttentionBackend] | str) -> None:
        """Add (or replace) a backend: a class, or a ``"module:Class"`` string imported on first use."""
        self._sources[name] = backend

    def names(self) -> list[str]:
        return sorted(self._sources)

    def get(self, name: str) -> type[AttentionBackend]:
        """The backend class called ``name``; a clear error lists the known names."""
        if name not in self._sources:
            raise KeyError(f"unknown attention backend {name!r}; known: {', '.join(self.names())}")
        source = self._sources[name]
        if isinstance(source, str):
            try:
                source = _import_qualname(source)
            except ImportError as exc:  # a backend whose package is missing is simply unusable
                raise ImportError(f"attention backend {name!r} could not be imported: {exc}") from exc
            self._sources[name] = source
        return source

    def reasons_unusable(self, name: str, spec: AttentionSpec) -> list[str]:
        """Why backend ``name`` cannot serve ``spec`` (empty when it can)."""
        try:
            cls = self.get(name)
        except ImportError as exc:
            return [str(exc)]
        return cls.reasons_unsupported(spec)

    def create(self, name: str, spec: AttentionSpec) -> AttentionBackend:
        """Instantiate backend ``name`` (or the best usable one for ``"auto"``) for ``spec``.

        Raises:
            ValueError: the backend cannot serve ``spec``; the message says why.
        """
        if name == "auto":
            usable = [n for n in self.names() if not self.reasons_unusable(n, spec)]
            if not usable:
                raise ValueError("no attention backend can serve this model")
            name = max(usable, key=lambda n: (self.get(n).priority, n))
        reasons = self.reasons_unusable(name, spec)
        if reasons:
            raise ValueError(f"attention backend {name!r} cannot serve this model: " + "; ".join(reasons))
        return self.get(name)(spec)
