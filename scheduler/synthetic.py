"""A synthetic worker: answers StepPlans with deterministic tokens, no model, no torch.

Lets the whole scheduler path (queues, budget, block tables, connector metadata, ZMQ fan-out,
gRPC front door) run anywhere. Two faces:

- :class:`SyntheticWorker`, a plain class (tests drive it in-process): keeps each request's
  block table, checks every plan against it (a scheduler bug shows up as an error here rather
  than as wrong KV), and samples ``next_token(last token, position)`` — a hash, so the output
  does not depend on how the prompt's KV was obtained (computed, prefix-cached, loaded).
  Connector transfers are reported done (every chunk of every lease) without moving bytes.
- ``python -m scheduler.synthetic --bind tcp://127.0.0.1:0 [--ready-file F]``: the same behind
  a ZMQ ROUTER socket, speaking the step protocol of :mod:`step_protocol`. It
  serves one request at a time, in order; exits on ``stop``, SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvserver.crypto import CurveServer
from kvserver.errors import InvalidArgument
from step_protocol import (
    ConnectorMetadata,
    ConnectorWorkerOutput,
    StepPlan,
    StepResult,
    TransferResult,
    WorkerHello,
    WorkerInfo,
)
from step_protocol import limits as step_limits
from step_protocol import security as step_security
from step_protocol.limits import DEFAULT_WORKER_LIMIT_BYTES
from step_protocol.serve import serve_steps

logger = logging.getLogger(__name__)

VOCAB_SIZE = 32_000
#: the KV layout synthetic workers claim (a kvserver namespace needs one)
SYNTHETIC_KV_LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16"}


def next_token(last_token: int, position: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> int:
    """The synthetic model: the token at ``position`` after ``last_token``."""
    digest = hashlib.blake2b(f"{last_token}:{position}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


@dataclass(slots=True)
class _ReqState:
    tokens: list[int]
    block_ids: list[int]
    greedy: bool
    seed: int


@dataclass(slots=True)
class SyntheticWorker:
    """One rank of a synthetic model; see the module docstring."""

    rank: int = 0
    block_size: int = 16
    num_gpu_blocks: int = 1024
    vocab_size: int = VOCAB_SIZE
    delay_s: float = 0.0
    _reqs: dict[str, _ReqState] = field(default_factory=dict)

    def hello(self, msg: WorkerHello) -> WorkerInfo:
        """Adopt the scheduler's view; forget every request (a fresh start)."""
        self.rank = msg.rank
        self.block_size = msg.block_size
        self.num_gpu_blocks = msg.num_gpu_blocks
        self._reqs.clear()
        return WorkerInfo(self.rank, os.getpid(), self.vocab_size, dict(SYNTHETIC_KV_LAYOUT))

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Raises InvalidArgument for a plan inconsistent with earlier ones."""
        reqs = self._reqs
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            reqs.pop(req_id, None)
        for new in plan.new_reqs:
            self._check_blocks(new.req_id, new.block_ids)
            reqs[new.req_id] = _ReqState(
                [*new.prompt_token_ids, *new.output_token_ids],
                list(new.block_ids),
                new.greedy,
                new.seed,
            )
        for cached in plan.cached_reqs:
            state = reqs.get(cached.req_id)
            if state is None:
                raise InvalidArgument("step names an unknown request", req=cached.req_id)
            self._check_blocks(cached.req_id, cached.new_block_ids)
            state.block_ids += cached.new_block_ids
            start = cached.num_computed_tokens
            known = len(state.tokens)
            if start > known:
                raise InvalidArgument("tokens skipped", req=cached.req_id, start=start, known=known)
            # the scheduler is the source of truth for the tokens (ours may lag one sample)
            del state.tokens[start:]
            state.tokens += cached.token_ids
        sampled: dict[str, int] = {}
        computed = {r.req_id: r.num_computed_tokens for r in plan.new_reqs}
        computed.update((r.req_id, r.num_computed_tokens) for r in plan.cached_reqs)
        for req_id, n in plan.num_scheduled_tokens.items():
            state = reqs.get(req_id)
            if state is None or req_id not in computed:
                raise InvalidArgument("scheduled request without data", req=req_id)
            end = computed[req_id] + n
            if n < 1 or end > len(state.tokens):
                raise InvalidArgument("scheduled beyond the known tokens", req=req_id, end=end)
            if end > len(state.block_ids) * self.block_size:
                raise InvalidArgument(
                    "block table too short", req=req_id, end=end, blocks=len(state.block_ids)
                )
            seed = 0 if state.greedy else state.seed
            sampled[req_id] = next_token(state.tokens[end - 1], end, seed, self.vocab_size)
        if self.delay_s:
            time.sleep(self.delay_s)  # simulated compute time (a knob, not synchronisation)
        return StepResult(plan.step, self.rank, sampled, self._transfers(plan.connector_meta))

    def _check_blocks(self, req_id: str, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if not 0 < block_id < self.num_gpu_blocks:
                raise InvalidArgument("bad block id", req=req_id, block=block_id)

    def _transfers(self, meta: Any) -> ConnectorWorkerOutput | None:
        """Every planned load and store is reported done: there are no bytes to move."""
        if meta is None:
            return None
        if not isinstance(meta, ConnectorMetadata):
            meta = ConnectorMetadata.from_wire(meta)
        return ConnectorWorkerOutput(
            self.rank,
            loads=[TransferResult(t.req_id, t.lease_id) for t in meta.loads],
            stores=[TransferResult(t.req_id, t.lease_id) for t in meta.stores],
        )


# ---------------------------------------------------------------------------- the process


def serve(
    bind: str,
    *,
    ready_file: str | None,
    delay_s: float,
    parent_pid: int | None = None,
    curve: CurveServer | None = None,
    no_auth: bool = False,
    max_message_bytes: int = DEFAULT_WORKER_LIMIT_BYTES,
) -> int:
    """Serve the step protocol on a ROUTER bound at ``bind`` (a CURVE server with ``curve``;
    plans up to ``max_message_bytes``)
    until ``stop``, a signal, or (with ``parent_pid``) the parent process going away
    (:func:`step_protocol.serve.serve_steps`)."""
    serve_steps(
        SyntheticWorker(delay_s=delay_s), bind, ready_file=ready_file, parent_pid=parent_pid,
        curve=curve, no_auth=no_auth, max_message_bytes=max_message_bytes,
    )  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZMQ endpoint to bind")
    parser.add_argument("--ready-file", help="write {pid, endpoint} here once bound")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="simulated step time")
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    parser.add_argument("--log-level", default="WARNING")
    step_security.add_worker_args(parser)
    step_security.add_insecure_remote_arg(parser, "the step channel (--bind)")
    step_limits.add_limit_arg(parser, scheduler=False)
    args = parser.parse_args(argv)
    try:
        curve = step_security.worker_curve(args)
        step_security.check_worker_listen(args.bind, curve, args.insecure_remote)
        limit = step_limits.worker_limit(args)
    except InvalidArgument as exc:
        parser.error(exc.message)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return serve(
            args.bind,
            ready_file=args.ready_file,
            delay_s=args.delay_ms / 1e3,
            parent_pid=args.parent_pid,
            curve=curve,
            no_auth=args.step_no_auth,
            max_message_bytes=limit,
        )
    except zmq.ZMQError as exc:  # as `kvserver worker` says it (was: a traceback)
        print(f"synthetic worker: cannot listen on {args.bind}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
