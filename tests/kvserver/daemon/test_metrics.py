"""``/metrics`` of a real daemon process, parsed by prometheus_client's own parser.

Values move after real operations (stores, lookups, loads, evictions, write-downs, promotions);
per-tier series carry a ``tier`` label; ``--metrics-port -1`` serves nothing; a port already in
use is logged and the daemon serves without metrics; a bad port is a usage error (exit 2).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvserver.client import KVClient
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import start_daemon, wait_until
from tests.support.metrics import Scrape, convention_faults, scrape

pytestmark = pytest.mark.multiprocess

SPEC = make_spec(model="test/metrics", part_bytes_override=12_000)  # 3 pages: DRAM holds 40
DAEMON_ARGS = ("--page-size", "4KiB", "--dram", "480KiB", "--ssd", "8MiB", "--ssd-admission", "1")

#: every family a daemon with an SSD tier exposes, with its type.
FAMILIES = {
    "kvserver_tier_capacity_bytes": "gauge",
    "kvserver_tier_used_bytes": "gauge",
    "kvserver_tier_pinned_bytes": "gauge",
    "kvserver_tier_reserved_bytes": "gauge",
    "kvserver_tier_entries": "gauge",
    "kvserver_lookups": "counter",
    "kvserver_hits": "counter",
    "kvserver_misses": "counter",
    "kvserver_stores": "counter",
    "kvserver_loads": "counter",
    "kvserver_evictions": "counter",
    "kvserver_promotions": "counter",
    "kvserver_writedowns": "counter",
    "kvserver_corrupt_chunks": "counter",
    "kvserver_io_errors": "counter",
    "kvserver_leases": "gauge",
    "kvserver_leases_expired": "counter",
    "kvserver_ssd_condition": "gauge",  # a state set: one series per condition, 1 or 0
    "kvserver_ssd_spare_bytes": "gauge",
    "kvserver_ssd_freeing_slots": "gauge",
    "kvserver_ssd_released_slots": "counter",
    "kvserver_op_duration_seconds": "histogram",
    "kvserver_build_info": "gauge",
    "kvserver_gc_collections": "counter",
    "kvserver_gc_frozen_objects": "gauge",
    # prometheus_client's process collector: restarts (start time), CPU, memory, descriptors
    "process_start_time_seconds": "gauge",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
}


def dram(s: Scrape, name: str) -> float:
    return s.value(name, tier="dram")


def test_metrics_move_with_real_operations(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, *DAEMON_ARGS, "--ssd-dir", str(tmp_path / "ssd"))
    try:
        with KVClient(d.zmq_address, colocated=False) as kv:
            ns_id = kv.register_namespace(SPEC).ns_id
            wait_until(lambda: kv.stats()["ssd"]["unsaved_namespaces"] == 0)
            before = scrape(d.metrics_url)
            assert dram(before, "kvserver_tier_capacity_bytes") == 480 << 10
            assert before.value("kvserver_tier_capacity_bytes", tier="ssd") > 0
            assert before.value("kvserver_ssd_condition", kvserver_ssd_condition="ok") == 1
            assert before.value("kvserver_ssd_condition", kvserver_ssd_condition="degraded") == 0
            assert dram(before, "kvserver_stores_total") == 0

            keys = make_keys(64, tag="metrics")
            for i in range(0, 64, 8):
                batch = keys[i : i + 8]
                kv.put(ns_id, batch, [pattern(k, 0, SPEC.part_bytes) for k in batch])
            wait_until(lambda: kv.stats()["ssd"]["writes_in_flight"] == 0)
            stored = scrape(d.metrics_url)
            assert dram(stored, "kvserver_stores_total") == 64
            assert kv.lookup(ns_id, keys[-4:]).hit_chunks == 4  # DRAM hits
            assert kv.lookup(ns_id, make_keys(3, tag="absent")).hit_chunks == 0  # misses
            cold = [k for k in keys if kv.lookup(ns_id, [k]).tiers.get("ssd") == 1][:2]
            assert len(cold) == 2
            got = kv.get(ns_id, cold)  # promoted from SSD, then loaded
            assert [bytes(row[0]) for row in got] == [pattern(k, 0, SPEC.part_bytes) for k in cold]
            after = scrape(d.metrics_url)
            kv_stats = kv.stats()  # nothing moves between the two: no write-down in flight

        assert FAMILIES.items() <= after.types.items(), after.types
        assert convention_faults(after, "kvserver") == []
        assert not any(name.endswith("_created") for name in after.names())
        assert dram(after, "kvserver_stores_total") == 64 + 2  # promoted chunks are stored too
        assert dram(after, "kvserver_evictions_total") >= 64 - 40
        assert dram(after, "kvserver_hits_total") > dram(before, "kvserver_hits_total")
        assert dram(after, "kvserver_misses_total") >= 3
        assert dram(after, "kvserver_loads_total") >= 2
        assert 0 < dram(after, "kvserver_tier_entries") <= 40
        assert 0 < dram(after, "kvserver_tier_used_bytes") <= 480 << 10
        written = after.value("kvserver_writedowns_total")
        assert written >= 64 - 40 and after.value("kvserver_stores_total", tier="ssd") == written
        assert after.value("kvserver_tier_entries", tier="ssd") >= 64 - 40
        assert after.value("kvserver_promotions_total") == 2
        assert after.value("kvserver_corrupt_chunks_total") == 0
        assert after.value("kvserver_io_errors_total") == 0
        ssd = kv_stats["ssd"]
        assert after.value("kvserver_ssd_spare_bytes") == ssd["spare_bytes"]
        assert after.value("kvserver_ssd_freeing_slots") == ssd["freeing_slots"]
        assert after.value("kvserver_ssd_released_slots_total") == ssd["released_slots"]
        assert after.value("kvserver_leases") == 0
        # each put of 8 chunks is over half the stream's quota (a quarter of this small DRAM):
        # sent in windows, each a request of its own (kvserver/client/stream_put.py)
        put_requests = after.value("kvserver_stream_client_requests_total") - 1  # the one get
        assert put_requests > 8
        assert after.value("kvserver_op_duration_seconds_count", op="put") == put_requests
        assert after.value("kvserver_op_duration_seconds_count", op="get") == 1
        assert after.value("kvserver_op_duration_seconds_sum", op="put") > 0
        inf = after.value("kvserver_op_duration_seconds_bucket", op="put", le="+Inf")
        assert inf == put_requests
        assert after.value("kvserver_build_info", version=kv_version()) == 1
        # start-up's objects were frozen before the ready file: no collection walks them
        assert after.value("kvserver_gc_frozen_objects") > 10_000
        assert after.value("kvserver_gc_collections_total", generation="2") >= 1
    finally:
        assert d.terminate() == 0, d.log()


def kv_version() -> str:
    from kvserver import __version__

    return __version__


def test_metrics_port_minus_one_serves_nothing(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--metrics-port", "-1")
    try:
        assert d.info["metrics_port"] == -1
        assert "metrics off, DRAM" in d.log()  # the start-up line says the listener is off
    finally:
        assert d.terminate() == 0, d.log()


def test_a_busy_metrics_port_is_logged_and_the_daemon_serves(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = start_daemon(tmp_path, "--metrics-port", str(port))
        try:
            assert d.info["metrics_port"] == -1
            assert f"metrics not served: cannot listen on 127.0.0.1:{port}" in d.log()
            # the start-up line does not say "off" of metrics that were asked for (was)
            assert f"metrics NOT served (127.0.0.1:{port} could not be bound" in d.log()
            with KVClient(d.zmq_address, colocated=False) as kv:
                assert kv.stats()["num_entries"] == 0  # still serving
        finally:
            assert d.terminate() == 0, d.log()


def test_an_out_of_range_metrics_port_is_a_usage_error() -> None:
    cmd = [sys.executable, "-m", "kvserver.cli", "start", "--metrics-port", "70000"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "metrics_port out of range" in result.stderr


def test_scrape_after_shutdown_is_refused(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    url = d.metrics_url
    assert "kvserver_tier_capacity_bytes" in scrape(url).types
    assert d.terminate() == 0, d.log()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
