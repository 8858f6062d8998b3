"""Fuzzing every message type against the real daemon process, on both of its data-plane
sockets: the ZMQ ROUTER and the local channel (Unix socket, ``docs/wire.md`` §1).

Malformed msgpack, wrong types, missing fields, unknown ops, wrong protocol versions, truncated
and oversized frames, payloads that do not match the slot, and (local channel) broken framing:
each gets exactly one error reply with a clear code (never ``internal``), and every test ends
with a byte-exact round trip by a well-behaved client. "Exactly one reply" is checked without
waiting for silence: each fuzzed message is followed by a sentinel ``hello`` on the same
connection, whose reply must come second.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver import prompts, wire, wire_events, wire_local
from kvserver.client import KVClient
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.kvserver.daemon.local_conn import LocalConn
from tests.support.daemon import DaemonProc, raw_dealer, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

LIMIT = 1 << 20  # the fuzzed daemon's max_message_bytes
SENTINEL = wire.MAX_INT
SPEC = make_spec(model="test/fuzz", tp_world_size=2)
ERROR_CODES = {
    "invalid_argument",
    "unsupported_version",
    "unknown_namespace",
    "unknown_key",
    "lease_error",
    "lease_expired",
    "invalid_state",
    "capacity",
    "unauthenticated",
}
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Fuzzed:
    """The module's daemon, a registered namespace, and one raw connection: a DEALER socket
    (``transport`` "zmq") or a local-channel connection ("local")."""

    def __init__(self, daemon: DaemonProc, *, auth_token: str = "", transport: str = "zmq") -> None:
        self.daemon = daemon
        self.transport = transport
        self.ctx = zmq.Context.instance()
        self.keys = make_keys(4, tag="fuzz-ready")
        with KVClient(daemon.zmq_address, auth_token=auth_token) as kv:
            self.ns = kv.register_namespace(SPEC)
            kv.store(self.ns.ns_id, self.keys, parts(self.keys))
            self.local_path = str(kv.hello()["local_path"])
        self.sock = self.new_socket()

    def new_socket(self) -> Any:
        if self.transport == "local":
            return LocalConn(self.local_path)
        return raw_dealer(self.daemon.zmq_address, ctx=self.ctx)

    def recv(self) -> list[bytes]:
        assert self.sock.poll(10_000), "no reply from the daemon"
        return list(self.sock.recv_multipart())

    def exchange(self, frames: list[bytes]) -> tuple[wire.Reply, list[bytes]]:
        """Send ``frames`` then a sentinel; returns the one reply to ``frames``."""
        self.sock.send_multipart(frames)
        self.sock.send_multipart([wire.encode_request(SENTINEL, wire.HELLO, {})])
        first = self.recv()
        reply = wire.decode_reply(first[0])
        assert reply.req_id != SENTINEL, "the fuzzed message got no reply"
        second = wire.decode_reply(self.recv()[0])
        assert second.req_id == SENTINEL and second.ok, "more than one reply, or none"
        if not reply.ok:
            assert reply.error is not None and reply.error.code in ERROR_CODES, reply.error
            assert str(reply.error)
        return reply, first[1:]

    def error(self, frames: list[bytes], code: str, match: str = "") -> wire.Reply:
        reply, _ = self.exchange(frames)
        assert not reply.ok and reply.error is not None
        assert reply.error.code == code, reply.error
        assert match in str(reply.error)
        return reply

    def close(self) -> None:
        self.sock.close()


def parts(keys: list[bytes]) -> list[list[bytes]]:
    return [[pattern(k, r, SPEC.part_bytes) for r in range(2)] for k in keys]


def fuzzed_daemon(
    tmp_path_factory: pytest.TempPathFactory, transport: str, name: str
) -> Iterator[Fuzzed]:
    """A daemon (4 KiB pages, 8 MiB DRAM, ``max_message_bytes`` LIMIT, --no-auth) reached over
    ``transport``, for a module's ``fz`` fixture; after the module it must still be alive and
    stop cleanly. --no-auth: the fuzzed headers reach the parser (with a token required they
    would stop at the token check; that path is fuzzed by test_wrong_auth_tokens_are_refused)."""
    d = start_daemon(
        tmp_path_factory.mktemp(name),
        "--page-size",
        "4KiB",
        "--dram",
        "8MiB",
        "--no-auth",
        env={"KVSERVER_MAX_MESSAGE_BYTES": str(LIMIT)},
    )
    fuzzed = Fuzzed(d, transport=transport)
    yield fuzzed
    fuzzed.close()
    assert d.proc.poll() is None, f"the daemon died ({name})"
    assert d.terminate() == 0, d.log()[-3000:]


@pytest.fixture(scope="module", params=["zmq", "local"])
def fz(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fuzzed]:
    yield from fuzzed_daemon(tmp_path_factory, request.param, "fuzz")


def assert_round_trip(fz: Fuzzed, tag: str) -> None:
    """A well-behaved client still gets byte-exact service on both data paths."""
    for colocated in (True, False):
        keys = make_keys(3, tag=f"{tag}-{colocated}")
        with KVClient(fz.daemon.zmq_address, colocated=colocated) as kv:
            assert kv.store(fz.ns.ns_id, keys, parts(keys)) == keys
            got = kv.load(fz.ns.ns_id, keys)
            assert [[bytes(p) for p in row] for row in got] == parts(keys)
            assert [[bytes(p) for p in row] for row in kv.get(fz.ns.ns_id, keys)] == parts(keys)


def req(op: str, args: Any, *, rid: int = 7, **envelope: Any) -> bytes:
    return msgpack.packb({"v": 1, "id": rid, "op": op, "args": args, **envelope})


# ----------------------------------------------------------------------------- strategies

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def op_args(draw: st.DrawFn, fz: Fuzzed) -> tuple[str, dict[str, Any]]:
    """An op with arguments that are often right (a real ns_id, real keys) and often not."""
    op = draw(st.sampled_from(sorted(wire.OPS)))
    good = {
        "str": st.just(fz.ns.ns_id),
        "keys": st.lists(
            st.sampled_from(fz.keys) | st.binary(min_size=32, max_size=32), max_size=3
        ),
        "int": st.integers(0, 3) | st.integers(0, 2000),
        "ints": st.lists(st.integers(0, 2), max_size=3),
        "token_ids": st.lists(st.integers(0, 2), max_size=40)
        | st.binary(max_size=40),  # packed, whole ids or not
        "float": st.floats(0.05, 2.0),
        "bool": st.booleans(),
        "map": st.just(SPEC.to_dict()) | st.dictionaries(st.text(max_size=12), values, max_size=4),
        "str_pair": st.just(["a", "b"]),
        "completions": st.lists(
            st.tuples(
                st.integers(0, 2000),
                st.booleans(),
                st.none() | st.lists(st.integers(0, 2), max_size=2),
                st.none() | st.lists(st.sampled_from(fz.keys), max_size=2),
            ).map(list),
            max_size=3,
        ),
    }
    schema = wire.OPS[op]
    args = {
        name: draw(good[kind])
        for name, (kind, required) in schema.items()
        if required or draw(st.booleans())
    }
    mode = draw(st.sampled_from(["valid", "one-wrong", "one-wrong", "missing", "random"]))
    if mode == "one-wrong" and schema:
        args[draw(st.sampled_from(sorted(schema)))] = draw(values)
    elif mode == "missing" and args:
        del args[draw(st.sampled_from(sorted(args)))]
    elif mode == "random":
        args = draw(st.dictionaries(st.sampled_from([*schema, "bogus"]), values, max_size=5))
    return op, args


# ----------------------------------------------------------------------------- header fuzzing


def test_fuzz_garbage_header_frames(fz: Fuzzed) -> None:
    @FUZZ
    @given(st.binary(min_size=1, max_size=300))
    def check(frame: bytes) -> None:
        fz.exchange([frame])

    check()
    fz.error([b""], "invalid_argument", "empty header frame")
    fz.error([b"\xc1"], "invalid_argument", "malformed msgpack")
    fz.error([msgpack.packb([1, 2])], "invalid_argument", "must be a msgpack map")
    assert_round_trip(fz, "garbage")


def test_fuzz_envelope_fields_of_wrong_types(fz: Fuzzed) -> None:
    @FUZZ
    @given(
        st.dictionaries(
            st.sampled_from(["v", "id", "op", "args", "auth", "client", "x"]), values, max_size=6
        )
    )
    def check(header: dict[str, Any]) -> None:
        fz.exchange([msgpack.packb(header)])

    check()
    reply = fz.error([req(wire.HELLO, {}, rid=9, client="")], "invalid_argument", "'client'")
    assert reply.req_id == 9  # the id is echoed whenever it is readable
    fz.error([msgpack.packb({"v": 1, "op": "hello"})], "invalid_argument", "'id'")
    assert_round_trip(fz, "envelope")


def test_fuzz_wrong_protocol_versions(fz: Fuzzed) -> None:
    @FUZZ
    @given(st.integers(-(1 << 63), (1 << 64) - 1).filter(lambda v: v != 1))
    def check(version: int) -> None:
        frame = msgpack.packb({"v": version, "id": 11, "op": "hello", "args": {}})
        reply = fz.error([frame], "unsupported_version", "not supported")
        assert reply.req_id == 11

    check()
    assert_round_trip(fz, "version")


def test_fuzz_unknown_ops(fz: Fuzzed) -> None:
    @FUZZ
    @given(st.text(max_size=30).filter(lambda op: op not in wire.OPS))
    def check(op: str) -> None:
        fz.error([req(op, {})], "invalid_argument", "unknown op")

    check()
    assert_round_trip(fz, "ops")


def test_fuzz_arguments_of_every_op(fz: Fuzzed) -> None:
    """Wrong types, missing fields, unknown fields, and valid calls mixed in."""

    @settings(FUZZ, max_examples=600)
    @given(op_args(fz))
    def check(case: tuple[str, dict[str, Any]]) -> None:
        op, args = case
        frames = [req(op, args, client="fuzzer")]
        if op in wire.OPS_WITH_PAYLOAD:
            keys = args.get("keys")
            frames += [bytes(SPEC.part_bytes)] * (len(keys) if isinstance(keys, list) else 1)
        fz.exchange(frames)

    check()
    fz.error(
        [req(wire.LOOKUP, {"ns_id": fz.ns.ns_id})],
        "invalid_argument",
        "missing required argument 'keys'",
    )
    fz.error(
        [req(wire.LOOKUP, {"ns_id": fz.ns.ns_id, "keys": "abc"})],
        "invalid_argument",
        "argument 'keys' must be",
    )
    fz.error([req(wire.LOOKUP, {"ns_id": "nope", "keys": []})], "unknown_namespace")
    for bad in (
        "abc",
        [[1, True, None]],  # three fields
        [[1, "yes", None, None]],  # success not a bool
        [[-1, True, None, None]],  # lease id out of range
        [[1, True, [-2], None]],  # ranks
        [[1, True, None, ["key"]]],  # keys not bin
        [{"lease_id": 1}],  # a map, not a list
        [[1, True, None, None]] * (wire.MAX_COMPLETIONS + 1),
    ):
        args = {"ns_id": fz.ns.ns_id, "keys": [], "completions": bad}
        fz.error(
            [req(wire.PREPARE_STORE, args)],
            "invalid_argument",
            "argument 'completions' must be a list of at most",
        )
    for bad in (1, "yes", [True], {"packed": True}):  # the packed grant's flag: a boolean
        args = {"ns_id": fz.ns.ns_id, "keys": [], "packed": bad}
        fz.error([req(wire.PREPARE_STORE, args)], "invalid_argument", "argument 'packed' must be")
    fz.error([req(wire.GET, {"ns_id": fz.ns.ns_id, "keys": [bytes(32)]})], "unknown_key")
    with KVClient(fz.daemon.zmq_address, client_id="fuzzer") as kv:
        kv.release()  # the fuzzer's reservations and pins
        assert_round_trip(fz, "args")
        wait_until(lambda: kv.stats()["reserved_pages"] == 0)


def test_fuzz_truncated_requests(fz: Fuzzed) -> None:
    full = req(
        wire.PREPARE_STORE, {"ns_id": fz.ns.ns_id, "keys": make_keys(3, tag="t"), "lease_s": 5.0}
    )

    @FUZZ
    @given(st.integers(1, len(full) - 1))
    def check(cut: int) -> None:
        reply = fz.error([full[:cut]], "invalid_argument", "malformed msgpack")
        assert reply.req_id == 0

    check()
    assert_round_trip(fz, "truncated")


def test_fuzz_replay_requests(fz: Fuzzed) -> None:
    """[b"", 8 bytes] is vLLM's replay request: answered by batches and the end marker (on
    the ROUTER; on the local channel it is a message with an empty header, an error)."""
    if fz.transport == "local":
        fz.error([b"", bytes(8)], "invalid_argument", "empty header frame")
        assert_round_trip(fz, "replay")
        return

    @FUZZ
    @given(st.binary(min_size=8, max_size=8))
    def check(start: bytes) -> None:
        fz.sock.send_multipart([b"", start])
        while True:
            empty, seq, payload = fz.recv()
            assert empty == b""
            if seq == wire.REPLAY_END_SEQ:
                break
            assert int.from_bytes(seq, "big") >= int.from_bytes(start, "big")
            wire_events.decode_batch(payload)

    check()
    fz.error([b"", b"1234567"], "invalid_argument")  # 7 bytes: not a replay request
    assert_round_trip(fz, "replay")


# ----------------------------------------------------------------------------- payload frames


def test_payloads_that_do_not_match_the_slot(fz: Fuzzed) -> None:
    keys = make_keys(2, tag="mismatch")
    put = req(wire.PUT, {"ns_id": fz.ns.ns_id, "keys": keys})
    part = bytes(SPEC.part_bytes)

    @FUZZ
    @given(st.lists(st.integers(0, 3 * SPEC.part_bytes), max_size=6))
    def check(sizes: list[int]) -> None:
        if sizes == [SPEC.part_bytes] * 4:
            return
        fz.error([put, *(bytes(n) for n in sizes)], "invalid_argument", "payload")

    check()
    fz.error([put, part, part, part], "invalid_argument", "wrong number of payload frames")
    fz.error(
        [put, part, part, part, part + b"x"],
        "invalid_argument",
        "payload size does not match the slot",
    )
    fz.error([req(wire.STATS, {}), b"extra"], "invalid_argument", "takes no payload frames")
    # write_parts into a real reservation: a wrong-sized part is refused, nothing completes
    reply, _ = fz.exchange(
        [req(wire.PREPARE_STORE, {"ns_id": fz.ns.ns_id, "keys": keys}, client="mismatch")]
    )
    lease = reply.result["grant"]["lease_id"]
    fz.error(
        [
            req(wire.WRITE_PARTS, {"lease_id": lease, "keys": keys, "rank": 0}, client="mismatch"),
            part,
            part[:-1],
        ],
        "invalid_argument",
        "payload size",
    )
    fz.error(
        [
            req(wire.WRITE_PARTS, {"lease_id": lease, "keys": keys, "rank": 5}, client="mismatch"),
            part,
            part,
        ],
        "invalid_argument",
        "rank out of range",
    )
    fz.error(
        [req(wire.WRITE_PARTS, {"lease_id": lease, "keys": keys, "rank": 0}), part],
        "invalid_argument",
        "wrong number of payload frames",
    )
    reply, _ = fz.exchange([req(wire.LOOKUP, {"ns_id": fz.ns.ns_id, "keys": keys})])
    assert reply.result["hit_chunks"] == 0
    reply, _ = fz.exchange([req(wire.RELEASE, {}, client="mismatch")])
    assert reply.result["released"] == 1
    with KVClient(fz.daemon.zmq_address) as kv:
        assert kv.stats()["reserved_pages"] == 0
    assert_round_trip(fz, "mismatch")


def test_oversized_messages(fz: Fuzzed) -> None:
    """Over max_message_bytes in total, each frame under it: ZMQ takes the message whole (its
    MAXMSGSIZE bounds frames, not messages) and the daemon answers "message too large". One
    frame over it: ZMQ drops that connection (the frame is never buffered); the peer
    reconnects and is served again. (The local channel: its size prefix,
    ``test_local_message_over_the_limit_closes_the_connection``.)"""
    half = bytes(LIMIT // 2 + 1)
    fz.error([req(wire.STATS, {}), half, half], "invalid_argument", "message too large")
    if fz.transport == "local":
        assert_round_trip(fz, "oversized")
        return
    sock = fz.new_socket()
    try:
        sock.send_multipart([req(wire.STATS, {}), bytes(LIMIT + 1)])
        sock.send_multipart([req(wire.HELLO, {}, rid=5)])  # lost with the dropped connection

        def served_again() -> bool:
            sock.send_multipart([req(wire.HELLO, {}, rid=6)])
            while sock.poll(200):
                if wire.decode_reply(sock.recv_multipart()[0]).req_id == 6:
                    return True
            return False

        wait_until(served_again, timeout=20)
    finally:
        sock.close()
    assert_round_trip(fz, "oversized")


@pytest.mark.parametrize("transport", ["zmq", "local"])
def test_wrong_auth_tokens_are_refused(tmp_path: Path, transport: str) -> None:
    d = start_daemon(tmp_path, "--auth-token", "s3cret")
    fuzzed = Fuzzed(d, auth_token="s3cret", transport=transport)
    try:

        @FUZZ
        @given(st.none() | st.text(max_size=12).filter(lambda t: t != "s3cret"))
        def check(token: str | None) -> None:
            if transport == "zmq":  # a new connection: past a burst, one connection's refusals
                fuzzed.sock.close()  # are answered once a second (test_unauthenticated_flood)
                fuzzed.sock = fuzzed.new_socket()
            frame = req(wire.HELLO, {}, auth=token) if token is not None else req(wire.HELLO, {})
            fuzzed.sock.send_multipart([frame])
            reply = wire.decode_reply(fuzzed.recv()[0])
            assert not reply.ok and reply.error is not None
            assert reply.error.code == "unauthenticated"

        check()
        with KVClient(d.zmq_address, auth_token="s3cret") as kv:
            keys = make_keys(2, tag="auth")
            assert kv.store(fuzzed.ns.ns_id, keys, parts(keys)) == keys
            assert [[bytes(p) for p in r] for r in kv.load(fuzzed.ns.ns_id, keys)] == parts(keys)
    finally:
        fuzzed.close()
        assert d.terminate() == 0


# ----------------------------------------------------------------------------- local framing


#: the module's daemon, through its local channel only.
LOCAL = pytest.mark.parametrize("fz", ["local"], indirect=True)


@LOCAL
def test_fuzz_local_framing(fz: Fuzzed) -> None:
    """Any body under a size the daemon accepts: a frame count and lengths that do not add up
    are one error reply (request id 0) and the stream goes on with the next message."""
    conn: LocalConn = fz.sock

    @FUZZ
    @given(st.binary(max_size=64))
    def check(body: bytes) -> None:
        conn.send_raw(wire_local.SIZE.pack(len(body)) + body)
        fz.sock.send_multipart([wire.encode_request(SENTINEL, wire.HELLO, {})])
        first = wire.decode_reply(fz.recv()[0])
        if first.req_id != SENTINEL:  # the body was answered first (an error, or a reply)
            if not first.ok:
                assert first.error is not None and first.error.code in ERROR_CODES
            first = wire.decode_reply(fz.recv()[0])
        assert first.req_id == SENTINEL and first.ok

    check()
    for body, match in (
        (b"", "too short"),
        (wire_local.COUNT.pack(0), "bad frame count"),
        (wire_local.COUNT.pack(2) + bytes(8), "bad frame count"),
        (wire_local.COUNT.pack(1) + wire_local.SIZE.pack(5) + b"abc", "do not add up"),
    ):
        conn.send_raw(wire_local.SIZE.pack(len(body)) + body)
        reply = wire.decode_reply(fz.recv()[0])
        assert not reply.ok and reply.req_id == 0 and reply.error is not None
        assert reply.error.code == "invalid_argument" and match in str(reply.error)
    assert_round_trip(fz, "framing")


@LOCAL
def test_local_message_over_the_limit_closes_the_connection(fz: Fuzzed) -> None:
    """A size field over the limit cannot be skipped on a stream: one error reply, then the
    daemon closes that connection; a new one is served."""
    conn = fz.new_socket()
    try:
        conn.send_raw(wire_local.SIZE.pack(wire_local.max_size(LIMIT) + 1))
        reply = wire.decode_reply(conn.recv_multipart()[0])
        assert not reply.ok and reply.req_id == 0 and reply.error is not None
        assert reply.error.code == "invalid_argument" and "too large" in str(reply.error)
        assert conn.closed_by_peer()
    finally:
        conn.close()
    assert_round_trip(fz, "local-oversized")


@LOCAL
def test_local_truncated_message_then_close(fz: Fuzzed) -> None:
    """A connection that dies mid-message (size sent, body cut short) costs nothing."""
    full = b"".join(wire_local.encode([req(wire.STATS, {}), bytes(5000)]))
    for cut in (3, 8, 12, 30, len(full) - 1):
        conn = fz.new_socket()
        conn.send_raw(full[:cut])
        conn.close()
    assert_round_trip(fz, "local-truncated")


def test_local_socket_is_private_and_removed_at_exit(tmp_path: Path) -> None:
    """0600 next to the arena (only the daemon's user can connect, as only it can map the
    arena), announced by hello with its framing version, gone once the daemon stops."""
    d = start_daemon(tmp_path)
    try:
        with KVClient(d.zmq_address) as kv:
            info = kv.hello()
            kv.stats()  # the first call after hello connects the local channel
            assert kv.is_local
        path = info["local_path"]
        assert path == f"{info['arena_path']}.sock"
        assert info["local_version"] == wire_local.LOCAL_VERSION
        st_mode = Path(path).stat().st_mode
        assert stat.S_ISSOCK(st_mode) and stat.S_IMODE(st_mode) == 0o600
    finally:
        assert d.terminate() == 0
    assert not Path(path).exists()


def test_no_work_before_authentication(tmp_path: Path) -> None:
    """With a token: a 2^21-key request without it is refused as unauthenticated, answered
    with its id; a replay request on a connection that never authenticated is refused, and
    served once that connection sent an authenticated request; an authenticated 1M-token
    lookup (validated off the loop) is answered, and a small request behind it on the same
    connection comes after it."""
    d = start_daemon(tmp_path, "--auth-token", "s3cret")
    sock = raw_dealer(d.zmq_address)

    def recv() -> list[bytes]:
        assert sock.poll(30_000), "no reply from the daemon"
        return list(sock.recv_multipart())

    try:
        with KVClient(d.zmq_address, auth_token="s3cret") as kv:
            ns = kv.register_namespace(SPEC)
        keys = [b"k" * 4] * (1 << 21)
        sock.send_multipart([req(wire.LOOKUP, {"ns_id": ns.ns_id, "keys": keys}, rid=99)])
        reply = wire.decode_reply(recv()[0])
        assert reply.req_id == 99 and reply.error is not None
        assert reply.error.code == "unauthenticated"

        sock.send_multipart([b"", wire.seq_bytes(1)])
        reply = wire.decode_reply(recv()[0])
        assert reply.error is not None and reply.error.code == "unauthenticated"

        sock.send_multipart([wire.encode_request(5, wire.HELLO, {}, auth="s3cret")])
        assert wire.decode_reply(recv()[0]).ok
        sock.send_multipart([b"", wire.seq_bytes(1)])
        frames = recv()
        while frames[1] != wire.REPLAY_END_SEQ:
            frames = recv()
        assert frames[0] == b""

        tokens = list(range(1 << 20))
        big = {"ns_id": ns.ns_id, "token_ids": prompts.pack_token_ids(tokens)}
        as_list = {"ns_id": ns.ns_id, "token_ids": tokens}  # past 65,536 ids: refused
        sock.send_multipart([wire.encode_request(6, wire.LOOKUP_TOKENS, big, auth="s3cret")])
        sock.send_multipart([wire.encode_request(7, wire.LOOKUP_TOKENS, as_list, auth="s3cret")])
        sock.send_multipart([wire.encode_request(8, wire.HELLO, {}, auth="s3cret")])
        replies = [wire.decode_reply(recv()[0]) for _ in range(3)]
        assert [r.req_id for r in replies] == [6, 7, 8]
        assert replies[0].ok and replies[0].result["num_chunks"] == len(tokens) // SPEC.chunk_tokens
        assert replies[1].error is not None and "packed" in str(replies[1].error)
        assert replies[2].ok
    finally:
        sock.close()
        assert d.terminate() == 0
