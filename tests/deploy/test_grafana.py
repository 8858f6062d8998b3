"""deploy/grafana-dashboard.json parses, and every metric it queries exists in a real scrape of
a daemon (with an SSD tier) and of a scheduler (with the kvserver connector) after one request."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.scheduler.builders import tokens
from tests.scheduler.procs import EngineClient, start_scheduler
from tests.support.daemon import start_daemon
from tests.support.metrics import scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(?:kvserver|scheduler)_[a-z0-9_]+\b")


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
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    assert all(METRIC.search(q) for q in queries(dashboard))


@pytest.mark.multiprocess
def test_every_queried_metric_exists_in_a_real_scrape(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = {m for q in queries(dashboard) for m in METRIC.findall(q)}
    daemon = start_daemon(
        tmp_path / "daemon", "--dram", "16MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd", "64MiB"
    )
    sched = start_scheduler(
        tmp_path,
        "--synthetic-workers", "1", "--num-gpu-blocks", "17", "--block-size", "16",
        "--kvserver", daemon.zmq_address,
    )  # fmt: skip
    try:
        with EngineClient(sched.info["grpc_port"]) as c:
            assert c.generate(tokens(64, 7), 2)
        names = scrape(daemon.metrics_url).names()
        names |= scrape(f"http://127.0.0.1:{sched.info['metrics_port']}/metrics").names()
        assert wanted <= names, sorted(wanted - names)
        assert sched.terminate() == 0, sched.log()
    finally:
        sched.kill()
        assert daemon.terminate() == 0, daemon.log()
