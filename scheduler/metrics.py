"""The scheduler's Prometheus metrics, read at scrape time (``docs/metrics.md``).

Runs in the scheduler process: the snapshot (:meth:`SchedulerCollector.snapshot`) on the event
loop that runs the step loop, the rest on prometheus_client's scrape thread (see
:mod:`kvserver.prometheus`). Every value is a counter the scheduler, its block pool or its
kvserver connector already keeps; the connector's lookup latency is its own histogram.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kvserver.prometheus import LoopCollector
from scheduler.kv_connector import KVServerSchedulerConnector
from scheduler.scheduler import Scheduler


class CoreView(Protocol):
    """What the collector reads of the process's engine core (``scheduler/engine_core.py``'s
    ``EngineCore``), stated here so that this module does not import the step loop."""

    @property
    def scheduler(self) -> Scheduler: ...

    def stats(self) -> dict[str, Any]: ...


#: prompt token sources: label value → PromptTotals field
_PROMPT_SOURCES = (
    ("computed", "computed_tokens"),
    ("gpu_cache", "gpu_cached_tokens"),
    ("kvserver", "kvserver_tokens"),
)
#: connector counters: (metric name without _total, help, ConnectorStats field)
_CONNECTOR_COUNTERS = (
    ("scheduler_connector_lookups", "kvserver lookups for new prompts.", "lookups"),
    ("scheduler_connector_lookups_reused", "Lookups answered from the request's last one.",
     "lookups_reused"),
    ("scheduler_connector_lookup_failures", "Lookups failed: no hit.", "lookups_failed"),
    ("scheduler_connector_hit_tokens", "Prompt tokens of kvserver hits taken.", "hit_tokens"),
    ("scheduler_connector_loads", "Loads from kvserver started.", "loads"),
    ("scheduler_connector_load_errors", "Loads that failed (recomputed).", "load_errors"),
    ("scheduler_connector_planned_chunks", "Chunks planned for storing.", "planned_chunks"),
    ("scheduler_connector_granted_chunks", "Planned chunks reserved.", "granted_chunks"),
    ("scheduler_connector_shared_chunks", "Planned, stored for another request.", "shared_chunks"),
    ("scheduler_connector_present_chunks", "Planned, kvserver had them.", "present_chunks"),
    ("scheduler_connector_filtered_chunks", "Planned, not admitted by the daemon.",
     "filtered_chunks"),
    ("scheduler_connector_unreserved_chunks", "Planned, not reserved.", "unreserved_chunks"),
    ("scheduler_connector_stored_chunks", "Chunks stored to kvserver.", "stored_chunks"),
    ("scheduler_connector_store_rejections", "Stores refused.", "store_rejections"),
    ("scheduler_connector_timeouts", "Daemon calls that timed out.", "timeouts"),
    ("scheduler_connector_dropped_events", "Connector events dropped untaken.", "dropped_events"),
    ("scheduler_connector_carried_completions", "Store completions sent on a prepare_store.",
     "carried_completions"),
    ("scheduler_connector_completion_errors", "Store completions not applied.",
     "completion_errors"),
)  # fmt: skip


class SchedulerCollector(LoopCollector):
    """``/metrics`` of one scheduler process."""

    def __init__(self, core: CoreView, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._core = core
        connector = core.scheduler.connector
        self._connector = connector if isinstance(connector, KVServerSchedulerConnector) else None

    def snapshot(self) -> dict[str, Any]:
        scheduler = self._core.scheduler
        out = self._core.stats()
        out["prompt_totals"] = dataclasses.asdict(scheduler.prompt_totals)
        if self._connector is not None:
            out["connector"] = dataclasses.asdict(self._connector.stats)
        return out

    def families(self, snapshot: Any) -> Iterator[Metric]:
        s: dict[str, Any] = snapshot
        yield CounterMetricFamily("scheduler_steps", "Engine steps planned.", s["step"])
        requests = GaugeMetricFamily("scheduler_requests", "Requests by state.", labels=["state"])
        for state in ("running", "waiting", "waiting_for_remote_kvs"):
            requests.add_metric([state], s[state])
        yield requests
        yield GaugeMetricFamily("scheduler_gpu_blocks", "GPU KV blocks.", s["total_blocks"])
        yield GaugeMetricFamily("scheduler_gpu_free_blocks", "Free GPU blocks.", s["free_blocks"])
        yield GaugeMetricFamily(
            "scheduler_gpu_cache_usage_ratio", "Share of GPU KV blocks in use.", s["usage"]
        )
        totals = s["prompt_totals"]
        prompt = CounterMetricFamily(
            "scheduler_prompt_tokens",
            "Prompt tokens of ended requests by source: computed, gpu_cache, kvserver (loaded).",
            labels=["source"],
        )
        for source, key in _PROMPT_SOURCES:
            prompt.add_metric([source], totals[key])
        yield prompt
        yield CounterMetricFamily(
            "scheduler_finished_requests", "Requests ended after admission.", totals["requests"]
        )
        connector = s.get("connector")
        if connector is not None and self._connector is not None:
            for name, doc, key in _CONNECTOR_COUNTERS:
                yield CounterMetricFamily(name, doc, value=connector[key])
            yield from self._connector.lookup_seconds.collect()
