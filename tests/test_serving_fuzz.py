"""Property-based fuzz of ``gr-engine serve`` (docs/serving.md, "Endpoints" and "Body formats") against a subprocess
on 127.0.0.1: hypothesis generates bodies of ``POST /v1/rank`` and ``POST /v1/generate``, JSON or msgpack, that mix
valid requests with mutated ones (wrong types in every field, integers beyond 64 bits, negative or out-of-vocabulary
ids, empty and mismatched arrays, too many candidates or events, non-objects, values nested deep, invalid UTF-8,
msgpack bins of a size not a multiple of 8, unknown fields, huge strings), and bodies that are wrong as a whole
(truncated, not an object, unknown or missing fields, bad ``timeout_ms`` or ``params``, NaN literals, the wrong
``Content-Type``, over ``serving.max_body_bytes``).

Every body's answer is known in advance and checked exactly: its status (never a 500), its format (``Accept`` and
``Content-Type``), one output per request in order; a valid request (a new user's, or again an earlier one's of the
same body) gets the scores of offline ``recompute`` of it (float32: 1e-5), or for retrieval its items and scores; an
invalid one an ``error``. Bodies are also sent several at once (then one may be refused as overloaded). Afterwards
the server is healthy, ``/metrics`` parses and counted each body and each request once, and its log holds no
traceback. Bounded (``max_examples``, derandomized) so that the file takes well under a minute;
``GR_ENGINE_FUZZ_EXAMPLES=N`` searches longer, from a random seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gr_engine import GenerateParams, GenerateRequest, GREngine, RankRequest

from .conftest import tiny_config
from .test_serving import TOL, Server, metric_samples, total

httpx = pytest.importorskip("httpx")

MAX_BODY = 200_000
NUM_ITEMS, NUM_ACTIONS, NUM_TASKS, MAX_CANDIDATES, MAX_HISTORY = 200, 8, 3, 12, 256  # tiny_config's model
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
MSGPACK = "application/msgpack"
NOT_UTF8 = [b"\xff", b"\xfe\xff", b"\x80", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf"]
JSON_LITERALS = {b"NaN", b"Infinity", b"-Infinity"}
ARRAYS = ("item_ids", "action_ids", "timestamps", "candidate_item_ids")
# GR_ENGINE_FUZZ_EXAMPLES=N: a longer search, seeded at random (the default is the same 100 bodies each run)
_EXAMPLES = int(os.environ.get("GR_ENGINE_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_EXAMPLES or 100, deadline=None, derandomize=not _EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("serve-fuzz"), "serving.max_pending_requests=64",
                 f"serving.max_body_bytes={MAX_BODY}")
    yield srv
    assert srv.stop() == 0


_users = itertools.count()


@functools.cache
def reference_engine() -> GREngine:
    """Offline recompute: any request's answer from its own history alone."""
    return GREngine(tiny_config(mode="recompute"))


@dataclass
class Case:
    """One entry of a body's ``requests``: what is sent, and what its output must be.

    ``request`` is what it means when it must be served (``None``: it must fail); ``either`` means it may be served
    (then exactly) or fail; ``label`` is the ``request_id`` its output must carry (``None``: not checked);
    ``admitted`` whether it passes the API server's checks and so counts against ``serving.max_pending_requests``
    (``None``: not known)."""

    sent: object
    request: RankRequest | GenerateRequest | None
    label: str | None
    why: str
    either: bool = False
    admitted: bool | None = False


@dataclass
class Post:
    """One body and the answer it must get: a status of ``statuses``; with ``deep`` also a 400 for values nested too
    deeply; with ``may_expire`` (``timeout_ms`` 0) a valid request may fail with "deadline exceeded" instead."""

    path: str
    content: bytes
    headers: dict[str, str]
    cases: list[Case]
    statuses: tuple[int, ...]
    answer: str  # the answer's media type
    why: str
    params: GenerateParams | None = None
    deep: bool = False
    may_expire: bool = False
    chunked: bool = False


def raw_string(fmt: str, data: bytes) -> msgspec.Raw:
    """A string of these (maybe not UTF-8) bytes, written as is."""
    if fmt == "json":
        return msgspec.Raw(b'"' + data + b'"')
    return msgspec.Raw(bytes([0xD9, len(data)]) + data)  # str 8


def nested(fmt: str, depth: int) -> msgspec.Raw:
    """``depth`` arrays, one inside the other."""
    return msgspec.Raw(b"[" * depth + b"]" * depth if fmt == "json" else b"\x91" * (depth - 1) + b"\x90")


