"""The daemon's KV events decoded by vLLM's own classes (``vllm.distributed.kv_events``).

A real daemon with a DRAM and an SSD tier on loopback: chunks stored, evicted from DRAM and
written down to SSD. Every batch published on PUB and every batch replayed from seq 1 must
decode with ``msgspec.msgpack.Decoder(type=KVEventBatch)`` as vLLM's subscribers build it,
with vLLM's medium names (``CPU``, ``STORAGE``) and the llm-d topic ``kv@<pod>@<model>``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.vllm_plugin.vllm_env import require_vllm

require_vllm()

import msgspec  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvserver import wire  # noqa: E402
from kvserver.client import KVClient  # noqa: E402
from tests.kvserver.builders import make_keys, make_spec, pattern  # noqa: E402
from tests.support.daemon import raw_dealer, start_daemon, wait_until  # noqa: E402

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/vllm-events", part_bytes_override=12_000)  # DRAM holds 40 chunks
DAEMON_ARGS = ("--page-size", "4KiB", "--dram", "480KiB", "--ssd", "8MiB", "--ssd-admission", "1")


def test_every_published_and_replayed_batch_decodes_with_vllms_classes(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, *DAEMON_ARGS, "--ssd-dir", str(tmp_path / "ssd"))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, wire.TOPIC_PREFIX.encode())
    sub.connect(d.pub_address)
    replay = raw_dealer(d.zmq_address, ctx=ctx)
    try:
        # over ZMQ: each put of 8 keys is one request (over the stream it passes half this
        # small DRAM's stream quota: windows, whose smaller batches the policy ranks apart)
        with KVClient(d.zmq_address, colocated=False, stream=False) as kv:
            ns_id = kv.register_namespace(SPEC).ns_id
            wait_until(lambda: kv.stats()["ssd"]["unsaved_namespaces"] == 0)
            probes = iter(make_keys(1000, tag="probe"))

            def subscribed() -> bool:  # PUB drops until the subscription has propagated
                key = next(probes)
                kv.put(ns_id, [key], [pattern(key, 0, SPEC.part_bytes)])
                return sub.poll(50) != 0

            wait_until(subscribed)
            keys = make_keys(64, tag="vllm-ev")  # > 40: DRAM evicts, SSD takes the victims
            for i in range(0, len(keys), 8):
                batch = keys[i : i + 8]
                assert kv.put(ns_id, batch, [pattern(k, 0, SPEC.part_bytes) for k in batch])
            wait_until(lambda: kv.stats()["ssd"]["writes_in_flight"] == 0)
            last = kv.stats()["events_last_seq"]

            pod = f"{socket.gethostname()}:{d.info['zmq_port']}"
            live: list[tuple[int, Any]] = []  # every batch from the first one received
            while not live or live[-1][0] < last:
                assert sub.poll(5000), f"no event after seq {live[-1][0] if live else None}"
                topic, seq_b, payload = sub.recv_multipart()
                assert topic == f"kv@{pod}/{ns_id}@test/vllm-events".encode()
                live.append((int.from_bytes(seq_b, "big"), decoder.decode(payload)))
            assert [s for s, _ in live] == list(range(live[0][0], last + 1))  # no gap

            # replay is served on a connection that authenticated (docs/wire.md, Replay)
            replay.send_multipart([wire.encode_request(1, wire.HELLO, {}, auth=d.token)])
            assert replay.poll(5000) and wire.decode_reply(replay.recv_multipart()[0]).ok
            replay.send_multipart([b"", wire.seq_bytes(1)])
            replayed: list[tuple[int, Any]] = []
            while True:
                assert replay.poll(5000)
                _empty, seq_b, payload = replay.recv_multipart()
                if seq_b == wire.REPLAY_END_SEQ:
                    break
                replayed.append((int.from_bytes(seq_b, "big"), decoder.decode(payload)))
            assert [s for s, _ in replayed] == list(range(1, last + 1))
            by_seq = dict(replayed)
            for seq, batch in live:  # the replay says what PUB said (ts is the replay time)
                assert by_seq[seq].events == batch.events

        events = [e for _, batch in replayed for e in batch.events]
        assert all(isinstance(e, BlockStored | BlockRemoved) for e in events)
        stored = {m: [h for e in events if isinstance(e, BlockStored) and e.medium == m
                      for h in e.block_hashes] for m in (MEDIUM_CPU, MEDIUM_STORAGE)}  # fmt: skip
        removed_cpu = [
            h for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU
            for h in e.block_hashes
        ]  # fmt: skip
        assert set(keys) <= set(stored[MEDIUM_CPU])  # every chunk was stored in DRAM
        assert set(keys[:8]) <= set(removed_cpu)  # the oldest left DRAM...
        assert set(keys[:8]) <= set(stored[MEDIUM_STORAGE])  # ...and were written down to SSD
        assert {e.block_size for e in events if isinstance(e, BlockStored)} == {SPEC.chunk_tokens}
    finally:
        sub.close()
        replay.close()
        assert d.terminate() == 0, d.log()
