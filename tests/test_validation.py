"""Every bad request gets a clear error of its own; its batch-mates are served."""

from __future__ import annotations

import numpy as np
import pytest

from gr_engine import GenerateParams, GenerateRequest, GREngine, RankOutput, RankRequest, RequestError
from tests.conftest import tiny_config


def good(**changes) -> RankRequest:
    fields = dict(request_id="ok", user_id=1, item_ids=[1, 2, 3], action_ids=[0, 1, 2],
                  timestamps=[10, 10, 20], candidate_item_ids=[4, 5])
    fields.update(changes)
    return RankRequest(**fields)


BAD = {
    "unequal_lengths": (dict(action_ids=[0, 1]), "differ in length"),
    "item_out_of_vocab": (dict(item_ids=[1, 2, 200]), "item_ids contains 200"),
    "negative_item": (dict(item_ids=[1, -2, 3]), "item_ids contains -2"),
    "action_out_of_vocab": (dict(action_ids=[0, 1, 8]), "action_ids contains 8"),
    "candidate_out_of_vocab": (dict(candidate_item_ids=[4, 999]), "candidate_item_ids contains 999"),
    "negative_candidate": (dict(candidate_item_ids=[-1]), "candidate_item_ids contains -1"),
    "no_candidates": (dict(candidate_item_ids=[]), "nothing to rank"),
    "too_many_candidates": (dict(candidate_item_ids=list(range(13))), "exceed model.max_candidates"),
    "history_too_long": (dict(item_ids=[1] * 257, action_ids=[0] * 257, timestamps=list(range(257))),
                         "exceeds model.max_history_len"),
    "timestamps_backwards": (dict(timestamps=[10, 30, 20]), "timestamps go backwards at event 2"),
    "float_ids": (dict(item_ids=[1.0, 2.5, 3.0]), "item_ids must be a flat list of integers"),
    "string_ids": (dict(candidate_item_ids=["a", "b"]), "candidate_item_ids must be a flat list of integers"),
    "nested_ids": (dict(item_ids=[[1], [2], [3]]), "flat list of integers"),
    "ids_not_a_list": (dict(item_ids=7), "item_ids must be a list of integers, got int"),
    "bool_ids": (dict(action_ids=[True, False, True]), "flat list of integers"),
    "item_beyond_64_bits": (dict(item_ids=[1, 2**70, 3]), r"item_ids contains 1180591620717411303424, outside the "
                            r"64-bit integer range \[-9223372036854775808, 9223372036854775807\]"),
    "candidate_beyond_64_bits": (dict(candidate_item_ids=[-(2**64)]),
                                 "candidate_item_ids contains -18446744073709551616, outside the 64-bit"),
    "timestamp_in_uint64_only": (dict(timestamps=[10, 10, 2**64 - 1]), "timestamps contains 18446744073709551615, "
                                 "outside the 64-bit"),
    "timestamps_all_in_uint64": (dict(timestamps=[2**63, 2**63, 2**63]), "timestamps contains 9223372036854775808, "
                                 "outside the 64-bit"),
    "uint64_array_beyond_int64": (dict(timestamps=np.array([1, 2, 2**63], dtype=np.uint64)),
                                  "timestamps contains 9223372036854775808, outside the 64-bit"),
    "user_id_wrong_type": (dict(user_id=1.5), "user_id must be an int or a string"),
    "user_id_beyond_uint64": (dict(user_id=2**64), r"user_id 18446744073709551616 does not fit in 64 bits"),
    "user_id_below_int64": (dict(user_id=-(2**63) - 1), "user_id -9223372036854775809 does not fit in 64 bits"),
    "request_id_wrong_type": (dict(request_id=3), "request_id must be a string"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_request_rejected_with_clear_error(name):
    changes, message = BAD[name]
    engine = GREngine(tiny_config())
    with pytest.raises(RequestError, match=message):
        engine.add_request(good(**changes))
    [output] = engine.rank([good(**changes)], use_tqdm=False)
    assert not output.ok and message.split()[0] in output.error
    assert output.scores.size == 0


@pytest.mark.parametrize("user_id", [2**64 - 1, -(2**63)])
def test_user_ids_of_64_bits_signed_or_unsigned_are_served(user_id):
    [output] = GREngine(tiny_config()).rank([good(user_id=user_id)], use_tqdm=False)
    assert output.ok and output.user_id == user_id


def test_not_a_request_object():
    engine = GREngine(tiny_config())
    [output] = engine.rank([{"request_id": "x"}], use_tqdm=False)
    assert "expected a RankRequest, got dict" in output.error


def test_history_larger_than_cache_is_rejected():
    engine = GREngine(tiny_config(num_gpu_pages=8, page_size=4))  # room for 32 tokens
    n = 40
    [output] = engine.rank([good(item_ids=[1] * n, action_ids=[0] * n, timestamps=list(range(n)))],
                           use_tqdm=False)
    assert "needs 10 KV pages but cache.num_gpu_pages is 8" in output.error


def test_retrieval_needs_history():
    engine = GREngine(tiny_config())
    [output] = engine.generate([GenerateRequest(request_id="g", user_id=1, item_ids=[], action_ids=[],
                                                timestamps=[])], use_tqdm=False)
    assert "at least one history event" in output.error


def test_duplicate_in_flight_request_id():
    engine = GREngine(tiny_config())
    engine.add_request(good())
    with pytest.raises(RequestError, match="already in flight"):
        engine.add_request(good())


def test_bad_requests_inside_a_batch_fail_alone():
    rng = np.random.default_rng(0)
    requests, expected_bad = [], set()
    for i in range(24):
        if i % 4 == 1:
            names = [n for n in sorted(BAD) if not {"request_id", "user_id"} & set(BAD[n][0])]  # ids set here
            changes = BAD[names[i % len(names)]][0]
            requests.append(good(request_id=f"r{i}", user_id=i % 5, **changes))
            expected_bad.add(i)
        else:
            n = int(rng.integers(0, 60))
            requests.append(good(request_id=f"r{i}", user_id=i % 5, item_ids=rng.integers(0, 200, n).tolist(),
                                 action_ids=rng.integers(0, 8, n).tolist(), timestamps=list(range(n)),
                                 candidate_item_ids=rng.integers(0, 200, 3).tolist()))
    engine = GREngine(tiny_config())
    outputs = engine.rank(requests, use_tqdm=False)
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    for i, (request, output) in enumerate(zip(requests, outputs)):
        if i in expected_bad:
            assert output.error, i
            continue
        assert output.error is None and output.request_id == request.request_id
        # Each good request's scores equal those of the same request served on its own.
        alone = GREngine(tiny_config(mode="recompute")).rank([request], use_tqdm=False)[0]
        np.testing.assert_allclose(output.scores, alone.scores, atol=1e-5, rtol=0)


def test_numpy_arrays_are_accepted():
    engine = GREngine(tiny_config())
    request = good(item_ids=np.array([1, 2, 3]), action_ids=np.array([0, 1, 2], dtype=np.int32),
                   timestamps=np.array([1, 2, 3]), candidate_item_ids=np.array([4, 5]))
    [output] = engine.rank([request], use_tqdm=False)
    [expected] = engine.rank([good(request_id="again", user_id=2, timestamps=[1, 2, 3])], use_tqdm=False)
    assert output.error is None
    np.testing.assert_allclose(output.scores, expected.scores, atol=1e-6)


def test_failing_step_is_retried_alone_so_only_the_culprit_fails(monkeypatch):
    """A request that makes a step fail (here: an injected error) fails alone; its batch-mates, retried
    one by one, get the same scores as when served normally."""
    rng = np.random.default_rng(5)
    requests = [good(request_id=f"r{i}", user_id=f"u{i}", item_ids=rng.integers(0, 200, 30).tolist(),
                     action_ids=rng.integers(0, 8, 30).tolist(), timestamps=list(range(30)))
                for i in range(6)]
    expected = GREngine(tiny_config()).rank(requests, use_tqdm=False)
    engine = GREngine(tiny_config(max_num_seqs=8, max_num_batched_tokens=400))
    strip = engine.runner.strip

    def failing_strip(chunks, meta):
        if any(c.request.user_id == "u3" for c in chunks):
            raise RuntimeError("injected failure")
        return strip(chunks, meta)

    monkeypatch.setattr(engine.runner, "strip", failing_strip)
    outputs = engine.rank(requests, use_tqdm=False)
    assert "injected failure" in outputs[3].error
    for i in (0, 1, 2, 4, 5):
        assert outputs[i].error is None
        np.testing.assert_allclose(outputs[i].scores, expected[i].scores, atol=1e-6)
    assert not engine.has_unfinished_requests()
    engine.kv.check_invariants()


@pytest.mark.parametrize("mode", ["gpu_only", "recompute"])
def test_returning_users_new_and_changed_events_are_still_checked(mode):
    """Events equal to a user's last validated history are not checked again; everything else is, at the right
    event index: new events, the step from the last known event to the first new one, and a changed prefix."""
    engine = GREngine(tiny_config(mode=mode))
    items, actions, times = list(range(1, 19)), [0, 1] * 9, list(range(100, 118))

    def visit(request_id, n, **changes):
        fields = dict(item_ids=items[:n], action_ids=actions[:n], timestamps=times[:n])
        fields.update(changes)
        return engine.rank([good(request_id=request_id, **fields)], use_tqdm=False)[0]

    assert visit("v1", 12).ok
    cases = {  # each against the 12 validated events, 8 of them whole pages of 4 (those reused)
        "new_item": (dict(item_ids=items[:14] + [200, 3]), "item_ids contains 200"),
        "new_action": (dict(action_ids=actions[:15] + [8]), "action_ids contains 8"),
        "back_at_boundary": (dict(timestamps=times[:12] + [50] + times[13:16]), "timestamps go backwards at event 12"),
        "back_in_partial_page": (dict(timestamps=times[:9] + [0] + times[10:16]), "at event 9"),
        "changed_prefix": (dict(item_ids=[1, 2, 999] + items[3:16]), "item_ids contains 999"),
    }
    for name, (changes, message) in cases.items():
        out = visit(name, 16, **changes)
        assert not out.ok and message in out.error, (name, out.error)
    assert visit("v2", 16).ok and visit("v3", 18).ok


def test_scores_are_float32_arrays_per_candidate_and_task_and_are_written_as_lists(tmp_path):
    """``RankOutput.scores`` is float32 ``[num_candidates, num_tasks]`` (``[0, 0]`` when the request failed), and
    ``OutputWriter`` turns it into nested lists in JSONL."""
    import msgspec

    from gr_engine.output_writer import OutputWriter

    config = tiny_config()
    engine = GREngine(config)
    outputs = engine.rank([good(candidate_item_ids=[4, 5, 6]), good(request_id="bad", item_ids=[1, 2, 200])],
                          use_tqdm=False)
    ok, bad = outputs
    assert ok.scores.dtype == np.float32 and ok.scores.shape == (3, config.model.num_tasks)
    assert bad.scores.shape == (0, 0)
    with OutputWriter(tmp_path / "out.jsonl", RankOutput) as writer:
        writer.write(outputs)
    rows = [msgspec.json.decode(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert rows[0]["scores"] == ok.scores.tolist() and rows[1]["scores"] == []


def test_params_that_are_not_generate_params_are_refused_alone():
    """A dict (or any non-``GenerateParams``) as ``params`` is a clear error, raised by ``add_request`` and in each
    output of ``generate``; requests already queued with good params are served."""
    engine = GREngine(tiny_config())
    engine.add_request(good(request_id="queued", user_id=2), GenerateParams(top_k=3))
    with pytest.raises(RequestError, match="params must be a GenerateParams, got dict"):
        engine.add_request(good(request_id="bad", user_id=3), params={"top_k": 3})
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.request_id, o.error, len(o.item_ids)) for o in outputs] == [("queued", None, 3)]
    for params in ({"top_k": 3}, 5):
        [output] = engine.generate([good(request_id="g", user_id=4)], params, use_tqdm=False)
        assert output.error == f"params must be a GenerateParams, got {type(params).__name__}"


def test_rank_refuses_while_a_launched_step_is_unfinished_and_the_engine_stays_usable():
    engine = GREngine(tiny_config())
    engine.add_request(good(request_id="streamed", user_id=1))
    step = engine.launch_step()
    with pytest.raises(RuntimeError, match="finish_step"):
        engine.rank([good(request_id="batch", user_id=2)], use_tqdm=False)
    assert [o.request_id for o in engine.finish_step(step)] == ["streamed"]
    assert not engine.has_unfinished_requests()
    [output] = engine.rank([good(request_id="batch", user_id=2)], use_tqdm=False)  # not left "in flight"
    assert output.ok


def test_outputs_a_rank_call_collected_for_add_request_keep_the_loop_going():
    """``rank`` may finish a request queued with ``add_request``; the documented loop still returns its output."""
    engine = GREngine(tiny_config())
    engine.add_request(good(request_id="streamed", user_id=1))
    engine.rank([good(request_id="batch", user_id=2)], use_tqdm=False)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["streamed"] and outputs[0].ok


def test_non_finite_scores_are_an_error_not_an_answer():
    """A model whose scores overflow (here ``attn_alpha`` 1e30) answers each ranking request with an error."""
    from msgspec.structs import replace

    config = tiny_config()
    engine = GREngine(replace(config, model=replace(config.model, attn_alpha=1e30)))
    [output] = engine.rank([good()], use_tqdm=False)
    assert output.error is not None and "non-finite scores" in output.error and output.scores.size == 0
    assert GREngine(config).rank([good()], use_tqdm=False)[0].ok


def test_with_a_time_bias_timestamps_must_not_span_more_than_int64():
    """The bias buckets ``|t_query - t_key| + 1`` in int64: a history spanning more would wrap (wrong buckets in
    every backend); refused with a clear error. Without a time bias any int64 timestamps are served."""
    from msgspec.structs import replace

    config = tiny_config()
    biased = GREngine(replace(config, model=replace(config.model, time_bias_buckets=6)))
    wide = good(timestamps=[-(2**63), 0, 2**63 - 1])
    [output] = biased.rank([wide], use_tqdm=False)
    assert "the first and last event may be at most 9223372036854775806 apart" in output.error
    assert biased.rank([good(request_id="ok2", timestamps=[-(2**62), 0, 2**62 - 2])], use_tqdm=False)[0].ok
    assert GREngine(config).rank([wide], use_tqdm=False)[0].ok
