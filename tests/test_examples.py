"""The README's examples run as a user runs them and do what they promise: its Python example (the visit's second
call reuses 3 cached events and encodes 1), its ``curl`` body against ``gr-engine serve``, and ``python
examples/X.py`` from the repository root (the offline ranking's cached scores equal recomputed ones, the retrieval's
second visits reuse the cache; ``custom_backend.py`` runs in tests/test_plugins.py, with its plugin installed)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_python_example_prints_what_its_comment_says() -> None:
    [code] = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue().split()[-2:] == ["3", "1"], printed.getvalue()  # "# ..., 3, 1"
    assert "# ..., 3, 1" in code


def test_readme_curl_and_serving_msgpack_examples_are_served(tmp_path: Path) -> None:
    """The README's ``curl`` body, and docs/serving.md's msgpack client (its URL pointed at the test's server)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("zmq")
    import httpx
    import numpy as np

    from .test_serving import Server

    [curl] = re.findall(r"^  curl (.*?)\n  ```", README, flags=re.S | re.M)
    words = shlex.split(curl)
    body = json.loads(words[words.index("-d") + 1])
    [client] = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "serving.md").read_text(), flags=re.S)
    server = Server(tmp_path)
    try:
        answer = httpx.post(f"{server.url}/v1/rank", json=body, timeout=30)
        names: dict = {}
        exec(compile(client.replace("http://127.0.0.1:8000", server.url), "serving.md", "exec"), names)
    finally:
        assert server.stop() == 0
    assert answer.status_code == 200
    [output] = answer.json()["outputs"]
    assert output["error"] is None and output["request_id"] == "a" and len(output["scores"]) == 2
    assert names["out"]["error"] is None and names["scores"].shape == (2, 3)  # 2 candidates, the tiny model's 3 tasks
    np.testing.assert_allclose(names["scores"], np.array(output["scores"], dtype=np.float32), atol=1e-5)


def run_example(name: str) -> str:
    result = subprocess.run([sys.executable, str(REPO / "examples" / name)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def test_offline_ranking_example_scores_equal_recompute() -> None:
    out = run_example("offline_ranking.py")
    cached, encoded = map(int, re.search(r"day 2: (\d+) history tokens from cache, (\d+) encoded", out).groups())
    assert cached == 16 * 1000 and encoded == 16 * 40, out  # day 2 encodes only the 40 events added since day 1
    assert float(re.search(r"score difference: (\S+)", out).group(1)) <= 1e-5, out


def test_generate_example_second_visits_hit_the_cache() -> None:
    out = run_example("generate.py")
    first = re.findall(r"^user-\d+: (.+)$", out, flags=re.M)
    assert len(first) == 4 and all(len(items.split(", ")) == 5 for items in first), out
    again = re.findall(r"^user-\d+-again: (\d+) cached, (\d+) encoded", out, flags=re.M)
    assert len(again) == 4 and all(int(cached) > 0 and encoded == "2" for cached, encoded in again), out
