"""Property-based tests of file jobs (``gr-engine rank`` / ``generate`` in one process, called in-process): files
mixing valid requests with malformed rows, JSONL and Parquet. Whatever the rows:

* one output per input row (JSONL: per non-blank line; a UTF-8 byte-order mark before line 1 is not part of it),
  in input order;
* each valid request, every one for a fresh user of its own, is served with the scores (and retrieved items) of
  ``recompute`` serving of that request alone (1e-5, float32 on CPU);
* each malformed row is an error labelled by its ``request_id`` (``str`` of it) where it has one, else ``line-N`` /
  ``row-N``, and carries its ``user_id`` where it is a string or an int;
* the exit status is 1 when every row failed, else 0, and stderr holds the summary line (and the "all failed"
  line), never a traceback.

Bounded: ``derandomize=True`` and tens of examples per test (each runs a job and builds an engine).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gr_engine.io as gio
from gr_engine import GenerateParams, GenerateRequest, GREngine, RankRequest
from gr_engine.cli import main
from gr_engine.json_labels import overlong_labels
from gr_engine.outputs import output_user_id
from gr_engine.synthetic import synthetic_requests
from tests.conftest import tiny_config, with_cache

CONFIG = tiny_config()
TOP_K = 5
POOL_SIZE = 40
BOM = b"\xef\xbb\xbf"
#: Examples per test: each runs a job (an engine built, a few rows served: tenths of a second on CPU). More to fuzz
#: harder: FUZZ_EXAMPLES=1000 pytest tests/test_file_job_fuzz.py.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 40))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EVERY_KIND = settings(FUZZ, max_examples=max(EXAMPLES // 5, 1))


@functools.cache
def pool() -> list[dict[str, Any]]:
    """Requests of distinct users (every fourth with a string id), as dicts: histories of 1-40 events, 1-12
    candidates."""
    requests = synthetic_requests(CONFIG.model, POOL_SIZE, 1, first_history=(1, 40), num_candidates=(1, 12),
                                  seed=11)
    rows = msgspec.to_builtins(requests)
    for i, row in enumerate(rows):
        row["request_id"] = f"req-{i}"
        if i % 4 == 3:
            row["user_id"] = f"user-{i}"
    return rows


@functools.cache
def reference(index: int, generate: bool) -> Any:
    """``recompute`` serving of pool request ``index`` alone."""
    engine = _reference_engine()
    row = pool()[index]
    if generate:
        [out] = engine.generate([msgspec.convert(row, GenerateRequest)], GenerateParams(top_k=TOP_K),
                                use_tqdm=False)
    else:
        [out] = engine.rank([msgspec.convert(row, RankRequest)], use_tqdm=False)
    assert out.error is None, out.error
    return out


@functools.cache
def _reference_engine() -> GREngine:
    return GREngine(with_cache(CONFIG, mode="recompute"))


@dataclass
class Expect:
    """What a row's output must be: served as pool request ``index`` (``None``: an error), labelled
    ``request_id`` (``None``: by its place, ``line-N`` / ``row-N``), with ``user_id``."""

    index: int | None
    request_id: str | None
    user_id: Any


def error_expect(row: Any) -> Expect:
    """A malformed row's expected output, from what decoding it gives: as ``io.parse_row`` labels it."""
    fields = row if isinstance(row, dict) else {}
    request_id = fields.get("request_id")
    return Expect(None, None if request_id is None else str(request_id), output_user_id(fields.get("user_id")))


# Values of the wrong type for each field.
WRONG = {
    "request_id": [5, True, ["x"], {"a": 1}, 1.5, None],
    "user_id": [2.5, True, None, [1], {"u": 1}],
    "list": ["abc", 1, [1.5], [True], [[1]], ["1"], None, {"a": 1}],
}
LISTS = ("item_ids", "action_ids", "timestamps", "candidate_item_ids")
HUGE_INTS = [10**30, 2**64, 2**63, -(2**63) - 1]


def harmless(field: str, generate: bool) -> bool:
    """Whether a change to ``field`` leaves the request valid: retrieval ignores candidates."""
    return generate and field == "candidate_item_ids"


