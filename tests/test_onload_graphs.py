"""The onload graphs' bookkeeping (:class:`cache_engine.onload_graphs.OnloadGraphs`) on CPU, with stand-ins for
CUDA events and captured graphs: which graphs :meth:`capture_all` captures, which one each replay uses and what it
writes into that graph's index buffer, and when the host waits for an earlier replay. The GPU tests replay real
graphs (``tests/test_gpu_engine.py``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")  # cache_engine.onload_graphs imports the onload kernel's module

from cache_engine import onload_graphs
from cache_engine.onload_graphs import OnloadGraphs


class FakeEvent:
    """A CUDA event stand-in: ``done`` says whether its last record has completed."""

    def __init__(self, **_: object) -> None:
        self.records, self.done, self.waited = 0, True, 0

    def record(self, stream: object = None) -> None:
        self.records += 1

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


class FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(onload_graphs.torch.cuda, "Event", FakeEvent)
    captured = []

    def capture(self, capacity, turn):
        captured.append((capacity, turn))
        self._replayed[turn].record(self.stream)
        return FakeGraph(), np.zeros(3 * capacity + 1, dtype=np.int64)

    monkeypatch.setattr(OnloadGraphs, "_capture", capture)
    made = OnloadGraphs(launcher=None, kv=None, layer_bytes=64, src_dtype=None, scales=None, events=[],
                        stream=None, min_capacity=256)
    return made, captured


def test_capture_all_captures_every_capacity_up_to_the_largest_for_every_turn(graphs):
    made, captured = graphs
    assert made.capture_all(1000) == 6  # 256, 512, 1024 (covers 1,000 pages) for each of two turns
    assert captured == [(256, 0), (256, 1), (512, 0), (512, 1), (1024, 0), (1024, 1)]
    assert made.capture_all(1024) == 6 and len(captured) == 6  # nothing captured twice


def test_replays_alternate_turns_write_their_indices_and_wait_only_for_a_busy_turn(graphs):
    made, captured = graphs
    made.capture_all(512)
    pages, slots, addresses = np.arange(300), np.arange(300) % 7, np.arange(300) * 16
    assert made.begin() == 0
    assert made.replay(pages, slots, addresses)  # 300 pages: the 512-page graph of turn 0
    graph, flat = made._graphs[512, 0]
    assert graph.replays == 1 and flat[-1] == 300
    assert np.array_equal(flat[:300], pages) and np.array_equal(flat[512:812], slots)
    assert np.array_equal(flat[1024:1324], addresses)
    made._replayed[0].done = False  # turn 0's replay still running on the device
    assert made.begin() == 1 and made._replayed[0].waited == 0  # turn 1 is free: no wait
    assert made.replay(pages[:10], slots[:10], addresses[:10])  # the 256-page graph of turn 1
    assert made._graphs[256, 1][0].replays == 1 and made._graphs[256, 1][1][-1] == 10
    assert made.begin() == 0 and made._replayed[0].waited == 1  # turn 0 again: the host waits for its replay
    assert len(captured) == 4  # every replay used a graph captured before serving


def test_a_failed_capture_turns_graphs_off_for_warming_and_for_steps(graphs, monkeypatch):
    made, captured = graphs

    def failing(self, capacity, turn):
        if capacity == 512:
            raise RuntimeError("capture failed")
        captured.append((capacity, turn))
        return FakeGraph(), np.zeros(3 * capacity + 1, dtype=np.int64)

    monkeypatch.setattr(OnloadGraphs, "_capture", failing)
    assert made.capture_all(1000) == 0 and not made.enabled
    assert captured == [(256, 0), (256, 1)]  # nothing tried after the failure
    assert not made.replay(np.arange(300), np.arange(300), np.arange(300))  # launched eagerly instead
