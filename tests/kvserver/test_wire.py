"""Tests of kvserver.wire without sockets: codec round trips and every validation error."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver import grants, wire
from kvserver.errors import (
    InvalidArgument,
    KVServerError,
    LeaseExpired,
    UnknownNamespace,
    UnsupportedVersion,
)
from kvserver.grants import LoadGrant, StoreGrant

KEY = b"k" * 32

#: a valid value of every argument kind.
VALID: dict[str, Any] = {
    "str": "ns",
    "int": 7,
    "float": 1.5,
    "bool": True,
    "map": {"model": "m"},
    "keys": [KEY, b"j" * 16],
    "ints": [0, 1, 2],
    "token_ids": b"\x00\x00\x00\x00\x01\x00\x00\x00",
    "str_pair": ["lora", "/path"],
    "completions": [[7, True, None, None], [8, False, [0, 1], [KEY]]],
}
#: values that every kind must refuse (None is "absent", so it is not here).
WRONG: dict[str, list[Any]] = {
    "str": [1, b"ns", ["ns"], True],
    "int": [-1, 1.0, "7", True, 1 << 63, [1]],
    "float": ["1", True, float("nan"), float("inf"), [1.0]],
    "bool": [1, 0, "true", [True]],
    "map": [[], "x", 1],
    "keys": [KEY, ["k" * 32], [KEY, 1], [b"x" * 65], "keys"],
    "ints": [[-1], [1.5], [True], 3, ["1"]],
    "token_ids": [[-1], [1.5], [True], 3, ["1"], b"\x00\x00\x00", "abcd", bytearray(4)],
    "str_pair": [["a"], ["a", "b", "c"], ["a", 1], "ab"],
    "completions": [
        [7, True, None, None],  # not a list of lists
        [[7, True, None]],
        [[7, True, None, None, None]],
        [[-1, True, None, None]],
        [[7, 1, None, None]],
        [[7, True, [-1], None]],
        [[7, True, None, [b"x" * 65]]],
        [[7, True, None, "keys"]],
        [{"lease_id": 7}],
        [[7, True, None, None]] * (wire.MAX_COMPLETIONS + 1),
    ],
}


def valid_args(op: str, *, optional: bool = True) -> dict[str, Any]:
    return {
        name: VALID[kind] for name, (kind, required) in wire.OPS[op].items() if required or optional
    }


def header(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"v": 1, "id": 5, "op": wire.HELLO, "args": {}}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


def parse(obj: Any) -> wire.Request:
    return wire.parse_request(wire.unpack_header(msgpack.packb(obj, use_bin_type=True)))


# ----------------------------------------------------------------------------- requests


@pytest.mark.parametrize("op", sorted(wire.OPS))
@pytest.mark.parametrize("optional", [True, False])
def test_request_round_trip_every_op(op: str, optional: bool) -> None:
    args = valid_args(op, optional=optional)
    frame = wire.encode_request(42, op, args, auth="secret", client="worker-0")
    req = wire.parse_request(wire.unpack_header(frame))
    assert (req.req_id, req.op, req.auth, req.client) == (42, op, "secret", "worker-0")
    assert set(req.args) == set(wire.OPS[op])
    for name, value in req.args.items():
        assert value == args.get(name)


def test_encode_request_omits_none_arguments_and_empty_auth() -> None:
    frame = wire.encode_request(1, wire.LOOKUP, {"ns_id": "a", "keys": [], "record": None})
    obj = msgpack.unpackb(frame)
    assert obj["args"] == {"ns_id": "a", "keys": []}
    assert "auth" not in obj and "client" not in obj


def test_every_op_has_a_schema_and_payload_ops_exist() -> None:
    assert set(wire.OPS) >= wire.OPS_WITH_PAYLOAD
    for schema in wire.OPS.values():
        for kind, _required in schema.values():
            assert kind in VALID


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"", "empty header frame"),
        (b"\xc1", "malformed msgpack"),  # never-used type byte
        (b"\x82\xa1v", "malformed msgpack"),  # truncated map
        (msgpack.packb({"v": 1}) + b"\x00", "malformed msgpack"),  # trailing bytes
        (b"\x91" * 5000, "malformed msgpack"),  # nesting too deep
        (b"\x81\x01\x02", "malformed msgpack"),  # integer map key
        (b"\xa2\xff\xfe", "malformed msgpack"),  # invalid utf-8
        (msgpack.packb(msgpack.ExtType(1, b"ab")), "malformed msgpack"),  # ext types refused
        (b"\xd6\xff\x00\x00\x00\x01", "malformed msgpack"),  # msgpack timestamp ext
    ],
)
def test_unpack_header_rejects_malformed_input(frame: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        wire.unpack_header(frame)


def test_unpack_header_rejects_oversized_frames_before_decoding() -> None:
    with pytest.raises(InvalidArgument, match="too large"):
        wire.unpack_header(b"\x00" * (wire.MAX_HEADER_BYTES + 1))


def test_unpack_header_limits_containers() -> None:
    big_map = msgpack.packb({str(i): i for i in range(wire.MAX_MAP_LEN + 1)})
    with pytest.raises(InvalidArgument, match="malformed"):
        wire.unpack_header(big_map)
    long_str = msgpack.packb("x" * (wire.MAX_STR_LEN + 1))
    with pytest.raises(InvalidArgument, match="malformed"):
        wire.unpack_header(long_str)


@pytest.mark.parametrize(
    "obj, error, match",
    [
        ([1, 2], InvalidArgument, "must be a msgpack map"),
        ("hello", InvalidArgument, "must be a msgpack map"),
        (header(v=...), InvalidArgument, "protocol version"),
        (header(v="1"), InvalidArgument, "protocol version"),
        (header(v=True), InvalidArgument, "protocol version"),
        (header(v=2), UnsupportedVersion, "version 2 is not supported"),
        (header(v=0), UnsupportedVersion, "not supported"),
        (header(extra=1), InvalidArgument, "unknown header fields: extra"),
        (header(id=...), InvalidArgument, "'id'"),
        (header(id=0), InvalidArgument, "'id'"),
        (header(id=-3), InvalidArgument, "'id'"),
        (header(id=True), InvalidArgument, "'id'"),
        (header(id=1.0), InvalidArgument, "'id'"),
        (header(op=...), InvalidArgument, "'op' must be a string"),
        (header(op=b"hello"), InvalidArgument, "'op' must be a string"),
        (header(op="drop_tables"), InvalidArgument, "unknown op 'drop_tables'; valid: hello"),
        (header(auth=5), InvalidArgument, "'auth'"),
        (header(client=""), InvalidArgument, "'client' must not be empty"),
        (header(client=["x"]), InvalidArgument, "'client'"),
        (header(client="x" * 257), InvalidArgument, "'client'"),
        (header(args=[]), InvalidArgument, "'args' must be a map"),
        (header(args={"x": 1}), InvalidArgument, "unknown arguments for hello: x"),
    ],
)
def test_parse_request_rejects_bad_envelopes(obj: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match) as info:
        parse(obj)
    assert type(info.value) is error


def test_version_is_checked_before_anything_else() -> None:
    """A future version's header may differ in every field: it gets unsupported_version."""
    with pytest.raises(UnsupportedVersion) as info:
        parse({"v": 9, "operation": "x"})
    assert info.value.code == "unsupported_version"