def literal(fmt: str, value: float) -> object:
    """NaN or an infinity: a literal JSON does not have (so a 400 for the whole body), a float in msgpack."""
    if fmt == "json":
        return msgspec.Raw({math.inf: b"Infinity", -math.inf: b"-Infinity"}.get(value, b"NaN"))
    return value


# ------------------------------------------------------------------------------------------------- valid requests
@st.composite
def user_ids(draw) -> int | str:
    """A user never seen before: ints over the whole signed and unsigned 64-bit range, or strings."""
    k = next(_users)
    kind = draw(st.sampled_from(["small", "negative", "int64_min", "uint64_max", "text", "long"]))
    if kind == "small":
        return 10**6 + k
    if kind == "negative":
        return -(10**6 + k)
    if kind == "int64_min":
        return INT64_MIN + k
    if kind == "uint64_max":
        return UINT64_MAX - k
    if kind == "text":
        return f"{draw(st.text(max_size=12))}#{k}"
    return draw(st.characters()) * draw(st.integers(500, 5000)) + f"#{k}"


request_ids = st.one_of(st.text(max_size=16), st.sampled_from(["dup", "", "r0"]),
                        st.builds(lambda c, n: c * n, st.characters(), st.integers(1000, 4000)))


@st.composite
def timestamps(draw, n: int) -> list[int]:
    if draw(st.booleans()):  # anywhere in int64
        return sorted(draw(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=n, max_size=n)))
    start = draw(st.integers(-(10**12), 10**12))
    return list(itertools.accumulate(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), initial=start))[1:]


@st.composite
def valid_requests(draw, ranking: bool) -> RankRequest | GenerateRequest:
    n = draw(st.one_of(st.integers(0 if ranking else 1, 24), st.just(MAX_HISTORY)))
    fields = dict(request_id=draw(request_ids), user_id=draw(user_ids()),
                  item_ids=draw(st.lists(st.integers(0, NUM_ITEMS - 1), min_size=n, max_size=n)),
                  action_ids=draw(st.lists(st.integers(0, NUM_ACTIONS - 1), min_size=n, max_size=n)),
                  timestamps=draw(timestamps(n)))
    if not ranking:
        return GenerateRequest(**fields)
    candidates = draw(st.lists(st.integers(0, NUM_ITEMS - 1), min_size=1, max_size=MAX_CANDIDATES))
    return RankRequest(**fields, candidate_item_ids=candidates)


def encoded_fields(draw, request: RankRequest | GenerateRequest, fmt: str) -> dict[str, object]:
    """The request's fields as sent: keys in any order; in msgpack each array an array or int64 bytes; strings
    in JSON maybe \\u-escaped (astral characters as surrogate pairs)."""
    fields = msgspec.structs.asdict(request)
    if fmt == "msgpack":
        for name in ARRAYS:
            if name in fields and draw(st.booleans()):
                fields[name] = np.asarray(fields[name], dtype="<i8").tobytes()
    else:
        for name in ("request_id", "user_id"):
            if isinstance(fields[name], str) and draw(st.booleans()):
                fields[name] = msgspec.Raw(_ascii_json(fields[name]))
    keys = draw(st.permutations(list(fields)))
    return {k: fields[k] for k in keys}


def _ascii_json(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=True).encode()


# -------------------------------------------------------------------------------------------- mutated requests
def ints(fmt: str, min_value: int | None = None, max_value: int | None = None) -> st.SearchStrategy[int]:
    """Any integers in JSON; in msgpack those it holds (int64 and uint64)."""
    if fmt == "msgpack":
        min_value = INT64_MIN if min_value is None else max(min_value, INT64_MIN)
        max_value = UINT64_MAX if max_value is None else min(max_value, UINT64_MAX)
    return st.integers(min_value, max_value)


def bad_scalars(fmt: str) -> st.SearchStrategy:
    """Values of the wrong type for any field (no field takes a float, a bool, null, an object or a nested array)."""
    values = [st.floats(allow_nan=False, allow_infinity=False), st.just(1.0), st.just(-0.0), st.booleans(),
              st.none(), st.dictionaries(st.text(max_size=4), ints(fmt), max_size=3),
              st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda v: literal(fmt, v)),
              st.integers(2, 40).map(lambda d: nested(fmt, d))]
    if fmt == "msgpack":
        values.append(st.just(msgspec.msgpack.Ext(5, b"xy")))
    return st.one_of(values)


def out_of_int64(fmt: str) -> st.SearchStrategy:
    """Integers no int64 holds: up to the uint64 maximum in msgpack, any in JSON."""
    upper = st.integers(INT64_MAX + 1, UINT64_MAX)
    if fmt == "msgpack":
        return upper
    return st.one_of(upper, st.integers(UINT64_MAX + 1, 2**200), st.integers(-(2**200), INT64_MIN - 1))


