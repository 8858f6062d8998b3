"""A real daemon flooded with unauthenticated 2^21-key requests (12 MB headers) on its ZMQ
ROUTER by a peer admitted at the handshake (it presented a valid token there, as a tenant's
client does, but its requests carry none: the per-request check is defence in depth; a peer
without a token never gets past the handshake, ``test_handshake_auth.py``): the flooding
connection gets clear ``unauthenticated`` errors — the first at once (as
many as the per-connection and daemon-wide allowances take), later ones held back and sent in
order, none past the bound on held replies (``kvserver/daemon/refusals.py``) — while an
authenticated client on another connection is served correctly throughout, and a valid token on
the flooding connection is served at once. Behaviour and the daemon's ``refusals`` counters are
checked, not timings."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from kvserver import wire
from kvserver.client import KVClient
from kvserver.daemon.refusals import MAX_HELD_PER_CONNECTION, REFUSAL_BURST, REFUSED_BYTES_BURST
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import raw_dealer, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/flood")
KEYS = 1 << 21
#: a 2^21-key lookup's ``args``, packed once (~12 MB)
ARGS: bytes = msgpack.packb({"ns_id": "x", "keys": [b"k" * 4] * KEYS})


def big_request(rid: int) -> bytes:
    """An unauthenticated 2^21-key lookup with id ``rid``: the header is the ~12 MB ``ARGS``
    behind four fields (packed by hand, so that the list is packed only once)."""
    head: bytes = msgpack.packb({"v": 1, "id": rid, "op": wire.LOOKUP})
    key: bytes = msgpack.packb("args")
    assert head[0] == 0x83  # a fixmap of 3: make it 4, and append args
    return b"\x84" + head[1:] + key + ARGS


def parts(keys: list[bytes]) -> list[list[bytes]]:
    return [[pattern(k, 0, SPEC.part_bytes)] for k in keys]


def test_an_unauthenticated_flood_is_throttled_while_others_are_served(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--auth-token", "s3cret")
    flood = raw_dealer(d.zmq_address)  # admitted at the handshake; its requests carry no token

    def replies(n: int) -> list[wire.Reply]:
        out = []
        for _ in range(n):
            assert flood.poll(30_000), "no reply to the flooding connection"
            out.append(wire.decode_reply(flood.recv_multipart()[0]))
        return out

    try:
        sent = REFUSAL_BURST + MAX_HELD_PER_CONNECTION + 2  # 2 past the bound: no reply
        frames = [big_request(rid) for rid in range(1, sent + 1)]
        for frame in frames:  # pipelined: the DEALER queues them, they stream in meanwhile
            flood.send(frame, copy=False)

        with KVClient(d.zmq_address, auth_token="s3cret", colocated=False) as kv:
            ns = kv.register_namespace(SPEC)
            keys = make_keys(4, tag="flood")
            assert kv.store(ns.ns_id, keys, parts(keys)) == keys
            assert kv.lookup(ns.ns_id, keys).hit_chunks == len(keys)
            got = kv.load(ns.ns_id, keys)
            assert [[bytes(p) for p in row] for row in got] == parts(keys)

            wait_until(lambda: kv.stats()["refusals"]["refused"] == sent, timeout=120)
            counts = kv.stats()["refusals"]
            at_once = sent - counts["held_back"] - counts["dropped"]
            # the daemon-wide allowance of refused bytes is what ends the burst here
            assert 1 <= at_once <= min(REFUSAL_BURST, REFUSED_BYTES_BURST // len(frames[0]) + 1)
            assert counts["held_back"] == MAX_HELD_PER_CONNECTION
            assert counts["dropped"] == sent - at_once - MAX_HELD_PER_CONNECTION >= 2

            # those were answered at once, in order, each with its id and a clear error; once
            # one is held back, every later one is held or dropped, so they come first
            burst = replies(at_once)
            assert [r.req_id for r in burst] == list(range(1, at_once + 1))
            for reply in burst:
                assert reply.error is not None and reply.error.code == "unauthenticated"
                assert "token" in str(reply.error)

            # a valid token on the flooding connection is served at once (before the held
            # error replies, which come one per second after the burst)
            flood.send(wire.encode_request(999, wire.HELLO, {}, auth="s3cret"))
            held_first = None
            while True:
                (reply,) = replies(1)
                if reply.req_id == 999:
                    assert reply.ok
                    break
                held_first = reply  # one held reply may have come due meanwhile
            if held_first is None:
                (held_first,) = replies(1)
            assert held_first.req_id == at_once + 1
            assert held_first.error is not None and held_first.error.code == "unauthenticated"

            # the daemon still serves the authenticated client, byte for byte
            more = make_keys(2, tag="flood-after")
            assert kv.store(ns.ns_id, more, parts(more)) == more
            got = kv.load(ns.ns_id, keys + more)
            assert [[bytes(p) for p in row] for row in got] == parts(keys + more)
    finally:
        flood.close()
        assert d.terminate() == 0
