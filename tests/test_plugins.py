"""Third-party attention backends through the ``gr_engine.attention_backends`` entry point, without pip.

A temporary ``*.dist-info`` directory whose ``entry_points.txt`` is generated from the example plugin's
own ``pyproject.toml`` (``examples/custom_backend/``) is put on ``sys.path`` with the plugin's module, so
``importlib.metadata`` discovers it exactly as it would an installed distribution.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from attention_backends import AttentionSpec, BackendRegistry
from attention_backends.torch_ref import TorchRefBackend
from gr_engine import GREngine
from tests import test_backend_conformance as conformance
from tests.conftest import tiny_config
from tests.test_backend_conformance import CASE_NAMES, case_for, check_backend, conformance_spec

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "examples" / "custom_backend"


def write_distribution(root: Path, name: str, entry_points: dict[str, str]) -> None:
    """A minimal installed-distribution record (``METADATA`` + ``entry_points.txt``) under ``root``."""
    dist = root / f"{name.replace('-', '_')}-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    lines = [f"{key} = {value}" for key, value in entry_points.items()]
    (dist / "entry_points.txt").write_text("[gr_engine.attention_backends]\n" + "\n".join(lines) + "\n")


def example_entry_points() -> dict[str, str]:
    project = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"]["gr_engine.attention_backends"])


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch) -> Path:
    """The example plugin, discoverable and importable as if pip-installed; returns the site directory."""
    write_distribution(tmp_path, "gr-engine-example-backend", example_entry_points())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    monkeypatch.delitem(sys.modules, "gr_engine_example_backend", raising=False)
    return tmp_path


def test_example_declares_scaled_ref():
    assert example_entry_points() == {"scaled_ref": "gr_engine_example_backend:ScaledRefBackend"}


def test_registry_discovers_and_creates_the_plugin(installed_plugin):
    registry = BackendRegistry()
    assert "scaled_ref" in registry.names()
    assert "scaled_ref" not in BackendRegistry(load_entry_points=False).names()
    backend_cls = registry.get("scaled_ref")
    assert backend_cls.__module__ == "gr_engine_example_backend" and issubclass(backend_cls, TorchRefBackend)
    backend = registry.create("scaled_ref", conformance_spec(backend_cls, "hstu", "cpu"))
    assert backend.name == "scaled_ref"


@pytest.mark.parametrize("case_name", CASE_NAMES)
@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_plugin_passes_the_conformance_checks(installed_plugin, monkeypatch, kind, case_name):
    backend_cls = BackendRegistry().get("scaled_ref")
    monkeypatch.setattr(backend_cls, "chunk_tokens", 16)  # one page per chunk: every multi-page case chunks
    spec = conformance_spec(backend_cls, kind, "cpu")
    check_backend(BackendRegistry().create("scaled_ref", spec), case_for(spec, case_name))


@pytest.mark.parametrize("case_name", CASE_NAMES)
@pytest.mark.parametrize("kind", ["hstu", "softmax"])
def test_plugin_ignores_non_finite_garbage_outside_histories(installed_plugin, monkeypatch, kind, case_name):
    backend_cls = BackendRegistry().get("scaled_ref")
    monkeypatch.setattr(backend_cls, "chunk_tokens", 16)
    spec = conformance_spec(backend_cls, kind, "cpu")
    conformance.check_ignores_garbage(BackendRegistry().create("scaled_ref", spec), case_name)


def test_conformance_registry_checks_hold_with_the_plugin_installed(installed_plugin):
    """The suite must pass after ``pip install -e examples/custom_backend`` (README), not only without plugins."""
    assert "scaled_ref" in BackendRegistry().names()
    conformance.test_unknown_backend_lists_known_names()


@pytest.mark.parametrize("architecture", ["hstu", "sasrec"])
def test_engine_selects_the_plugin_by_name(installed_plugin, architecture):
    from tests.test_engine_differential import max_diff, stream

    config = tiny_config(architecture=architecture)
    requests = stream(config, num_users=6, visits=4, seed=2)
    expected = GREngine(config).rank(requests, use_tqdm=False)
    engine = GREngine(msgspec.structs.replace(config, attention_backend="scaled_ref"))
    assert type(engine.backend).__name__ == "ScaledRefBackend"
    assert max_diff(engine.rank(requests, use_tqdm=False), expected) <= 1e-5


def test_programmatic_registration():
    class MyBackend(TorchRefBackend):
        name = "my_backend"

    registry = BackendRegistry(load_entry_points=False)
    registry.register("my_backend", MyBackend)
    engine = GREngine(msgspec.structs.replace(tiny_config(), attention_backend="my_backend"), backends=registry)
    assert type(engine.backend) is MyBackend
    with pytest.raises(ValueError, match="my_backend"):  # other engines' registries are untouched
        GREngine(msgspec.structs.replace(tiny_config(), attention_backend="my_backend"))


def test_entry_points_cannot_shadow_builtins_and_broken_plugins_say_why(tmp_path, monkeypatch):
    write_distribution(tmp_path, "bad-plugins", {
        "torch_ref": "gr_engine_example_backend:ScaledRefBackend",
        "missing_class": "attention_backends.torch_ref:NoSuchBackend",
        "missing_module": "gr_engine_no_such_plugin:Backend",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = BackendRegistry()
    assert registry.get("torch_ref") is TorchRefBackend
    spec = AttentionSpec(kind="hstu", num_heads=2, head_dim=8, page_size=4, dtype=torch.float32, device_type="cpu",
                         alpha=0.3, scaling_seqlen=17)
    assert "AttributeError" in registry.reasons_unusable("missing_class", spec)[0]
    assert "No module named 'gr_engine_no_such_plugin'" in registry.reasons_unusable("missing_module", spec)[0]
    assert registry.select("auto", spec) == "torch_ref"


def test_example_script_runs(installed_plugin):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(installed_plugin), str(PLUGIN_DIR), str(REPO)]))
    result = subprocess.run([sys.executable, str(REPO / "examples" / "custom_backend.py")], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "engine 1 attention backend: scaled_ref (gr_engine_example_backend)" in result.stdout
    diffs = [float(line.rsplit("=", 1)[1]) for line in result.stdout.splitlines() if "max |score" in line]
    assert len(diffs) == 2 and np.max(diffs) <= 1e-4, result.stdout
