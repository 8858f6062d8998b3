"""A peer's fetches are timed in ``kvserver_op_duration_seconds{op="peer_fetch"}``, over the
stream port and over ZMQ alike, and not as clients' ``get`` (``docs/metrics.md``).

A real pair of daemons on loopback: A holds the chunks, B names A in ``--peers`` and fetches
them for its clients' loads (over A's stream port, or over ZMQ when A opens none); A's
``/metrics`` parsed by prometheus_client's own parser (``tests/support/metrics.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.client import KVClient
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import start_daemon, wait_until
from tests.support.metrics import Scrape, scrape

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(tp_world_size=2)
LOADS = 3  # B's loads of 2 chunks each: one fetch (window) from A each


def parts(key: bytes) -> list[bytes]:
    return [pattern(key, r, SPEC.part_bytes) for r in range(SPEC.tp_world_size)]


def count(s: Scrape, op: str) -> float:
    """How many requests ``s`` has timed under ``op`` (0 before the first)."""
    return s.samples.get(("kvserver_op_duration_seconds_count", (("op", op),)), 0)


@pytest.mark.parametrize("transport", ["stream", "zmq"])
def test_a_peers_fetches_are_timed_as_peer_fetch_whatever_carries_them(
    tmp_path: Path, transport: str
) -> None:
    """B loads 6 chunks A holds, in 3 loads: A's ``peer_fetch`` count grows by the 3 fetches
    B made (B's ``kvserver_peer_fetches_total``), its sum by their time, and its ``get`` count
    does not move (before: the stream's fetches were not timed at all, ZMQ's were ``get``)."""
    extra = ("--peer-stream-port", "-1") if transport == "zmq" else ()
    a = start_daemon(tmp_path / "a", "--dram", "8MiB", *extra)
    b = None
    try:
        b = start_daemon(tmp_path / "b", "--dram", "8MiB", "--peers", a.zmq_address,
                         "--peer-timeout-s", "30")  # fmt: skip
        keys = make_keys(2 * LOADS, tag="timed")
        with KVClient(a.zmq_address) as kv:
            kv.register_namespace(SPEC)
            assert kv.store(SPEC.ns_id, keys, [parts(k) for k in keys]) == keys
        a_before, b_before = scrape(a.metrics_url), scrape(b.metrics_url)
        with KVClient(b.zmq_address, colocated=False) as kv:
            kv.register_namespace(SPEC)
            for i in range(0, len(keys), 2):
                pair = keys[i : i + 2]
                got = kv.load(SPEC.ns_id, pair)
                assert [[bytes(p) for p in row] for row in got] == [parts(k) for k in pair]
            peer = kv.stats()["peer"]
        assert peer["stream_fetches"] == (LOADS if transport == "stream" else 0)
        fetches = scrape(b.metrics_url).value("kvserver_peer_fetches_total") - b_before.value(
            "kvserver_peer_fetches_total"
        )
        assert fetches == LOADS
        if transport == "stream":  # a reply's time is recorded once it is sent
            sent = "kvserver_peer_stream_sent_chunks_total"
            wait_until(lambda: scrape(a.metrics_url).value(sent) == len(keys), timeout=60)
        a_after = scrape(a.metrics_url)
        assert a_after.types["kvserver_op_duration_seconds"] == "histogram"
        assert count(a_after, "peer_fetch") - count(a_before, "peer_fetch") == fetches
        inf = a_after.value("kvserver_op_duration_seconds_bucket", op="peer_fetch", le="+Inf")
        assert inf == count(a_after, "peer_fetch")
        assert a_after.value("kvserver_op_duration_seconds_sum", op="peer_fetch") > 0
        assert count(a_after, "get") == count(a_before, "get")  # no client's get was made
    finally:
        if b is not None:
            b.kill()
        a.kill()
