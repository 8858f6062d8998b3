"""The largest step plan and reply of a run, encoded as on the step channel, with the real
scheduler (``scheduler.scheduler.Scheduler``) and synthetic workers in process, against the
bounds and limits of those settings (``step_protocol/limits.py``; docs/scheduler.md, "Step
channel limits"). Sizes, not times: the load of a shared machine does not move them.

Usage::

    PYTHONPATH=. python -m benchmarks.step_message_sizes [--seqs 256] [--budget 8192]
        [--prompt 4000] [--blocks 1024] [--steps 400]

``--seqs`` requests of ``--prompt`` random tokens (below 32,000) each, 8 output tokens, blocks
of 16 tokens; steps until done or ``--steps``. Prints one line.
"""

from __future__ import annotations

import argparse
import random

from scheduler.config import ProcessConfig, SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.synthetic import SyntheticWorker
from step_protocol import KIND_RESULT, KIND_STEP, encode_body
from step_protocol.limits import DEFAULT_WORKER_LIMIT_BYTES, MIB


def measure(seqs: int, budget: int, prompt: int, blocks: int, steps: int) -> str:
    cfg = SchedulerConfig(
        num_gpu_blocks=blocks, block_size=16, max_num_seqs=seqs, max_num_batched_tokens=budget
    )
    scheduler = Scheduler(cfg)
    worker = SyntheticWorker(0, cfg.block_size, cfg.num_gpu_blocks)
    rng = random.Random(1)
    for i in range(seqs):
        tokens = [rng.randrange(32_000) for _ in range(prompt)]
        scheduler.add_request(
            scheduler.make_request(f"req-{i:08x}-{'x' * 24}", tokens, max_tokens=8)
        )
    plan_max = reply_max = n = 0
    while scheduler.has_work() and n < steps:
        plan = scheduler.schedule()
        plan_max = max(plan_max, len(encode_body(KIND_STEP, plan.to_wire())))
        result = worker.execute(plan)
        reply_max = max(reply_max, len(encode_body(KIND_RESULT, result.to_wire())))
        scheduler.update_from_output(plan, [result])
        n += 1
    process = ProcessConfig(cfg, synthetic_workers=1)
    return (
        f"seqs={seqs} budget={budget} prompt={prompt} blocks={blocks}: {n} steps, largest plan "
        f"{plan_max} B ({plan_max / MIB:.2f} MiB), largest reply {reply_max} B; plan bound "
        f"{process.plan_bytes_bound / MIB:.1f} MiB, a worker's default limit "
        f"{DEFAULT_WORKER_LIMIT_BYTES / MIB:.0f} MiB, the scheduler's reply limit "
        f"{process.reply_limit_bytes / MIB:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400)
    a = parser.parse_args()
    print(measure(a.seqs, a.budget, a.prompt, a.blocks, a.steps))


if __name__ == "__main__":
    main()
