"""The stream port's counters keep peers' fetches and clients' ``put``/``get`` apart
(``docs/metrics.md``: ``kvserver_peer_stream_*`` and ``kvserver_stream_client_*``).

A real ``kvserver start`` on loopback; a real remote client's put and get over its stream
port, then a real fetch by the network tier's own classes (as in ``test_stream.py``), with
``/metrics`` parsed by prometheus_client and ``stats()["peer_stream"]`` read after each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver import wire
from kvserver.client import KVClient
from tests.kvserver.builders import make_keys
from tests.kvserver.daemon.peers.test_fetch import SPEC, engine_b, expected, held_bytes
from tests.kvserver.daemon.peers.test_stream import fetcher, recorded_peer
from tests.support.daemon import DaemonProc, start_daemon, wait_until
from tests.support.metrics import Scrape, scrape

pytestmark = pytest.mark.multiprocess

TOKEN = "stream-counters-token-0123456789"
KEYS = make_keys(4, tag="counted")
PEERS = ("requests", "sent_chunks", "sent_bytes", "errors")
CLIENTS = tuple(f"client_{name}" for name in (*PEERS, "received_chunks", "received_bytes"))
#: ``stats()["peer_stream"]`` key -> its /metrics sample
SAMPLES = {
    **{name: f"kvserver_peer_stream_{name}_total" for name in PEERS},
    **{name: f"kvserver_stream_{name}_total" for name in CLIENTS},
}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "a", "--dram", "8MiB", "--auth-token", TOKEN)
    try:
        yield d
    finally:
        d.kill()


def counted(d: DaemonProc) -> tuple[dict[str, int], Scrape]:
    """The stream's counters from ``stats()`` (over ZMQ) and a scrape of ``/metrics``, once
    no stream connection is open (the client's and the fetcher's have closed)."""
    open_now = "kvserver_peer_stream_open_connections"
    wait_until(lambda: scrape(d.metrics_url).value(open_now) == 0)
    with KVClient(d.zmq_address, colocated=False, auth_token=TOKEN, stream=False) as kv:
        stats = kv.stats()["peer_stream"]
    return {name: stats[name] for name in SAMPLES}, scrape(d.metrics_url)


def moved(before: tuple[dict[str, int], Scrape], after: tuple[dict[str, int], Scrape]
          ) -> dict[str, int]:  # fmt: skip
    """The counters that moved (``stats()`` and ``/metrics`` agreeing on each)."""
    out = {}
    for name, sample in SAMPLES.items():
        delta = after[0][name] - before[0][name]
        assert after[1].value(sample) - before[1].value(sample) == delta, name
        if delta:
            out[name] = delta
    return out


async def test_a_clients_ops_and_a_peers_fetch_move_only_their_own_counters(
    daemon: DaemonProc,
) -> None:
    chunk_bytes = 2 * SPEC.part_bytes
    first = counted(daemon)
    assert first[1].types["kvserver_stream_client_sent_bytes"] == "counter"
    with KVClient(daemon.zmq_address, colocated=False, auth_token=TOKEN, stream=True) as kv:
        kv.register_namespace(SPEC)
        assert kv.put(SPEC.ns_id, KEYS, expected(KEYS)).stored == KEYS
        got = kv.get(SPEC.ns_id, KEYS[:3])
        assert [[bytes(p) for p in row] for row in got] == expected(KEYS[:3])
        assert kv.sent_by_op[wire.PUT] == 0 and kv.sent_by_op[wire.GET] == 0  # the stream's
    second = counted(daemon)
    assert moved(first, second) == {
        "client_requests": 2,
        "client_received_chunks": 4, "client_received_bytes": 4 * chunk_bytes,
        "client_sent_chunks": 3, "client_sent_bytes": 3 * chunk_bytes,
    }  # fmt: skip

    with engine_b() as engine:
        fetches, book = fetcher(engine, auth_token=TOKEN)
        holders = frozenset({"A"})
        await fetches.fetch(SPEC, [(k, holders) for k in KEYS], {"A": recorded_peer(daemon)})
        await book.close()
        assert held_bytes(engine, KEYS) == expected(KEYS)
        assert book.counters.stream_fetches == 1
    third = counted(daemon)
    assert moved(second, third) == {
        "requests": 1, "sent_chunks": 4, "sent_bytes": 4 * chunk_bytes,
    }  # fmt: skip
