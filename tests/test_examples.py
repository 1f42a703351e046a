"""The README's examples run as a user runs them (``python examples/X.py`` from the repository root) and print what
they promise: the offline ranking's cached scores equal recomputed ones, the retrieval's second visits reuse the
cache. (``custom_backend.py`` runs in tests/test_plugins.py, with its plugin installed.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