def test_args_may_be_absent_or_nil_for_ops_without_required_args() -> None:
    assert parse(header(args=...)).args == {}
    assert parse(header(args=None)).args == {}


REQUIRED = [
    (op, name)
    for op, schema in sorted(wire.OPS.items())
    for name, (_k, req) in schema.items()
    if req
]


@pytest.mark.parametrize("op, name", REQUIRED)
@pytest.mark.parametrize("absent", ["missing", "nil"])
def test_missing_required_argument(op: str, name: str, absent: str) -> None:
    args = valid_args(op)
    if absent == "missing":
        del args[name]
    else:
        args[name] = None
    with pytest.raises(InvalidArgument, match=f"{op}: missing required argument '{name}'"):
        parse(header(op=op, args=args))


WRONG_CASES = [
    (op, name, bad)
    for op, schema in sorted(wire.OPS.items())
    for name, (kind, _req) in schema.items()
    for bad in WRONG[kind]
]


@pytest.mark.parametrize("op, name, bad", WRONG_CASES)
def test_wrong_argument_types(op: str, name: str, bad: Any) -> None:
    args = valid_args(op)
    args[name] = bad
    with pytest.raises(InvalidArgument, match=f"{op}: argument '{name}' must be"):
        wire.parse_request(header(op=op, args=args))