@st.composite
def invalid_requests(draw, ranking: bool, fmt: str, index: int) -> Case:
    """A valid request changed so that it must fail (or, ``either``, may be served)."""
    request = draw(valid_requests(ranking))
    fields = encoded_fields(draw, request, fmt)
    arrays = [n for n in ARRAYS if n in fields]
    rid = request.request_id
    kind = draw(st.sampled_from(["type", "element", "int64", "range", "length", "missing", "not_object", "deep",
                                 "utf8", "bin", "user"]))
    if kind == "type":
        name = draw(st.sampled_from(list(fields)))
        value = draw(st.one_of(bad_scalars(fmt), st.text(max_size=8), ints(fmt)) if name in arrays else
                     bad_scalars(fmt) if name == "user_id" else st.one_of(bad_scalars(fmt), ints(fmt)))
        fields[name] = value
        return Case(fields, None, rid if name != "request_id" else None, f"{name} = {value!r}")
    if kind == "element":  # one element of an array of the wrong type
        name = draw(st.sampled_from(arrays))
        values = list(getattr(request, name))
        at = draw(st.integers(0, len(values)))
        values.insert(at, draw(st.one_of(bad_scalars(fmt), st.text(max_size=4), st.lists(ints(fmt), max_size=2))))
        fields[name] = values
        return Case(fields, None, rid, f"{name}[{at}] = {values[at]!r}")
    if kind == "int64":
        name = draw(st.sampled_from(arrays))
        values = list(getattr(request, name)) or [0]
        at = draw(st.integers(0, len(values) - 1))
        values[at] = draw(out_of_int64(fmt))
        fields[name] = values
        if name != "candidate_item_ids":  # keep the history's lengths equal: the value must be what fails
            for other in ("item_ids", "action_ids", "timestamps"):
                if other != name and not getattr(request, other):
                    fields[other] = [0]
        return Case(fields, None, rid, f"{name}[{at}] = {values[at]}")
    if kind == "range":  # ids outside their vocabulary, negative ones, timestamps going backwards
        name = draw(st.sampled_from(arrays))
        values = list(getattr(request, name))
        if name == "timestamps":  # one step backwards
            if len(values) < 2:
                values = [0, 0]
                fields.update(item_ids=[0, 0], action_ids=[0, 0])
            at = draw(st.integers(1, len(values) - 1))
            values[at] = draw(st.integers(INT64_MIN, INT64_MAX - 1))
            values[at - 1] = draw(st.integers(values[at] + 1, INT64_MAX))
        else:
            vocab = NUM_ACTIONS if name == "action_ids" else NUM_ITEMS
            bad = draw(st.one_of(st.integers(INT64_MIN, -1), st.integers(vocab, INT64_MAX)))
            if not values:
                values = [bad]
                if name != "candidate_item_ids":
                    for other in ("item_ids", "action_ids", "timestamps"):
                        if other != name:
                            fields[other] = [0]
            else:
                values[draw(st.integers(0, len(values) - 1))] = bad
        fields[name] = values  # only the candidates are checked against the vocabulary before the core
        return Case(fields, None, rid, f"{name} = {values}", admitted=name != "candidate_item_ids")
    if kind == "length":
        options = ["mismatch", "too_long"] + (["no_candidates", "too_many"] if ranking else ["empty"])
        what = draw(st.sampled_from(options))
        if what == "mismatch":
            name = draw(st.sampled_from(["item_ids", "action_ids", "timestamps"]))
            values = list(getattr(request, name))
            fields[name] = values[:-1] if values and draw(st.booleans()) else values + [values[-1] if values else 0]
        elif what == "too_long":
            n = draw(st.integers(MAX_HISTORY + 1, MAX_HISTORY + 40))
            fields.update(item_ids=[1] * n, action_ids=[1] * n, timestamps=list(range(n)))
        elif what == "no_candidates":
            fields["candidate_item_ids"] = []
        elif what == "too_many":
            fields["candidate_item_ids"] = [3] * draw(st.integers(MAX_CANDIDATES + 1, 60))
        else:
            fields.update(item_ids=[], action_ids=[], timestamps=[])
        if fmt == "msgpack" and draw(st.booleans()):
            for name in arrays:
                if not isinstance(fields[name], bytes):
                    fields[name] = np.asarray(fields[name], dtype="<i8").tobytes()
        return Case(fields, None, rid, f"length: {what}")
    if kind == "missing":
        name = draw(st.sampled_from(list(fields)))
        del fields[name]
        return Case(fields, None, rid if name != "request_id" else f"request-{index}", f"no {name}")
    if kind == "not_object":
        others = [st.binary(max_size=16), st.just(msgspec.msgpack.Ext(1, b"\x01"))] if fmt == "msgpack" else []
        value = draw(st.one_of(st.integers(INT64_MIN, INT64_MAX), st.text(max_size=8), st.none(), st.booleans(),
                               st.lists(ints(fmt), max_size=3), st.floats(allow_nan=False, allow_infinity=False),
                               *others))
        return Case(value, None, f"request-{index}", f"request = {value!r}")
    if kind == "deep":  # in a field it must be (fails), or in an unknown field (ignored): or too deep for the body
        depth = draw(st.one_of(st.integers(2, 100), st.integers(100, 3000)))
        if draw(st.booleans()):
            fields[draw(st.sampled_from(list(fields)))] = nested(fmt, depth)
            return Case(fields, None, None, f"nested {depth} deep")
        fields["extra"] = nested(fmt, depth)
        return Case(fields, request, request.request_id, f"extra field nested {depth} deep", admitted=True)
    if kind == "utf8":  # invalid UTF-8 in a string the request must have, or in an unknown field's value
        printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'), max_size=6)
        data = draw(printable).encode() + draw(st.sampled_from(NOT_UTF8)) + draw(printable).encode()
        name = draw(st.sampled_from(["request_id", "user_id", "extra"]))
        fields[name] = raw_string(fmt, data)
        if name == "extra":
            return Case(fields, request, None, f"extra = {data!r}", either=True, admitted=None)
        return Case(fields, None, f"request-{index}", f"{name} = {data!r}")
    if kind == "bin":
        if fmt != "msgpack":  # JSON has no bytes: a string instead of an array
            name = draw(st.sampled_from(arrays))
            fields[name] = draw(st.text(max_size=8))
            return Case(fields, None, rid, f"{name} is a string")
        name = draw(st.sampled_from(arrays))
        data = np.asarray(getattr(request, name), dtype="<i8").tobytes()
        cut = draw(st.integers(1, 7))
        fields[name] = data + bytes(cut) if draw(st.booleans()) or len(data) < 8 else data[:-cut]
        return Case(fields, None, rid, f"{name}: {len(fields[name])} bytes")
    # kind == "user": beyond 64 bits (JSON), or of a type msgpack has and a user id may not be
    value = draw(out_of_int64(fmt).filter(lambda v: v > UINT64_MAX or v < INT64_MIN)) if fmt == "json" else \
        draw(st.one_of(st.binary(max_size=8), st.floats(), st.booleans()))
    fields["user_id"] = value
    return Case(fields, None, rid, f"user_id = {value!r}")


