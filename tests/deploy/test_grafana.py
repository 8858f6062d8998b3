"""deploy/grafana-dashboard.json parses, and every metric it queries exists in a real scrape of
a daemon (with an SSD tier, joined to a fleet on a real redis-server with a second daemon, its
peer) and of a scheduler (with the kvserver connector) after one request: a renamed metric, the
fleet's and the network tier's included, fails here. ``process_*`` series (restarts) must be in
both processes' scrapes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.scheduler.builders import tokens
from tests.scheduler.procs import EngineClient, start_scheduler
from tests.support.connector import PATIENT_ARGS
from tests.support.daemon import start_daemon, wait_until
from tests.support.metrics import scrape
from tests.support.redis import RedisServer

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
#: the project's own series; every query names one (a bare ``process_*`` query would also
#: match other exporters' targets)
OWN = re.compile(r"\b(?:kvserver|scheduler)_[a-z0-9_]+\b")
#: every series a query names, prometheus_client's standard ``process_*`` ones included
METRIC = re.compile(r"\b(?:kvserver|scheduler|process)_[a-z0-9_]+\b")
#: what the fleet, network-tier and restart panels must keep showing (docs/metrics.md)
COVERED = {
    "kvserver_cluster_condition", "kvserver_cluster_index_losses_total",
    "kvserver_cluster_resyncs_total", "kvserver_cluster_commands_total",
    "kvserver_peer_fetched_chunks_total", "kvserver_peer_fetched_bytes_total",
    "kvserver_peer_failures_total", "kvserver_peer_refused_windows_total",
    "kvserver_peers_suspect", "process_start_time_seconds",
}  # fmt: skip


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and templating queries."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_dashboard_is_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in dashboard["panels"]:
        assert panel["type"] == "row" or panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    assert all(OWN.search(q) for q in queries(dashboard))
    queried = {m for q in queries(dashboard) for m in METRIC.findall(q)}
    assert not COVERED - queried, sorted(COVERED - queried)


@pytest.mark.multiprocess
def test_every_queried_metric_exists_in_a_real_scrape(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = {m for q in queries(dashboard) for m in METRIC.findall(q)}
    fleet = ("--cluster", redis_server.url, "--cluster-timeout-s", "2")
    peer = start_daemon(tmp_path / "peer", "--dram", "4MiB", *fleet, "--host-id", "peer")
    daemon = start_daemon(
        tmp_path / "daemon", "--dram", "16MiB", "--ssd-dir", str(tmp_path / "ssd"),
        "--ssd", "64MiB", *fleet, "--host-id", "daemon",
    )  # fmt: skip
    # joined: the fleet is up and the other daemon is this one's peer
    wait_until(lambda: scrape(daemon.metrics_url).value("kvserver_peers_known") == 1)
    sched = start_scheduler(
        tmp_path,
        "--synthetic-workers", "1", "--num-gpu-blocks", "17", "--block-size", "16",
        "--kvserver", daemon.zmq_address, *PATIENT_ARGS,
    )  # fmt: skip
    try:
        with EngineClient(sched.info["grpc_port"]) as c:
            assert c.generate(tokens(64, 7), 2)
        daemon_scrape = scrape(daemon.metrics_url)
        assert daemon_scrape.value("kvserver_cluster_condition", kvserver_cluster_condition="ok")
        daemon_names = daemon_scrape.names()
        sched_names = scrape(f"http://127.0.0.1:{sched.info['metrics_port']}/metrics").names()
        assert wanted <= daemon_names | sched_names, sorted(wanted - daemon_names - sched_names)
        process = {m for m in wanted if m.startswith("process_")}
        assert process <= daemon_names & sched_names, sorted(process - (daemon_names & sched_names))
        assert sched.terminate() == 0, sched.log()
    finally:
        sched.kill()
        assert daemon.terminate() == 0, daemon.log()
        assert peer.terminate() == 0, peer.log()
