"""The ``request_id`` and ``user_id`` of a JSON object from its first bytes alone: the labels of a JSONL line too long
to decode (:func:`gr_engine.io.jsonl_rows`), read token by token, strictly as JSON, without holding more than those
bytes.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from .outputs import output_user_id

_STRING = rb'"(?:[^"\\\x00-\x1f]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+'

#: A JSON token, after any whitespace: group 1 a structural character, else a string, number or literal.
#: Possessive: matching is linear in the bytes it reads.
_TOKEN = re.compile(rb"[ \t\n\r]*+(?:([][{}:,])|" + _STRING + rb'"'
                    rb"|-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?+(?:[eE][+-]?+[0-9]++)?+|true|false|null)")

#: The rest of a prefix of valid JSON that ends within a token: whitespace, then the beginning of a string, number
#: or literal.
_CUT_TOKEN = re.compile(rb"[ \t\n\r]*+(?:" + _STRING + rb"(?:\\(?:u[0-9a-fA-F]{0,3})?)?+"
                        rb"|-?[0-9]*+(?:\.[0-9]*+)?+(?:[eE][+-]?+[0-9]*+)?+|t(?:ru?)?|f(?:a(?:ls?)?)?|n(?:u(?:ll?)?)?)\Z")

_LABELS = ("request_id", "user_id")

#: A value that is not JSON (:func:`_scalar`).
_INVALID = object()


def overlong_labels(head: bytes | bytearray, complete: bool = False) -> tuple[str | None, int | str | None]:
    """The ``request_id`` (``str`` of its value, as :func:`parse_row` labels a row) and ``user_id``
    (:func:`~gr_engine.outputs.output_user_id`) of a JSONL line, from its first bytes ``head`` (the whole line if
    ``complete``), where decoding the line would find them: as keys of its top-level object; ``None`` for one not
    found. ``head`` is read token by token, strictly as JSON (UTF-8), up to its end (a token that may go on beyond
    it is not read): a key nested in another value or within a string is not taken, a label whose value is a list or
    an object is not read, and where ``head`` is not valid JSON, neither label is given. A key repeated beyond
    ``head`` is not seen (a decoder keeps the last of repeated keys)."""
    found: dict[str, Any] = {}
    closers: list[bytes] = []  # the closing bracket of each open list or object, innermost last
    want = "value"  # what comes next: a value, a key, the ":" after a key or the "," after a value
    label = None  # the top-level key whose value comes next, if a label
    pos = 0
    while (match := _TOKEN.match(head, pos)) is not None and (complete or match.end() < len(head)):
        token, structural, pos = match[0].lstrip(b" \t\r\n"), match[1], match.end()
        if closers and structural == closers[-1] and (want == "comma" or want.endswith("-or-close")):
            closers.pop()
            if not closers:  # the top-level object ends: only whitespace may follow
                if head[pos:].strip(b" \t\r\n"):
                    return None, None
                break
            want = "comma"
        elif want.startswith("value") and structural in (None, b"[", b"{"):
            value = None if structural is not None else _scalar(token)  # a list or object is not read
            if value is _INVALID:
                return None, None
            if label is not None:
                found[label], label = value, None
            if structural is not None:
                closers.append(b"]" if structural == b"[" else b"}")
                want = "value-or-close" if structural == b"[" else "key-or-close"
            elif not closers:
                return None, None  # the line is not an object
            else:
                want = "comma"
        elif want.startswith("key") and structural is None and token.startswith(b'"'):
            if len(closers) == 1:  # a key of the top-level object
                name = _scalar(token)
                if name is _INVALID:
                    return None, None
                label = name if name in _LABELS else None
            want = "colon"
        elif (want, structural) == ("colon", b":"):
            want = "value"
        elif (want, structural) == ("comma", b","):
            want = "key" if closers[-1] == b"}" else "value"
        else:
            return None, None
    else:  # head ends: within a token, or after one that may go on
        if complete or (match is None and _CUT_TOKEN.match(head, pos) is None):
            return None, None
    try:
        bytes(head[:pos]).decode()  # strings of other values are read unchecked: as JSON they are UTF-8
    except UnicodeDecodeError:
        return None, None
    request_id = found.get("request_id")
    return None if request_id is None else str(request_id), output_user_id(found.get("user_id"))


def _scalar(token: bytes) -> Any:
    """A string, number or literal token's value, or ``_INVALID`` (e.g. a number out of range, a string of invalid
    UTF-8 or a lone surrogate)."""
    try:
        return msgspec.json.decode(token)
    except msgspec.DecodeError:
        return _INVALID