@pytest.mark.parametrize(
    "obj, rid",
    [
        ({"id": 5}, 5),
        ({"id": wire.MAX_INT}, wire.MAX_INT),
        ({"id": 0}, 0),
        ({"id": -1}, 0),
        ({"id": True}, 0),
        ({"id": "5"}, 0),
        ({}, 0),
        ([5], 0),
        (None, 0),
    ],
)
def test_request_id_of(obj: Any, rid: int) -> None:
    assert wire.request_id_of(obj) == rid


# ----------------------------------------------------------------------------- replies


def test_reply_round_trip() -> None:
    r = wire.decode_reply(wire.encode_reply(9, "sid1", {"keys": [KEY], "n": 1}))
    assert (r.req_id, r.sid, r.ok, r.result, r.error) == (
        9,
        "sid1",
        True,
        {"keys": [KEY], "n": 1},
        None,
    )


@pytest.mark.parametrize(
    "code, cls",
    [
        ("unknown_namespace", UnknownNamespace),
        ("lease_expired", LeaseExpired),
        ("no_such_code", KVServerError),
    ],
)
def test_error_reply_becomes_a_typed_error(code: str, cls: type) -> None:
    r = wire.decode_reply(wire.encode_error(0, "s", code, "it broke (ns='x')"))
    assert not r.ok and r.req_id == 0
    assert type(r.error) is cls and str(r.error) == "it broke (ns='x')"


@pytest.mark.parametrize(
    "obj",
    [
        [1],
        {"v": 2, "id": 1, "sid": "s", "ok": True, "result": {}},
        {"v": 1, "id": "1", "sid": "s", "ok": True, "result": {}},
        {"v": 1, "id": 1, "sid": "s", "ok": True, "result": []},
        {"v": 1, "id": 1, "sid": "s", "ok": False},
        {"v": 1, "id": 1, "sid": "s", "ok": False, "error": {"code": 1, "message": "m"}},
        {"v": 1, "id": 1, "ok": True, "result": {}},
    ],
)
def test_decode_reply_rejects_malformed_replies(obj: Any) -> None:
    with pytest.raises(InvalidArgument):
        wire.decode_reply(msgpack.packb(obj))


def test_grants_round_trip_with_the_deadline_on_the_receivers_clock() -> None:
    locations = [[((0, 4096),), ((4096, 2048), (65536, 2048))]]
    store = StoreGrant(3, 100.0, "ns", [KEY], locations, [b"p" * 32], [], 2)
    wired = msgpack.unpackb(msgpack.packb(grants.grant_to_wire(store, now=90.0)))
    assert wired["expires_in_s"] == 10.0
    assert grants.store_grant_from_wire(wired, now=5.0) == StoreGrant(
        3, 15.0, "ns", [KEY], locations, [b"p" * 32], [], 2
    )
    load = LoadGrant(4, 100.0, "ns", [KEY], locations)
    wired = msgpack.unpackb(msgpack.packb(grants.grant_to_wire(load, now=99.0)))
    assert "present" not in wired
    assert grants.load_grant_from_wire(wired, now=0.0) == LoadGrant(4, 1.0, "ns", [KEY], locations)
    with pytest.raises(InvalidArgument, match="malformed grant"):
        grants.store_grant_from_wire(wired, now=0.0)  # a load grant lacks store fields
    with pytest.raises(InvalidArgument, match="malformed grant"):
        grants.load_grant_from_wire({"lease_id": 1}, now=0.0)