def engine_invalid(draw: Any, row: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``row`` made invalid for the engine (types right): the row and the field changed."""
    row = {**row}
    n = len(row["item_ids"])
    kind = draw(st.sampled_from(["oov-item", "oov-action", "unequal", "backwards", "no-candidates",
                                 "many-candidates", "oov-candidate", "negative-item"]))
    if kind == "oov-item":
        row["item_ids"] = [*row["item_ids"][:-1], CONFIG.model.num_items]
    elif kind == "oov-action":
        row["action_ids"] = [CONFIG.model.num_actions, *row["action_ids"][1:]]
    elif kind == "negative-item":
        row["item_ids"] = [-1, *row["item_ids"][1:]]
    elif kind == "unequal":
        row["timestamps"] = row["timestamps"] + [row["timestamps"][-1]]
    elif kind == "backwards":
        if n == 1:
            row["item_ids"], row["action_ids"] = row["item_ids"] * 2, row["action_ids"] * 2
            row["timestamps"] = row["timestamps"] * 2
        row["timestamps"] = [*row["timestamps"][:-1], row["timestamps"][-2] - 1]
    elif kind == "no-candidates":
        row["candidate_item_ids"] = []
    elif kind == "many-candidates":
        row["candidate_item_ids"] = list(range(CONFIG.model.max_candidates + 1))
    else:
        row["candidate_item_ids"] = [*row["candidate_item_ids"], 10**6]
    return row, "candidate_item_ids" if "candidate" in kind else "item_ids"


# ---------------------------------------------------------------------------------------------------------- JSONL

JSONL_KINDS = ["valid", "valid", "valid", "blank", "truncated", "non-utf8", "stray-bom", "huge-int", "huge-digits",
               "nan", "wrong-type", "missing", "not-object", "engine-invalid", "junk", "deep", "overlong-first",
               "overlong-last"]

BLANKS = [b"", b" ", b"\t", b"  \t ", b"\r", b"\x0c"]

#: Events of an overlong line's padding: a line of them is over ``io.max_line_bytes`` of the tiny config (1.07 MB).
OVERLONG_PAD = 400_000


def encode(row: Any, draw: Any) -> bytes:
    """``row`` as one JSON line, in one of several layouts (compact, spaced, tabs, keys shuffled)."""
    if isinstance(row, dict) and draw(st.booleans()):
        keys = draw(st.permutations(list(row)))
        row = {key: row[key] for key in keys}
    style = draw(st.sampled_from(["msgspec", "spaced", "compact", "tabs"]))
    if style == "msgspec":
        return msgspec.json.encode(row)
    separators = {"spaced": (", ", ": "), "compact": (",", ":"), "tabs": ("\t,\t", "\t:\t")}[style]
    return json.dumps(row, separators=separators).encode()


def jsonl_row(draw: Any, kind: str, index: int, request_id: str, generate: bool) -> tuple[bytes, Expect | None]:
    """A line of ``kind`` made from pool request ``index`` with ``request_id``, and its expected output (``None``:
    a blank line)."""
    row = {**pool()[index], "request_id": request_id}
    valid = Expect(index, row["request_id"], row["user_id"])
    if kind == "valid":
        if draw(st.booleans()):  # a field the request does not have: ignored
            junk = draw(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                                     lambda inner: st.lists(inner, max_size=3)
                                     | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8))
            row = {**row, draw(st.sampled_from(["extra", "request_id ", "meta"])): junk}
        return encode(row, draw), valid
    if kind == "blank":
        return draw(st.sampled_from(BLANKS)), None
    if kind == "truncated":
        line = encode(row, draw)
        return line[:draw(st.integers(1, len(line) - 1))], Expect(None, None, None)
    if kind == "non-utf8":
        line = encode(row, draw)
        at = draw(st.integers(0, len(line)))
        return line[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])) + line[at:], Expect(
            None, None, None)
    if kind == "stray-bom":  # a byte-order mark that does not begin the file: not JSON
        return BOM + encode(row, draw), Expect(None, None, None)
    if kind == "huge-int":
        field = draw(st.sampled_from(["user_id", *LISTS]))
        value = draw(st.sampled_from([v for v in HUGE_INTS if field != "user_id" or v != 2**63]))  # 2**63: valid
        changed = {**row, field: value if field == "user_id" else [*row[field][:-1], value]}
        if field == "timestamps" and value < 0:
            changed[field] = [value, *row[field][1:]]
        return encode(changed, draw), valid if harmless(field, generate) else error_expect(changed)
    if kind == "huge-digits":  # an int of more digits than msgspec decodes: the line is not JSON
        return encode({**row, "user_id": "@@"}, draw).replace(b'"@@"', b"9" * 5000), Expect(None, None, None)
    if kind == "nan":
        field = draw(st.sampled_from(["user_id", *LISTS]))
        token = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
        line = encode({**row, field: "@@"}, draw)
        return line.replace(b'"@@"', token.encode()), Expect(None, None, None)
    if kind == "wrong-type":
        field = draw(st.sampled_from(["request_id", "user_id", *LISTS]))
        value = draw(st.sampled_from(WRONG["list" if field in LISTS else field]))
        changed = {**row, field: value}
        return encode(changed, draw), valid if harmless(field, generate) else error_expect(changed)
    if kind == "missing":
        field = draw(st.sampled_from(["request_id", "user_id", *LISTS]))
        changed = {key: value for key, value in row.items() if key != field}
        return encode(changed, draw), valid if harmless(field, generate) else error_expect(changed)
    if kind == "not-object":
        value = draw(st.sampled_from([[1, 2], "x", 42, None, {}, True, [row]]))
        return encode(value, draw), Expect(None, None, None)
    if kind == "engine-invalid":
        changed, field = engine_invalid(draw, row)
        return encode(changed, draw), valid if harmless(field, generate) else error_expect(changed)
    if kind == "junk":  # nested lists in place of a list of ints
        field = draw(st.sampled_from(LISTS))
        changed = {**row, field: [[[row[field]]], {"x": [1]}]}
        return encode(changed, draw), valid if harmless(field, generate) else error_expect(changed)
    if kind == "deep":  # nested deeper than msgspec decodes: the line is not JSON
        line = encode({**row, "extra": "@@"}, draw)
        return line.replace(b'"@@"', b"[" * 3000 + b"]" * 3000), Expect(None, None, None)
    pad = b'"pad": [' + b"0, " * OVERLONG_PAD + b"0]"
    body = msgspec.json.encode(row)[1:-1]
    if kind == "overlong-first":  # the ids lead the line: they label it
        return b"{" + body + b", " + pad + b"}", Expect(None, row["request_id"], row["user_id"])
    assert kind == "overlong-last"  # the ids after the padding: unread
    return b"{" + pad + b", " + body + b"}", Expect(None, None, None)


def request_ids_of(index: int) -> st.SearchStrategy[str]:
    """Request ids for pool request ``index``: its own, or with any text after it (ids need not be unique)."""
    own = pool()[index]["request_id"]
    return st.just(own) | st.text(max_size=6).map(lambda text: own + text)


@st.composite
def jsonl_files(draw: Any, generate: bool, every_kind: bool = False) -> tuple[bytes, list[Expect]]:
    """A JSONL file and the expected output of each of its non-blank lines, labels by place filled in; with
    ``every_kind``, a line of each kind, in any order."""
    if every_kind:
        kinds = draw(st.permutations(JSONL_KINDS))
        indices = draw(st.lists(st.integers(0, POOL_SIZE - 1), min_size=len(kinds), max_size=len(kinds), unique=True))
    else:
        indices = draw(st.lists(st.integers(0, POOL_SIZE - 1), min_size=1, max_size=10, unique=True))
        kinds = [draw(st.sampled_from(JSONL_KINDS)) for _ in indices]
    for kind in kinds:
        event(f"row: {kind}")
    request_ids = [draw(request_ids_of(index)) for index in indices]
    valid = [i for i, kind in enumerate(kinds) if kind == "valid"]
    if len(valid) > 1 and draw(st.booleans()):  # a request_id of another user's request: both are served
        first, second = draw(st.permutations(valid))[:2]
        request_ids[second] = request_ids[first] + draw(st.sampled_from(["", "", f"#{second}", "#"]))
    rows = [jsonl_row(draw, kind, index, request_id, generate)
            for kind, index, request_id in zip(kinds, indices, request_ids)]
    lines, expects = [line for line, _ in rows], [expect for _, expect in rows]
    bom = draw(st.booleans())
    leading = draw(st.sampled_from([0, 0, 1, 2]))  # blank lines first (after the byte-order mark, if any)
    if kinds[0] == "stray-bom" and not bom and not leading:  # it begins the file: skipped, as a mark there is
        expects[0] = Expect(indices[0], request_ids[0], pool()[indices[0]]["user_id"])
    lines[:0], expects[:0] = [draw(st.sampled_from(BLANKS)) for _ in range(leading)], [None] * leading
    endings = [draw(st.sampled_from([b"\n", b"\r\n"])) for _ in lines]
    if draw(st.booleans()):
        endings[-1] = b""  # the last line without its newline
    data = (BOM if bom else b"") + b"".join(line + end for line, end in zip(lines, endings))
    outputs = []
    for number, expect in enumerate(expects, start=1):
        if expect is not None:  # blank lines are skipped, and counted
            outputs.append(expect if expect.index is not None or expect.request_id is not None
                           else Expect(None, f"line-{number}", expect.user_id))
    return data, outputs


# ------------------------------------------------------------------------------------------------------ checking


def run_job(command: str, source: Path, output: Path, chunk_rows: int) -> tuple[int, str]:
    """``gr-engine command`` on ``source`` in this process: its exit status and stderr."""
    config = source.parent / "engine.json"
    config.write_text(msgspec.json.encode(CONFIG).decode())
    extra = ["--top-k", str(TOP_K)] if command == "generate" else []
    err = io.StringIO()
    with mock.patch.object(gio, "CHUNK_ROWS", chunk_rows), contextlib.redirect_stderr(err):
        status = main([command, "--input", str(source), "--output", str(output), "--config", str(config),
                       "--no-progress", *extra])
    return status, err.getvalue()


def read_output(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def check_job(command: str, source: Path, out_name: str, chunk_rows: int, expects: list[Expect]) -> None:
    generate = command == "generate"
    output = source.parent / out_name
    status, err = run_job(command, source, output, chunk_rows)
    failed = sum(e.index is None for e in expects)
    event(f"job: {'no rows' if not expects else 'all failed' if failed == len(expects) else 'some served'}")
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    verb = "retrieved items for" if generate else "ranked"
    assert lines and lines[0].startswith(f"{verb} {len(expects) - failed} requests ({failed} failed)"), err
    all_failed = bool(expects) and failed == len(expects)
    assert status == (1 if all_failed else 0), err
    assert len(lines) == 1 + all_failed, err
    rows = read_output(output)
    assert len(rows) == len(expects), ([r["request_id"] for r in rows], expects)
    as_strings = output.suffix == ".parquet" and pq.read_schema(output).field("user_id").type == pa.string()
    if output.suffix == ".parquet":  # int64 while every user id is an int that fits, else strings
        assert as_strings == any(isinstance(e.user_id, str) or (e.user_id is not None and not -2**63 <= e.user_id
                                                                < 2**63) for e in expects)
    for number, (row, expect) in enumerate(zip(rows, expects), start=1):
        user_id = str(expect.user_id) if as_strings and expect.user_id is not None else expect.user_id
        assert (row["request_id"], row["user_id"]) == (expect.request_id, user_id), (number, row, expect)
        if expect.index is None:
            assert row["error"], (number, row)
            assert len(row["scores"]) == 0 and len(row.get("item_ids", [])) == 0
            continue
        assert row["error"] is None, (number, row, expect)
        want = reference(expect.index, generate)
        assert (row["num_gpu_cached_tokens"], row["num_host_cached_tokens"], row["num_computed_tokens"]) == (
            0, 0, want.num_computed_tokens), (number, expect)  # a fresh user: nothing cached
        if generate:
            assert row["item_ids"] == want.item_ids, (number, expect)
        scores, wanted = np.asarray(row["scores"], dtype=np.float64), np.asarray(want.scores, dtype=np.float64)
        assert scores.shape == wanted.shape, (number, expect)
        np.testing.assert_allclose(scores, wanted, atol=1e-5, rtol=0, err_msg=f"row {number}")


@contextlib.contextmanager
def workdir():
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


JOBS = {"data": st.data(), "command": st.sampled_from(["rank", "generate"]),
        "out_name": st.sampled_from(["out.jsonl", "out.parquet"]), "chunk_rows": st.sampled_from([1, 2, 3, 256])}


@FUZZ
@given(**JOBS)
def test_jsonl_file_jobs(data, command, out_name, chunk_rows):
    check_jsonl_job(data.draw(jsonl_files(command == "generate")), command, out_name, chunk_rows)


@EVERY_KIND
@given(**JOBS)
def test_a_jsonl_file_job_with_every_kind_of_line(data, command, out_name, chunk_rows):
    check_jsonl_job(data.draw(jsonl_files(command == "generate", every_kind=True)), command, out_name, chunk_rows)


def check_jsonl_job(drawn: tuple[bytes, list[Expect]], command: str, out_name: str, chunk_rows: int) -> None:
    source_bytes, expects = drawn
    with workdir() as folder:
        (folder / "in.jsonl").write_bytes(source_bytes)
        check_job(command, folder / "in.jsonl", out_name, chunk_rows, expects)


# -------------------------------------------------------------------------------------------------------- Parquet

#: Column types of a request's fields: those that read as valid values, then those that do not.
ID_TYPES = {"string": pa.string(), "large_string": pa.large_string(), "dictionary": "dictionary"}
BAD_ID_TYPES = {"int64": pa.int64(), "null": pa.null(), "missing": None}
USER_TYPES = {"int64": pa.int64(), "uint64": pa.uint64(), "string": pa.string(), "dictionary": "dictionary"}
BAD_USER_TYPES = {"double": pa.float64(), "missing": None}
LIST_TYPES = {"int64": pa.list_(pa.int64()), "int32": pa.list_(pa.int32()), "large": pa.large_list(pa.int64()),
              "uint64": pa.list_(pa.uint64())}
BAD_LIST_TYPES = {"string": pa.list_(pa.string()), "double": pa.list_(pa.float64()),
                  "nested": pa.list_(pa.list_(pa.int64())), "missing": None}
EXTRA_COLUMNS = {"blob": pa.array([b"x" * 100]), "tags": pa.array([["a", "b"]]),
                 "meta": pa.array([{"request_id": "nested", "user_id": 1}]), "score": pa.array([0.5])}

PARQUET_KINDS = ["valid", "valid", "valid", "null-id", "null-user", "null-list", "null-in-list", "overlong-list",
                 "long-string", "engine-invalid", "uint64-overflow"]


def id_value(index: int, kind: str) -> Any:
    """Pool request ``index``'s id in a ``request_id`` column of a type ``kind`` that holds no strings."""
    return {"int64": 500 + index}.get(kind)


def user_value(index: int, kind: str) -> Any:
    """Pool user ``index``'s id in a ``user_id`` column of type ``kind``: distinct users whatever the type."""
    if kind in ("string", "dictionary"):
        return f"user-{index}"
    return {"int64": 10_000 + index, "uint64": 2**64 - 1 - index, "double": float(index)}.get(kind)


def list_value(values: list[Any] | None, kind: str) -> Any:
    """A list of ints (some perhaps None) as a list column of type ``kind`` holds it."""
    if values is None:
        return None
    convert = {"string": str, "double": float, "nested": lambda v: [v]}.get(kind, lambda v: v)
    return [None if v is None else convert(v) for v in values]


@st.composite
def parquet_files(draw: Any, generate: bool, every_kind: bool = False) -> tuple[pa.Table, list[Expect]]:
    """A table of request columns of drawn types (some that do not read as valid values), with other columns
    besides, and the expected output of each row; with ``every_kind``, columns of valid types and a row of each
    kind, in any order."""
    fields = ["request_id", "user_id", *LISTS]
    good = {"request_id": ID_TYPES, "user_id": USER_TYPES, **{name: LIST_TYPES for name in LISTS}}
    bad = {"request_id": BAD_ID_TYPES, "user_id": BAD_USER_TYPES, **{name: BAD_LIST_TYPES for name in LISTS}}
    spoiled = set(draw(st.lists(st.sampled_from(fields), max_size=2, unique=True))
                  if not every_kind and draw(st.booleans()) else [])
    kinds = {name: draw(st.sampled_from(sorted(bad[name] if name in spoiled else good[name]))) for name in fields}
    for name in sorted(spoiled):
        event(f"column: {name} {kinds[name]}")
    if generate:
        spoiled.discard("candidate_item_ids")  # not read
    if every_kind:
        row_kinds = draw(st.permutations(PARQUET_KINDS))
        indices = draw(st.lists(st.integers(0, POOL_SIZE - 1), min_size=len(row_kinds), max_size=len(row_kinds),
                                unique=True))
    else:
        indices = draw(st.lists(st.integers(0, POOL_SIZE - 1), min_size=1, max_size=10, unique=True))
        row_kinds = [draw(st.sampled_from(PARQUET_KINDS)) for _ in indices]
    columns: dict[str, list[Any]] = {name: [] for name in fields}
    expects = []
    for index, kind in zip(indices, row_kinds):
        request_id = draw(request_ids_of(index)) if kinds["request_id"] in ID_TYPES else id_value(
            index, kinds["request_id"])
        row = {**pool()[index], "request_id": request_id, "user_id": user_value(index, kinds["user_id"])}
        event(f"row: {kind}")
        changed = None  # the field made invalid
        if kind == "null-id":
            row["request_id"], changed = None, "request_id"
        elif kind == "null-user":
            row["user_id"], changed = None, "user_id"
        elif kind in ("null-list", "null-in-list"):
            changed = draw(st.sampled_from(LISTS))
            row[changed] = None if kind == "null-list" else [*row[changed][:-1], None]
        elif kind == "overlong-list":
            changed = draw(st.sampled_from(LISTS))
            bound = CONFIG.model.max_candidates if changed == "candidate_item_ids" else CONFIG.model.max_history_len
            row[changed] = [1] * (bound + draw(st.integers(1, 50)))  # refused unread, labelled by its ids
        elif kind == "long-string" and kinds["request_id"] in ID_TYPES:
            row["request_id"], changed = "r" * (1 << 20) + row["request_id"], "request_id"  # too long to label
        elif kind == "engine-invalid":
            row, changed = engine_invalid(draw, row)
            if kinds["item_ids"] == "uint64":  # no negative ids there: one outside the vocabulary instead
                row["item_ids"] = [v if v >= 0 else CONFIG.model.num_items for v in row["item_ids"]]
        elif kind == "uint64-overflow" and (unsigned := [name for name in LISTS if kinds[name] == "uint64"]):
            changed = draw(st.sampled_from(unsigned))  # over int64: the engine refuses it
            row[changed] = [*row[changed][:-1], draw(st.integers(2**63, 2**64 - 1))]
        for name in fields:
            value = row.get(name)
            columns[name].append(list_value(value, kinds[name]) if name in LISTS else value)
        if not spoiled and (changed is None or harmless(changed, generate)):
            expects.append(Expect(index, row["request_id"], row["user_id"]))
            continue
        expect = error_expect({name: value for name, value in row.items() if kinds[name] not in ("missing", "null")})
        expects.append(Expect(None, None, expect.user_id) if kind == "long-string" and changed else expect)
    arrays = {}
    for name in fields:
        kind = kinds[name]
        types = {**good[name], **bad[name]}
        if types[kind] is None:
            continue
        if types[kind] == "dictionary":
            arrays[name] = pa.array(columns[name], pa.string()).dictionary_encode()
        elif kind == "null":
            arrays[name] = pa.nulls(len(indices))
        else:
            arrays[name] = pa.array(columns[name], types[kind])
    for extra in draw(st.lists(st.sampled_from(sorted(EXTRA_COLUMNS)), max_size=2, unique=True)):
        arrays[extra] = pa.concat_arrays([EXTRA_COLUMNS[extra]] * len(indices))
    order = draw(st.permutations(sorted(arrays)))
    table = pa.table({name: arrays[name] for name in order})
    return table, [e if e.index is not None or e.request_id is not None else Expect(None, f"row-{n}", e.user_id)
                   for n, e in enumerate(expects, start=1)]


@FUZZ
@given(**JOBS, row_group_rows=st.sampled_from([1, 3, 100]))
def test_parquet_file_jobs(data, command, out_name, chunk_rows, row_group_rows):
    check_parquet_job(data.draw(parquet_files(command == "generate")), command, out_name, chunk_rows,
                      row_group_rows)


@EVERY_KIND
@given(**JOBS, row_group_rows=st.sampled_from([1, 3, 100]))
def test_a_parquet_file_job_with_every_kind_of_row(data, command, out_name, chunk_rows, row_group_rows):
    check_parquet_job(data.draw(parquet_files(command == "generate", every_kind=True)), command, out_name,
                      chunk_rows, row_group_rows)


def check_parquet_job(drawn: tuple[pa.Table, list[Expect]], command: str, out_name: str, chunk_rows: int,
                      row_group_rows: int) -> None:
    table, expects = drawn
    with workdir() as folder:
        pq.write_table(table, folder / "in.parquet", row_group_size=row_group_rows)
        check_job(command, folder / "in.parquet", out_name, chunk_rows, expects)


# ------------------------------------------------------------------------------------- an overlong line's labels

LABEL_KEYS = st.sampled_from(["request_id", "user_id", "x", 'request_id"', "user_id ", "\\"])
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(st.sampled_from('ab"\\\n\x01é{}[]:, request_iduser_id\u2028'), max_size=8))
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(LABEL_KEYS, inner, max_size=3), max_leaves=10)


