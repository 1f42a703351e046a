"""Adding an attention backend from outside gr-engine, two ways.

1. As an installed plugin: the package in ``examples/custom_backend/`` declares its backend class in the
   ``gr_engine.attention_backends`` entry-point group, and any engine finds it by name
   (``attention_backend = "scaled_ref"`` in the config, or ``--set attention_backend=scaled_ref``).
2. Programmatically: register a class on your own ``BackendRegistry`` and hand it to the engine.

Both engines must give the scores of the built-in ``torch_ref`` backend.

Run: pip install -e examples/custom_backend && python examples/custom_backend.py
"""

from __future__ import annotations

import sys
from typing import ClassVar

import msgspec
import numpy as np

from attention_backends import BackendRegistry
from gr_engine import EngineConfig, GREngine, ModelConfig, RankOutput
from gr_engine.synthetic import synthetic_requests


def max_difference(a: list[RankOutput], b: list[RankOutput]) -> float:
    return max(float(np.abs(np.asarray(x.scores) - np.asarray(y.scores)).max()) for x, y in zip(a, b))


def main() -> None:
    if "scaled_ref" not in BackendRegistry().names():
        sys.exit("the example plugin is not installed: pip install -e examples/custom_backend")
    from gr_engine_example_backend import ScaledRefBackend  # the plugin's module, to subclass it below

    config = EngineConfig(model=ModelConfig(num_items=5_000, max_history_len=1024), attention_backend="scaled_ref")
    requests = synthetic_requests(config.model, num_users=4, visits_per_user=2, first_history=(50, 300), seed=0)

    # 1. By name: the registry the engine builds lists the built-ins and every installed plugin.
    plugin = GREngine(config)
    print(f"engine 1 attention backend: {plugin.backend.name} ({type(plugin.backend).__module__})")

    # 2. Programmatically: a variant with 64-key chunks, registered on our own registry.
    class SmallChunks(ScaledRefBackend):
        name: ClassVar[str] = "small_chunks"
        chunk_tokens: ClassVar[int] = 64

    registry = BackendRegistry()
    registry.register("small_chunks", SmallChunks)
    small = GREngine(msgspec.structs.replace(config, attention_backend="small_chunks"), backends=registry)
    print(f"engine 2 attention backend: {small.backend.name}; known: {', '.join(registry.names())}")

    reference = GREngine(msgspec.structs.replace(config, attention_backend="torch_ref")).rank(requests, use_tqdm=False)
    for label, engine in (("scaled_ref", plugin), ("small_chunks", small)):
        diff = max_difference(engine.rank(requests, use_tqdm=False), reference)
        print(f"{label}: {len(requests)} requests, max |score - torch_ref score| = {diff:.1e}")


if __name__ == "__main__":
    main()
