"""The workload of ``bench_scheduler.py``: one scheduler per configuration, in steady decode.

Each :class:`Config` is a :class:`scheduler.scheduler.Scheduler` with ``NUM_REQUESTS``
requests (``PROMPT_TOKENS``-token prompts sharing a ``SYSTEM_PREFIX``-token system prefix, so
the prefix cache is in play) answered by an in-process synthetic worker, prefilled and settled
by :func:`make` until every request decodes one token per step; :meth:`Config.run` runs steps
and records their timings. :func:`kvserver_connector` is the real connector of the
``kvserver`` configuration. How the configurations are measured, compared and reported is
``bench_scheduler.py``'s.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks.thread_probe import ThreadProbe
from scheduler.config import SchedulerConfig
from scheduler.connector_base import SchedulerConnector
from scheduler.scheduler import Scheduler
from scheduler.synthetic import SYNTHETIC_KV_LAYOUT, SyntheticWorker

if TYPE_CHECKING:
    from scheduler.kv_connector import KVServerSchedulerConnector

NUM_REQUESTS = 256
BLOCK_SIZE = 16
CHUNK_BLOCKS = 1
SYSTEM_PREFIX = 256
PROMPT_TOKENS = 512


@dataclass
class Config:
    """One scheduler in steady decode, and its timings."""

    name: str
    scheduler: Scheduler
    worker: SyntheticWorker
    schedule_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    #: the same, as CPU time of the measuring thread.
    schedule_cpu_s: list[float] = field(default_factory=list)
    step_cpu_s: list[float] = field(default_factory=list)
    #: ``Scheduler.dispatched()`` (the connector's daemon call, sent while the workers run).
    dispatch_s: list[float] = field(default_factory=list)
    #: the kvserver client's requests sent by op (kvserver connector only).
    sent_by_op: Counter[str] | None = None
    calls: Counter[str] = field(default_factory=Counter)
    #: ``--worker-ms``: how long the workers' step lasts (the scheduler sleeps, untimed).
    worker_s: float = 0.0
    #: the kvserver connector's store accounting over the whole run (docs/connector.md).
    stores: dict[str, int] | None = None
    #: ``--breakdown``: the kernel's accounts of schedule() and of update_from_output().
    probes: tuple[ThreadProbe, ThreadProbe] | None = None

    def run(self, steps: int, timed: bool = True) -> None:
        before = Counter(self.sent_by_op or ())
        s, worker, perf, cpu = self.scheduler, self.worker, time.perf_counter, time.thread_time
        connector = s.connector
        sched_probe, update_probe = self.probes if timed and self.probes else (_NO_PROBE,) * 2
        for _ in range(steps):
            sched_probe.start()
            c0, t0 = cpu(), perf()
            plan = s.schedule()
            t1, c1 = perf(), cpu()
            sched_probe.stop()
            t4 = perf()
            s.dispatched()  # the plan went to the workers (scheduler/process.py)
            dispatch = perf() - t4
            results = [worker.execute(plan)]
            if self.worker_s:
                time.sleep(self.worker_s)  # the GPU's forward pass: the scheduler waits
            update_probe.start()
            c2, t2 = cpu(), perf()
            s.update_from_output(plan, results)
            if connector is not None:
                connector.take_events()  # as the step loop does (scheduler/process.py)
            t3, c3 = perf(), cpu()
            update_probe.stop()
            if timed:
                self.schedule_s.append(t1 - t0)
                self.step_s.append((t1 - t0) + (t3 - t2))
                self.schedule_cpu_s.append(c1 - c0)
                self.step_cpu_s.append((c1 - c0) + (c3 - c2))
                self.dispatch_s.append(dispatch)
        if timed and self.sent_by_op is not None:
            self.calls += Counter(self.sent_by_op) - before


class _NoProbe:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


_NO_PROBE: Any = _NoProbe()


def make(
    name: str,
    connector: SchedulerConnector | None,
    max_steps: int,
    sent_by_op: Counter[str] | None = None,
) -> Config:
    tokens_per_req = PROMPT_TOKENS + max_steps + 64
    blocks = NUM_REQUESTS * (tokens_per_req // BLOCK_SIZE + 2) + 1
    cfg = SchedulerConfig(
        num_gpu_blocks=blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=8192,
        long_prefill_token_threshold=2048,
    )
    scheduler = Scheduler(cfg, connector=connector)
    rng = random.Random(0)
    system = [rng.randrange(32_000) for _ in range(SYSTEM_PREFIX)]
    for i in range(NUM_REQUESTS):
        user = [rng.randrange(32_000) for _ in range(PROMPT_TOKENS - SYSTEM_PREFIX)]
        scheduler.add_request(
            scheduler.make_request(f"req-{i}", system + user, max_tokens=tokens_per_req)
        )
    config = Config(name, scheduler, SyntheticWorker(0, BLOCK_SIZE, blocks), sent_by_op=sent_by_op)
    # prefill everything, until every request decodes one token per step
    while len(scheduler.running) < NUM_REQUESTS or any(
        r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running
    ):
        config.run(1, timed=False)
    config.run(32, timed=False)  # and settle
    return config


def kvserver_connector(address: str) -> KVServerSchedulerConnector:
    from kvserver.namespace import NamespaceSpec
    from scheduler.kv_connector import KVServerSchedulerConnector
    from scheduler.kv_connector_types import KVConnectorConfig

    layout: dict[str, Any] = SYNTHETIC_KV_LAYOUT
    spec = NamespaceSpec(
        model="bench-scheduler",
        dtype=layout["dtype"],
        num_layers=layout["num_layers"],
        num_kv_heads=layout["num_kv_heads"],
        head_dim=layout["head_dim"],
        block_size=BLOCK_SIZE,
        chunk_blocks=CHUNK_BLOCKS,
    )
    return KVServerSchedulerConnector(KVConnectorConfig(address, spec, op_timeout_s=5.0))