def decoded_labels(line: bytes) -> tuple[str | None, Any]:
    """The labels decoding a line gives (``io.parse_row``'s), but none for a ``request_id`` that is a list or an
    object (``json_labels.overlong_labels`` reads scalars only); ``(None, None)`` for a line that is not JSON."""
    try:
        row = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None, None
    expect = error_expect(row)
    nested = isinstance(row, dict) and isinstance(row.get("request_id"), (list, dict))
    return None if nested else expect.request_id, expect.user_id


def json_object(pairs: list[tuple[str, Any]], space: str) -> bytes:
    return ("{" + space + f",{space}".join(f"{json.dumps(key)}{space}:{space}{json.dumps(value, ensure_ascii=False)}"
                                          for key, value in pairs) + space + "}").encode()


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(pairs=st.lists(st.tuples(LABEL_KEYS, JSON_VALUES), max_size=5), space=st.sampled_from(["", " ", "\t", "\r "]),
       data=st.data())
def test_overlong_labels_are_those_of_decoding_the_line(pairs, space, data):
    """``overlong_labels`` of a whole line gives its labels as decoding it would; of any beginning of it (keys
    not repeated), a label only where decoding the whole line gives that label."""
    line = json_object(pairs, space)
    assert overlong_labels(line, complete=True) == decoded_labels(line), line
    if len({key for key, _ in pairs}) == len(pairs):  # a key repeated beyond the beginning is not seen
        head = line[:data.draw(st.integers(0, len(line)))]
        for got, want in zip(overlong_labels(head), decoded_labels(line)):
            assert got is None or got == want, (head, line)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(pairs=st.lists(st.tuples(LABEL_KEYS, JSON_VALUES), max_size=5), data=st.data())
def test_overlong_labels_of_a_line_that_is_not_json_are_none(pairs, data):
    """A line spoiled by a few bytes: its labels are decoding's, so none where it is not JSON."""
    line = bytearray(json_object(pairs, " "))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(line)))
        if data.draw(st.booleans()) and at < len(line):
            del line[at]
        else:
            line[at:at] = data.draw(st.sampled_from([b'"', b"\\", b",", b"}", b"{", b"[", b"]", b":", b"\xff", b"x",
                                                      b"1", b" ", b"\x00", b"e", b"-", b"\\u12"]))
    assert overlong_labels(bytes(line), complete=True) == decoded_labels(bytes(line)), bytes(line)