@st.composite
def request_cases(draw, ranking: bool, fmt: str, index: int, earlier: list[Case]) -> Case:
    """A valid request (maybe with unknown fields, repeating an earlier one, or for an earlier one's user), or a
    mutated one."""
    choice = draw(st.sampled_from(["valid", "valid", "extra", "repeat", "revisit", "invalid", "invalid", "invalid"]))
    served = [c for c in earlier if c.request is not None and not c.either]
    if choice == "repeat" and served:  # the same request again (same user, same request_id): served alike
        case = draw(st.sampled_from(served))
        return Case(case.sent, case.request, case.label, f"repeat of {case.why}", admitted=True)
    if choice == "revisit" and served:  # an earlier request's user again: a longer history, or another one
        before = draw(st.sampled_from(served)).request
        request = draw(valid_requests(ranking))
        if draw(st.booleans()) and len(before.item_ids) + len(request.item_ids) <= MAX_HISTORY:
            last = before.timestamps[-1] if before.timestamps else 0
            later = [min(max(t, last), INT64_MAX) for t in request.timestamps]
            request = msgspec.structs.replace(
                request, item_ids=before.item_ids + request.item_ids, action_ids=before.action_ids +
                request.action_ids, timestamps=before.timestamps + sorted(later))
        request = msgspec.structs.replace(request, user_id=before.user_id)
        return Case(encoded_fields(draw, request, fmt), request, request.request_id, "revisit", admitted=True)
    if choice in ("valid", "extra", "repeat", "revisit"):
        request = draw(valid_requests(ranking))
        fields = encoded_fields(draw, request, fmt)
        if choice == "extra":  # unknown fields are ignored
            for key in draw(st.lists(st.text(max_size=6).filter(lambda k: k not in fields), max_size=3)):
                fields[key] = draw(st.one_of(st.integers(INT64_MIN, INT64_MAX), st.text(max_size=8), st.none(),
                                             st.lists(st.integers(0, 9), max_size=3)))
            if not ranking and draw(st.booleans()):
                fields["candidate_item_ids"] = [1, 2, 3]  # a ranking request's field, ignored by retrieval
        return Case(fields, request, request.request_id, choice, admitted=True)
    return draw(invalid_requests(ranking, fmt, index))