# ----------------------------------------------------------------------------- framing


def test_event_framing_is_vllms() -> None:
    assert wire.seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert wire.REPLAY_END_SEQ == b"\xff" * 8
    assert wire.event_topic("host:1/ns", "m") == b"kv@host:1/ns@m"


def test_host_id_is_shared_with_the_daemon() -> None:
    from kvserver.daemon import service

    assert service.host_id is wire.host_id
    assert wire.host_id() == wire.host_id() and "/" in wire.host_id()


# ----------------------------------------------------------------------------- properties

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_invalid_argument(frame: bytes) -> None:
    with contextlib.suppress(InvalidArgument):
        wire.parse_request(wire.unpack_header(frame))


@settings(max_examples=300)
@given(
    op=st.sampled_from(sorted(wire.OPS)) | st.text(max_size=10),
    args=st.dictionaries(st.text(max_size=12), msgpack_values, max_size=6) | msgpack_values,
    version=st.sampled_from([1, 1, 1, 2]) | msgpack_values,
)
def test_arbitrary_headers_only_raise_invalid_argument(op: Any, args: Any, version: Any) -> None:
    obj = {"v": version, "id": 1, "op": op, "args": args}
    try:
        req = parse(obj)
    except InvalidArgument:  # UnsupportedVersion is a subclass
        return
    assert req.op in wire.OPS and set(req.args) == set(wire.OPS[req.op])


def test_float_arguments_accept_integers() -> None:
    req = parse(header(op=wire.PIN, args={"ns_id": "n", "keys": [], "ttl_s": 3}))
    assert req.args["ttl_s"] == 3 and not math.isnan(req.args["ttl_s"])


# ----------------------------------------------------------------------------- peek_auth


@pytest.mark.parametrize("op", sorted(wire.OPS))
def test_peek_auth_finds_the_token_clients_send_first(op: str) -> None:
    frame = wire.encode_request(42, op, valid_args(op, optional=True), auth="secret")
    assert wire.peek_auth(frame) == ("secret", 42)  # the id that follows is read too
    assert next(iter(msgpack.unpackb(frame))) == "auth"


@pytest.mark.parametrize(
    "header, expected",
    [
        ({"v": 1, "id": 7, "op": "hello", "auth": "t"}, ("t", 7)),
        ({"v": 1, "id": 7, "args": {}, "auth": "t"}, (None, 7)),  # stops at args
        ({"x": 1, "auth": "t"}, (None, 0)),  # stops at an unknown field
        ({"v": [1, 2], "auth": "t"}, (None, 0)),  # stops at a container
        ({"id": {"a": 1}, "auth": "t"}, (None, 0)),
        ({"auth": 5}, (None, 0)),
        ({"id": -3, "auth": "t"}, ("t", 0)),
        ({"auth": "t", "v": 1, "id": 7, "args": {}}, ("t", 7)),  # clients' order
        ({"auth": "t", "args": {}, "id": 7}, ("t", 0)),  # stops at args
        ({"auth": "t", "id": [7]}, ("t", 0)),  # stops at a container
        ({}, (None, 0)),
    ],
)
def test_peek_auth_reads_only_scalars_before_the_token(
    header: dict[str, Any], expected: tuple[str | None, int]
) -> None:
    assert wire.peek_auth(msgpack.packb(header)) == expected


def test_peek_auth_does_not_decode_a_huge_header() -> None:
    """2^21 keys after the envelope fields: the peek stops at ``args`` and returns the id;
    a huge container before ``auth`` is not decoded either."""
    keys = [b"k" * 4] * (1 << 21)
    frame = msgpack.packb({"v": 1, "id": 9, "op": "lookup", "args": {"keys": keys}, "auth": "t"})
    assert wire.peek_auth(frame) == (None, 9)
    assert wire.peek_auth(msgpack.packb({"v": keys, "auth": "t"})) == (None, 0)


