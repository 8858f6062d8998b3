"""Builders for scheduler tests: configs, requests, and an in-process step harness whose
workers are :class:`scheduler.synthetic.SyntheticWorker` s (synthetic outputs, no sockets)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.config import SchedulerConfig
from scheduler.connector_base import SchedulerConnector
from scheduler.request import Request, RequestOutput
from scheduler.scheduler import Scheduler
from scheduler.synthetic import SyntheticWorker, next_token
from scheduler.trace import StepTrace
from step_protocol import StepPlan, StepResult

BLOCK = 4


def config(**kw: Any) -> SchedulerConfig:
    """Small defaults: 4-token blocks, 64 blocks, budget 64."""
    values: dict[str, Any] = {
        "num_gpu_blocks": 64,
        "block_size": BLOCK,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
    }
    values.update(kw)
    return SchedulerConfig(**values)


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def expected_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What a synthetic model generates for ``prompt``, however its KV was obtained."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq[-1], len(seq)))
    return seq[len(prompt) :]


@dataclass
class Harness:
    """A scheduler plus ``world_size`` in-process synthetic workers."""

    scheduler: Scheduler
    workers: list[SyntheticWorker]
    plans: list[StepPlan] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def pool(self) -> Any:
        return self.scheduler.pool

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 4, **kw: Any) -> Request:
        request = self.scheduler.make_request(req_id, prompt, max_tokens=max_tokens, **kw)
        self.scheduler.add_request(request)
        return request

    def run_workers(self, plan: StepPlan) -> list[StepResult]:
        return [w.execute(plan) for w in self.workers]

    def step(self, results: list[StepResult] | None = None) -> tuple[StepPlan, list[RequestOutput]]:
        """One step; ``results`` replaces the workers' answers (synthetic outputs)."""
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        if results is None:
            results = self.run_workers(plan)
        outs = self.scheduler.update_from_output(plan, results)
        for out in outs:
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.finished[out.request_id] = out
        self.pool.check_invariants()
        return plan, outs

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left; returns the number of steps."""
        n = 0
        while self.scheduler.has_work():
            self.step()
            n += 1
            assert n < max_steps, "no progress"
        return n


def harness(
    *,
    connector: SchedulerConnector | None = None,
    world_size: int = 1,
    trace: StepTrace | None = None,
    **kw: Any,
) -> Harness:
    cfg = config(**kw)
    scheduler = Scheduler(cfg, connector=connector, trace=trace)
    workers = [
        SyntheticWorker(rank, cfg.block_size, cfg.num_gpu_blocks) for rank in range(world_size)
    ]
    return Harness(scheduler, workers)