# --------------------------------------------------------------------------------------------------- bodies
JSON_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain"]
MSGPACK_TYPES = ["application/msgpack", "application/x-msgpack", "Application/MsgPack; v=1"]
ACCEPTS = [None, "application/json", MSGPACK, "*/*", "text/html, application/x-msgpack;q=0.5"]


def answer_type(accept: str | None, fmt: str) -> str:
    if accept is not None and "msgpack" in accept:
        return MSGPACK
    if accept == "application/json":
        return "application/json"
    return MSGPACK if fmt == "msgpack" else "application/json"


@st.composite
def timeouts(draw, fmt: str) -> tuple[object, int, bool]:
    """``(timeout_ms or a marker to leave it out, status, may_expire)``."""
    good = [st.just(None), st.just(60_000), st.just(1e308), st.just(UINT64_MAX)]
    if fmt == "msgpack":
        good.append(st.just(math.inf))
    else:
        good.append(st.just(10**31))
    bad = [st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False), st.text(max_size=4), st.booleans(),
           st.lists(ints(fmt)),
           st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda v: literal(fmt, v))]
    if fmt == "json":
        bad.append(st.just(msgspec.Raw(b"1e400")))
    choice = draw(st.sampled_from(["absent", "absent", "good", "good", "zero", "bad"]))
    if choice == "absent":
        return _ABSENT, 200, False
    if choice == "zero":  # every request may expire before it starts
        return draw(st.sampled_from([0, 0.0, -0.0, 1e-300])), 200, True
    if choice == "good":
        return draw(st.one_of(good)), 200, False
    value = draw(st.one_of(bad))
    if fmt == "msgpack" and value == math.inf:  # no deadline
        return value, 200, False
    return value, 400, False


_ABSENT = object()


@st.composite
def generate_params(draw, fmt: str) -> tuple[object, GenerateParams | None, int]:
    """``(params or _ABSENT, the params they mean, status)``."""
    choice = draw(st.sampled_from(["absent", "good", "good", "bad"]))
    if choice == "absent":
        return _ABSENT, GenerateParams(), 200
    if choice == "good":
        params = {"top_k": draw(st.one_of(st.integers(1, NUM_ITEMS + 20), st.just(2**62), st.just(INT64_MAX)))}
        if draw(st.booleans()):
            params["exclude_history"] = draw(st.booleans())
        return params, GenerateParams(**params), 200
    bad = draw(st.one_of(
        st.one_of(ints(fmt, max_value=0), st.integers(2**63, UINT64_MAX), st.just("5"), st.just(2.0),
                  st.booleans(), st.none()).map(lambda k: {"top_k": k}),
        st.one_of(st.integers(0, 1), st.just("yes"), st.none()).map(lambda e: {"exclude_history": e}),
        st.just({"top_k": 3, "unknown": 1}), st.just(None), st.just([]), st.just(5)))
    if fmt == "json" and draw(st.booleans()):
        bad = {"top_k": draw(st.integers(UINT64_MAX + 1, 2**100))}
    return bad, None, 400