@pytest.mark.parametrize("frame", [b"\xde", b"\xdf", b"\xde\x00"])
def test_peek_auth_on_a_truncated_map_header_is_invalid_argument(frame: bytes) -> None:
    """Regression: b"\\xde" (map16 without its length) raised msgpack's BufferFull."""
    with pytest.raises(InvalidArgument, match="malformed msgpack header"):
        wire.peek_auth(frame)


@given(st.binary(max_size=300))
def test_peek_auth_on_random_bytes_returns_or_raises_invalid_argument(data: bytes) -> None:
    try:
        token, req_id = wire.peek_auth(data)
    except InvalidArgument:
        return
    assert token is None or isinstance(token, str)
    assert 0 <= req_id <= wire.MAX_INT


@pytest.mark.parametrize("op", sorted(wire.OPS))
def test_peek_op_reads_the_op_clients_send(op: str) -> None:
    """The receiver reads the op before the payload frames (``zmq_receive.py``)."""
    assert wire.peek_op(wire.encode_request(42, op, valid_args(op), auth="secret")) == op
    assert wire.peek_op(wire.encode_request(42, op, valid_args(op))) == op


@given(st.binary(max_size=300))
def test_peek_op_on_random_bytes_never_raises(data: bytes) -> None:
    op = wire.peek_op(data)
    assert op is None or isinstance(op, str)
    assert wire.peek_op(b"") is None and wire.peek_op(msgpack.packb({"op": 5})) is None


def test_ints_arguments_are_checked_without_a_python_loop_and_still_refuse_bad_items() -> None:
    ok = wire.check_args(wire.LOOKUP_TOKENS, {"ns_id": "n", "token_ids": list(range(1 << 20))})
    assert len(ok["token_ids"]) == 1 << 20
    for bad in ([1, -1], [1, True], [1, 2.0], [wire.MAX_INT + 1], ["1"]):
        with pytest.raises(InvalidArgument, match="token_ids"):
            wire.check_args(wire.LOOKUP_TOKENS, {"ns_id": "n", "token_ids": bad})


def test_completion_results_round_trip_and_reject_malformed_replies() -> None:
    results = grants.completion_results_from_wire(
        [{"ready": [KEY]}, {"error": {"code": "lease_expired", "message": "gone"}}], 2
    )
    assert results[0] == [KEY] and isinstance(results[1], LeaseExpired)
    for bad, count in (
        (None, 0),
        ([{"ready": [KEY]}], 2),
        ([{"error": {"code": 1, "message": "x"}}], 1),
        (["x"], 1),
    ):
        with pytest.raises(InvalidArgument, match="malformed"):
            grants.completion_results_from_wire(bad, count)


def test_a_request_list_past_65536_items_is_refused_at_its_length_a_reply_list_is_not() -> None:
    """Requests: a longer list is refused before an item is decoded, naming the packed form;
    replies keep the longer bound (a get's part_frames: keys x ranks)."""
    ids = list(range(wire.MAX_ARRAY_LEN + 1))
    frame = wire.encode_request(3, wire.LOOKUP_TOKENS, {"ns_id": "n", "token_ids": ids})
    with pytest.raises(InvalidArgument, match=r"more than 65536 items.*packed"):
        wire.unpack_header(frame)
    ok = wire.encode_request(3, wire.LOOKUP_TOKENS, {"ns_id": "n", "token_ids": ids[:-1]})
    assert parse(wire.unpack_header(ok)).args["token_ids"] == ids[:-1]
    reply = wire.decode_reply(wire.encode_reply(4, "sid", {"part_frames": [1] * (1 << 17)}))
    assert len(reply.result["part_frames"]) == 1 << 17
