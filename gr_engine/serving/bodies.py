"""The bodies of ``POST /v1/rank`` and ``POST /v1/generate`` and of their answers: JSON (the default) or msgpack
(docs/serving.md, "Body formats").

A body is msgpack when its ``Content-Type`` is ``application/msgpack`` or ``application/x-msgpack``, else JSON. Its
fields are JSON's; in msgpack each integer array of a request (``item_ids``, ``action_ids``, ``timestamps``,
``candidate_item_ids``) may be a msgpack array of ints or a bin holding little-endian int64 raw bytes, which becomes
an array over the body's bytes (:func:`~.protocol.int64_array`: no per-element work). The answer is msgpack when the
request's ``Accept`` names a msgpack type, or names no JSON type while its ``Content-Type`` is msgpack; a msgpack
answer has JSON's fields, except that a ranking output's ``scores`` is a bin of little-endian float32 raw bytes,
row-major, with ``scores_shape`` ``[num_candidates, num_tasks]`` beside it, and that a failed request's ``user_id``
beyond 64 bits (msgpack holds none) is ``None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated, Any

import msgspec

from ..output_writer import array_as_lists
from ..outputs import GenerateOutput, RankOutput
from ..request import GenerateParams, GenerateRequest, RankRequest
from .protocol import FLOAT32, INT64, array_bytes, int64_array

MSGPACK_TYPES = frozenset({"application/msgpack", "application/x-msgpack"})
JSON_TYPE = "application/json"


TimeoutMs = Annotated[float, msgspec.Meta(ge=0)]  # NaN and negative deadlines fail decoding (a 400)


class RankBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/rank``: ``requests`` (each a :class:`~gr_engine.RankRequest`) and an optional deadline (ms,
    >= 0)."""

    requests: list[msgspec.Raw]
    timeout_ms: TimeoutMs | None = None


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/generate``: ``requests`` (each a :class:`~gr_engine.GenerateRequest`), retrieval ``params`` and
    an optional deadline (ms, >= 0)."""

    requests: list[msgspec.Raw]
    params: GenerateParams = msgspec.field(default_factory=GenerateParams)
    timeout_ms: TimeoutMs | None = None


_MSGPACK_INTS = (-(2**63), 2**64 - 1)  # the integers msgpack holds
Ints = list[int] | memoryview  # a msgpack array of ints, or a bin of little-endian int64 raw bytes
_ARRAYS = ("item_ids", "action_ids", "timestamps", "candidate_item_ids")


class _PackedGenerateRequest(msgspec.Struct, kw_only=True):
    """A :class:`~gr_engine.GenerateRequest` in msgpack."""

    request_id: str
    user_id: int | str
    item_ids: Ints
    action_ids: Ints
    timestamps: Ints


class _PackedRankRequest(_PackedGenerateRequest, kw_only=True):
    """A :class:`~gr_engine.RankRequest` in msgpack."""

    candidate_item_ids: Ints


@contextlib.contextmanager
def _nesting_is_a_decode_error() -> Iterator[None]:
    """msgspec raises ``RecursionError`` for values nested too deeply (e.g. thousands of ``[``): a malformed body."""
    try:
        yield
    except RecursionError:
        raise msgspec.DecodeError("values nested too deeply") from None


class BodyFormat:
    """One format of request bodies and answers (:data:`JSON` or :data:`MSGPACK`).

    Decoding raises ``msgspec.DecodeError`` (not this format, or nested too deeply) or ``msgspec.ValidationError``
    (wrong fields), and
    :meth:`decode_request` also :class:`~gr_engine.validation.RequestError` (a raw field that is not int64 bytes).
    """

    def __init__(self, media_type: str, module: Any, requests: tuple[type, type]) -> None:
        self.media_type = media_type
        self._module = module
        self._bodies = {body: module.Decoder(body) for body in (RankBody, GenerateBody)}
        self._requests = {ranking: module.Decoder(kind) for ranking, kind in zip((False, True), requests)}
        self._any = module.Decoder()
        self._encoder = module.Encoder(enc_hook=array_as_lists)

    def decode_body(self, raw: bytes, body_type: type[RankBody] | type[GenerateBody]) -> RankBody | GenerateBody:
        """A whole body; its requests stay undecoded (each is decoded on its own: :meth:`decode_request`)."""
        with _nesting_is_a_decode_error():
            return self._bodies[body_type].decode(raw)

    def decode_request(self, item: msgspec.Raw, ranking: bool) -> RankRequest | GenerateRequest:
        """One request of a body: a :class:`~gr_engine.RankRequest` (``ranking``) or
        :class:`~gr_engine.GenerateRequest`."""
        with _nesting_is_a_decode_error():
            return self._requests[ranking].decode(item)

    def fields(self, item: msgspec.Raw) -> dict[str, Any]:
        """A malformed request's fields where they can be read (to label its error output)."""
        with contextlib.suppress(msgspec.DecodeError), _nesting_is_a_decode_error():
            fields = self._any.decode(item)
            if isinstance(fields, dict):
                return fields
        return {}

    def encode(self, data: Any) -> bytes:
        """An answer that is not outputs (``{"error": ...}``)."""
        return self._encoder.encode(data)

    def encode_outputs(self, outputs: list[RankOutput | GenerateOutput]) -> bytes:
        """``{"outputs": [...]}``."""
        return self._encoder.encode({"outputs": outputs})


class _Msgpack(BodyFormat):
    """msgpack: raw int64 request arrays, raw float32 ranking scores (the module docstring)."""

    def decode_request(self, item: msgspec.Raw, ranking: bool) -> RankRequest | GenerateRequest:
        packed = self._requests[ranking].decode(item)
        fields = msgspec.structs.asdict(packed)
        for name in _ARRAYS:
            if isinstance(fields.get(name), memoryview):
                fields[name] = int64_array(name, fields[name])
        return (RankRequest if ranking else GenerateRequest)(**fields)

    def encode_outputs(self, outputs: list[RankOutput | GenerateOutput]) -> bytes:
        return self._encoder.encode({"outputs": [_packed_output(o) for o in outputs]})


def packed_request(request: RankRequest | GenerateRequest) -> dict[str, Any]:
    """A request's fields for a msgpack body, integer arrays as little-endian int64 raw bytes (what clients send)."""
    fields = msgspec.structs.asdict(request)
    for name in _ARRAYS:
        if name in fields:
            fields[name] = array_bytes(fields[name], INT64)
    return fields


def _packed_output(output: RankOutput | GenerateOutput) -> RankOutput | GenerateOutput | dict[str, Any]:
    if isinstance(output.user_id, int) and not _MSGPACK_INTS[0] <= output.user_id <= _MSGPACK_INTS[1]:
        # a failed request's user id beyond 64 bits (a JSON body's): msgpack cannot hold it, so it reads as unknown
        output = msgspec.structs.replace(output, user_id=None)
    if not isinstance(output, RankOutput):
        return output
    fields = msgspec.structs.asdict(output)
    fields["scores"], fields["scores_shape"] = array_bytes(output.scores, FLOAT32), list(output.scores.shape)
    return fields


JSON = BodyFormat(JSON_TYPE, msgspec.json, (GenerateRequest, RankRequest))
MSGPACK = _Msgpack("application/msgpack", msgspec.msgpack, (_PackedGenerateRequest, _PackedRankRequest))


def _media_types(header: str | None) -> set[str]:
    return {part.split(";", 1)[0].strip().lower() for part in (header or "").split(",")}


def request_format(content_type: str | None) -> BodyFormat:
    """The format of a body with this ``Content-Type``: msgpack for a msgpack type, else JSON."""
    return MSGPACK if _media_types(content_type) & MSGPACK_TYPES else JSON


def answer_format(accept: str | None, content_type: str | None) -> BodyFormat:
    """The format of the answer to a request with these ``Accept`` and ``Content-Type`` headers."""
    accepted = _media_types(accept)
    if accepted & MSGPACK_TYPES:
        return MSGPACK
    return JSON if JSON_TYPE in accepted else request_format(content_type)