@st.composite
def posts(draw, ranking: bool) -> Post:
    fmt = draw(st.sampled_from(["json", "msgpack"]))
    cases: list[Case] = []
    for i in range(draw(st.integers(0, 6))):
        cases.append(draw(request_cases(ranking, fmt, i, cases)))
    # Many copies of them: a body of more requests than serving.max_pending_requests (64) passing the API server's
    # checks is a 413 (CallTooLarge). Not within 6 of the bound: a body before, late at its deadline, may leave up to
    # 6 requests pending a while (then a 503 would be right).
    copies = draw(st.sampled_from([1] * 8 + [3, 12, 25]))
    sure, unsure = sum(c.admitted is True for c in cases), sum(c.admitted is None for c in cases)
    while copies > 1 and not ((sure + unsure) * copies <= 58 or sure * copies > 64):
        copies -= 1
    if copies > 1:
        cases = [Case(c.sent, c.request, c.label if c.label is None or not c.label.startswith("request-") else
                      f"request-{k * len(cases) + i}", c.why, c.either, c.admitted)
                 for k in range(copies) for i, c in enumerate(cases)]
    statuses = (200,) if (sure + unsure) * copies <= 64 else (413,) if sure * copies > 64 else (200, 413)
    content_type = draw(st.sampled_from(JSON_TYPES if fmt == "json" else MSGPACK_TYPES))
    accept = draw(st.sampled_from(ACCEPTS))
    body: dict[str, object] = {"requests": [c.sent for c in cases]}
    timeout, status, may_expire = draw(timeouts(fmt))
    if may_expire and copies > 1:  # (see above)
        timeout, may_expire = _ABSENT, False
    if timeout is not _ABSENT:
        body["timeout_ms"] = timeout
    why = f"timeout_ms = {timeout!r}" if status != 200 else f"{copies} copies" if copies > 1 else "body"
    if status != 200:
        statuses = (status,)
    params = None
    if not ranking:
        value, params, params_status = draw(generate_params(fmt))
        if value is not _ABSENT:
            body["params"] = value
        if params_status != 200 and status == 200:
            statuses, why = (params_status,), f"params = {value!r}"
    defect = draw(st.sampled_from(["none"] * 16 + ["unknown", "requests", "not_object", "truncated", "content_type",
                                                    "ff", "empty", "huge"]))
    if defect == "unknown":
        body[draw(st.sampled_from(["reqs", "timeout", "params" if ranking else "extra"]))] = 1
    elif defect == "requests":
        not_a_list = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
                               st.text(max_size=4), ints(fmt), st.dictionaries(st.text(max_size=4), ints(fmt)))
        body.pop("requests") if draw(st.booleans()) else body.update(requests=draw(not_a_list))
    elif defect == "not_object":
        body = draw(st.one_of(st.lists(ints(fmt), max_size=3), ints(fmt), st.none(), st.text(max_size=5)))
    elif defect == "huge":  # a request_id that makes the body over serving.max_body_bytes
        body["requests"] = [{"request_id": "x" * (MAX_BODY + 1)}, *body["requests"]]
    encode = msgspec.json.encode if fmt == "json" else msgspec.msgpack.encode
    content = encode(body)
    if defect == "truncated":
        content = content[:draw(st.integers(0, len(content) - 1))]
    elif defect == "content_type":  # the other format's Content-Type
        content_type = draw(st.sampled_from(MSGPACK_TYPES if fmt == "json" else JSON_TYPES[1:]))
    elif defect == "ff":  # a byte that is neither UTF-8 nor a whole JSON/msgpack value
        content = content + b"\xff" if draw(st.booleans()) else (b"\xff" + content if fmt == "json" else b"\xc1")
    elif defect == "empty":
        content = b""
    if fmt == "json" and defect == "none" and draw(st.integers(0, 7)) == 0:  # whitespace up to the size bound
        size = draw(st.sampled_from([MAX_BODY - 1, MAX_BODY, MAX_BODY + 1]))
        if len(content) < size:
            lead = draw(st.integers(0, size - len(content)))
            space = draw(st.sampled_from([b" ", b"\n", b"\t", b"\r"]))
            content = b" " * lead + content + space * (size - len(content) - lead)
            why = f"{size} bytes with whitespace"
    if defect != "none":
        statuses, why = (400,), f"body defect: {defect}"
    elif fmt == "json" and has_literal(body):
        statuses, why = (400,), "a NaN or infinity literal"
    if len(content) > MAX_BODY:
        statuses, why = (413,), f"{len(content)} bytes"
    headers = {k: v for k, v in (("content-type", content_type), ("accept", accept)) if v is not None}
    return Post("/v1/rank" if ranking else "/v1/generate", content, headers, cases, statuses,
                answer_type(accept, fmt if defect != "content_type" else ("msgpack" if fmt == "json" else "json")),
                why, params, any("nested" in c.why for c in cases), may_expire, draw(st.booleans()))


def has_literal(value: object) -> bool:
    """Whether a JSON body holds a NaN or infinity literal (JSON has none: the whole body is malformed)."""
    if isinstance(value, msgspec.Raw):
        return bytes(value) in JSON_LITERALS
    if isinstance(value, dict):
        return any(has_literal(v) for v in value.values())
    return isinstance(value, list) and any(has_literal(v) for v in value)


# -------------------------------------------------------------------------------------------------- checks
def scores_of(output: dict) -> np.ndarray:
    if isinstance(output["scores"], bytes):
        return np.frombuffer(output["scores"], dtype="<f4").reshape(output["scores_shape"])
    return np.array(output["scores"], dtype=np.float32)


def same_items(served: list[int], reference: list[int], scores: np.ndarray) -> bool:
    """The same top-k, up to the order of items whose scores tie within TOL."""
    if len(served) != len(reference):
        return False
    start = 0
    for i in range(1, len(reference) + 1):
        if i == len(reference) or abs(scores[i] - scores[i - 1]) > 10 * TOL:
            if set(served[start:i]) != set(reference[start:i]):
                return False
            start = i
    return True


def send(server: Server, post: Post) -> httpx.Response:
    content: object = post.content
    if post.chunked:  # no Content-Length: the server counts the bytes as they come
        content = iter([post.content[i:i + 65536] for i in range(0, len(post.content), 65536)] or [b""])
    return httpx.post(server.url + post.path, content=content, headers=post.headers, timeout=60)


