"""``/metrics`` of a real scheduler process (synthetic workers, a real daemon), parsed by
prometheus_client's own parser: steps, prompt tokens by source, connector lookups and their
latency move after real requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scheduler.builders import tokens
from tests.scheduler.procs import EngineClient, start_scheduler
from tests.support.connector import PATIENT_ARGS
from tests.support.daemon import start_daemon
from tests.support.metrics import convention_faults, scrape

pytestmark = pytest.mark.multiprocess

FAMILIES = {
    "scheduler_steps": "counter",
    "scheduler_requests": "gauge",
    "scheduler_gpu_blocks": "gauge",
    "scheduler_gpu_cache_usage_ratio": "gauge",
    "scheduler_prompt_tokens": "counter",
    "scheduler_finished_requests": "counter",
    "scheduler_connector_lookups": "counter",
    "scheduler_connector_loads": "counter",
    "scheduler_connector_lookup_duration_seconds": "histogram",
    "scheduler_connector_planned_chunks": "counter",
    "scheduler_connector_granted_chunks": "counter",
    "scheduler_connector_dropped_events": "counter",
    "scheduler_connector_carried_completions": "counter",
    "scheduler_connector_completion_errors": "counter",
    "process_start_time_seconds": "gauge",  # prometheus_client's process collector
    "process_resident_memory_bytes": "gauge",
}


def test_prompt_tokens_by_source_and_lookup_latency(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "daemon", "--dram", "16MiB")
    proc = start_scheduler(
        tmp_path,
        "--synthetic-workers", "2", "--num-gpu-blocks", "17", "--block-size", "16",
        "--kvserver", daemon.zmq_address, *PATIENT_ARGS, "--chunk-blocks", "1",
    )  # fmt: skip
    url = f"http://127.0.0.1:{proc.info['metrics_port']}/metrics"
    try:
        before = scrape(url)
        assert FAMILIES.items() <= before.types.items(), before.types
        assert convention_faults(before, "scheduler") == []
        assert before.value("scheduler_gpu_blocks") == 17
        with EngineClient(proc.info["grpc_port"]) as c:
            p, q = tokens(128, 100), tokens(240, 5000)
            c.generate(p, 1)
            c.generate(q, 1)  # evicts most of p's GPU blocks
            again = c.generate(p, 3)
            usage = again[0].usage
            assert usage.kvserver_tokens > 0, usage
        after = scrape(url)
        assert after.value("scheduler_steps_total") > before.value("scheduler_steps_total")
        assert after.value("scheduler_finished_requests_total") == 3
        by_source = {
            s: after.value("scheduler_prompt_tokens_total", source=s)
            for s in ("computed", "gpu_cache", "kvserver")
        }
        assert sum(by_source.values()) == 128 + 240 + 128
        assert by_source["kvserver"] == usage.kvserver_tokens
        assert by_source["gpu_cache"] == usage.gpu_cached_tokens
        lookups = after.value("scheduler_connector_lookups_total")
        assert lookups >= 2 and after.value("scheduler_connector_loads_total") >= 1
        count = after.value("scheduler_connector_lookup_duration_seconds_count")
        assert count == lookups
        assert after.value("scheduler_connector_lookup_duration_seconds_sum") > 0
        # store accounting: each planned chunk has one fate, once its batch is answered
        fates = sum(
            after.value(f"scheduler_connector_{fate}_chunks_total")
            for fate in ("shared", "present", "filtered", "unreserved", "granted")
        )
        assert 0 < fates <= after.value("scheduler_connector_planned_chunks_total")
        assert after.value("scheduler_connector_granted_chunks_total") > 0
        assert after.value("scheduler_connector_dropped_events_total") == 0  # drained per step
        assert after.value("scheduler_connector_completion_errors_total") == 0  # daemon healthy
        assert proc.terminate() == 0, proc.log()
    finally:
        proc.kill()
        daemon.kill()


def test_scheduler_metrics_off(tmp_path: Path) -> None:
    proc = start_scheduler(tmp_path, "--synthetic-workers", "1", "--metrics-port", "-1")
    try:
        assert proc.info["metrics_port"] == -1
        assert proc.terminate() == 0, proc.log()
    finally:
        proc.kill()