def verify(post: Post, response: httpx.Response, overload: bool = False) -> tuple[int, int, int]:
    """Check ``post``'s answer (``overload``: other bodies were in flight, so a body that would be served may get a
    503 instead); return what ``/metrics`` must count of it: at least and at most so many ``requests_total``
    (outputs; in a body refused whole, those that failed validation before admission), and ``request_errors_total``
    (failed outputs; one for a malformed body; each request of a body refused whole, once)."""
    what = f"{post.why}: {[c.why for c in post.cases]}; {response.status_code} {response.content[:600]!r}"
    assert response.status_code != 500, what
    media = response.headers.get("content-type", "")
    decode = msgspec.msgpack.decode if media.startswith(MSGPACK) else msgspec.json.decode
    answer = decode(response.content)
    failed_first = sum(c.request is None and c.admitted is False for c in post.cases)
    refused_whole = (failed_first, failed_first + sum(c.admitted is None for c in post.cases), len(post.cases))
    if post.deep and response.status_code == 400 and "nested too deeply" in str(answer.get("error")):
        return 0, 0, 1
    if overload and response.status_code == 503 and 200 in post.statuses:
        assert response.headers["retry-after"] == "1" and "pending" in answer["error"], what
        return refused_whole
    assert response.status_code in post.statuses, what
    assert media.startswith(post.answer), (media, what)
    if response.status_code != 200:
        assert isinstance(answer, dict) and list(answer) == ["error"] and answer["error"], what
        return refused_whole if "split the call" in answer["error"] else (0, 0, 1)
    assert list(answer) == ["outputs"], what
    outputs = answer["outputs"]
    assert len(outputs) == len(post.cases), what
    # offline, request_ids must be unique among those in flight: the server's may repeat (its core has ids of its own)
    served = [msgspec.structs.replace(c.request, request_id=str(i)) for i, c in enumerate(post.cases)
              if c.request is not None]
    if post.params is None:
        references = iter(o.scores for o in reference_engine().rank(served, use_tqdm=False))
    else:
        references = iter(reference_engine().generate(served, post.params, use_tqdm=False))
    for i, (case, output) in enumerate(zip(post.cases, outputs)):
        why = f"request {i} ({case.why}) of {what}"
        reference = next(references) if case.request is not None else None
        if case.label is not None:
            assert output["request_id"] == case.label, why
        if case.request is None or (output["error"] is not None and case.either):
            assert isinstance(output["error"], str) and output["error"], why
            if post.params is None:
                assert scores_of(output).size == 0, why
            continue
        if output["error"] is not None and post.may_expire:
            assert output["error"].startswith("deadline exceeded") and "-0 ms" not in output["error"], why
            continue
        assert output["error"] is None, why
        assert output["user_id"] == case.request.user_id, why
        if post.params is None:
            scores = scores_of(output)
            assert scores.shape == (len(case.request.candidate_item_ids), NUM_TASKS), why
            np.testing.assert_allclose(scores, reference, atol=TOL, rtol=0, err_msg=why)
        else:
            assert reference.error is None, why
            np.testing.assert_allclose(output["scores"], reference.scores, atol=TOL, rtol=0, err_msg=why)
            assert same_items(output["item_ids"], reference.item_ids, np.asarray(reference.scores)), why
    return len(outputs), len(outputs), sum(o["error"] is not None for o in outputs)


@contextlib.contextmanager
def still_healthy(server: Server) -> Iterator[Callable[[Post, httpx.Response, bool], None]]:
    """Around a fuzz: yields a function that checks a body's answer (:func:`verify`) and counts it; afterwards the
    server is healthy, ``/metrics`` parses and counted each body once and each request as :func:`verify` says, and
    the log holds no traceback."""
    before = metric_samples(server.url)
    counts = np.zeros(4, dtype=np.int64)  # bodies, requests (at least, at most), errors

    def count(post: Post, response: httpx.Response, overload: bool = False) -> None:
        counts[:] += (1, *verify(post, response, overload))

    yield count
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    after = metric_samples(server.url)

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    assert delta("gr_engine_http_bodies_total") == counts[0]
    assert counts[1] <= delta("gr_engine_requests_total") <= counts[2], (delta("gr_engine_requests_total"), counts)
    assert delta("gr_engine_request_errors_total") == counts[3]
    log = server.log_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def fuzz(server: Server, ranking: bool) -> None:
    with still_healthy(server) as count:
        @FUZZ
        @given(posts(ranking))
        def run(post: Post) -> None:
            count(post, send(server, post))

        run()


def test_rank_fuzz(server: Server) -> None:
    fuzz(server, ranking=True)


def test_generate_fuzz(server: Server) -> None:
    fuzz(server, ranking=False)


def test_concurrent_bodies_fuzz(server: Server) -> None:
    """Bodies of both endpoints at once: each answered as alone, except that one may be refused as overloaded."""
    with still_healthy(server) as count:
        @settings(FUZZ, max_examples=_EXAMPLES // 3 or 30)
        @given(st.lists(st.one_of(posts(True), posts(False)), min_size=2, max_size=6))
        def run(batch: list[Post]) -> None:
            async def post_all() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=60) as client:
                    return await asyncio.gather(*(client.post(server.url + p.path, content=p.content,
                                                              headers=p.headers) for p in batch))

            for post, response in zip(batch, asyncio.run(post_all()), strict=True):
                count(post, response, True)

        run()


@pytest.mark.parametrize("ranking", [True, False])
def test_a_user_id_beyond_64_bits_fails_alone_in_a_msgpack_answer(server: Server, ranking: bool) -> None:
    """Found by the fuzz: a JSON body's request whose int ``user_id`` is beyond 64 bits fails validation, and its
    output echoed that id, which a msgpack answer (``Accept``) cannot hold: the whole body got a 500. Now such an
    output's ``user_id`` is ``None`` in msgpack (JSON keeps it) and its batch-mate is served exactly."""
    k = next(_users)
    fields = dict(request_id="ok", user_id=10**9 + k, item_ids=[3, 5, 9], action_ids=[1, 0, 2], timestamps=[10, 20, 30])
    request = RankRequest(**fields, candidate_item_ids=[11, 12]) if ranking else GenerateRequest(**fields)
    bad = [{**msgspec.structs.asdict(request), "request_id": f"bad{i}", "user_id": user}
           for i, user in enumerate((2**70, -(2**64), UINT64_MAX + 1))]
    path = "/v1/rank" if ranking else "/v1/generate"
    for accept in (MSGPACK, "application/json"):
        response = httpx.post(server.url + path, content=msgspec.json.encode({"requests": [*bad, request]}),
                              headers={"accept": accept}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith(accept)
        outputs = (msgspec.msgpack.decode if accept == MSGPACK else msgspec.json.decode)(response.content)["outputs"]
        assert [o["request_id"] for o in outputs] == ["bad0", "bad1", "bad2", "ok"]
        for output, user in zip(outputs, (2**70, -(2**64), UINT64_MAX + 1)):
            assert "does not fit in 64 bits" in output["error"]
            assert output["user_id"] == (None if accept == MSGPACK else user)
        assert outputs[3]["error"] is None and outputs[3]["user_id"] == request.user_id
        if ranking:
            [reference] = reference_engine().rank([request], use_tqdm=False)
            np.testing.assert_allclose(scores_of(outputs[3]), reference.scores, atol=TOL, rtol=0)
        else:
            [reference] = reference_engine().generate([request], use_tqdm=False)
            assert same_items(outputs[3]["item_ids"], reference.item_ids, np.asarray(reference.scores))
            np.testing.assert_allclose(outputs[3]["scores"], reference.scores, atol=TOL, rtol=0)
    assert "Traceback" not in server.log_text()


def test_a_body_refused_as_too_large_counts_each_request_once(server: Server) -> None:
    """Found by the fuzz: a body of more valid requests than ``serving.max_pending_requests`` (a 413) counted its
    requests that fail the API server's checks twice in ``request_errors_total``: as ``invalid`` (their outputs) and
    again as ``bad_request`` with the refused ones. Now each is counted once, as for a 503."""
    k = next(_users)
    valid = [{"request_id": f"v{i}", "user_id": 2 * 10**9 + k * 100 + i, "item_ids": [1], "action_ids": [0],
              "timestamps": [0], "candidate_item_ids": [2]} for i in range(65)]
    decode_fails = [7, {"request_id": "x"}]
    check_fails = [{**valid[0], "candidate_item_ids": []}, {**valid[0], "user_id": 2**70}]
    core_fails = [{**valid[0], "item_ids": [-1]}]  # passes the API server's checks: refused with the valid ones
    before = metric_samples(server.url)
    response = httpx.post(f"{server.url}/v1/rank", timeout=30,
                          content=msgspec.json.encode({"requests": valid + decode_fails + check_fails + core_fails}))
    assert response.status_code == 413 and "split the call" in response.json()["error"]
    after = metric_samples(server.url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("gr_engine_request_errors_total", kind="bad_request") == 66
    assert delta("gr_engine_request_errors_total", kind="invalid") == 4
    assert delta("gr_engine_request_errors_total") == 70 and delta("gr_engine_requests_total") == 4
