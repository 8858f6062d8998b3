"""Real ``kvserver worker`` processes (tiny model, CPU, tensor-parallel) and the multi-turn
conversation workload, shared by tests/test_e2e_failures.py, tests/test_e2e.py and
benchmarks/bench_e2e.py."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.daemon import wait_for_ready_file
from benchmarks.harness.ports import free_port
from benchmarks.harness.proc import STARTED
from benchmarks.harness.procs import EngineClient, Proc, output_tokens

READY_TIMEOUT_S = 60.0
MODEL_SEED = 7


def start_tp_workers(
    tmp_path: Path,
    daemon_zmq: str | None,
    *,
    world: int = 2,
    listen: Sequence[str] | None = None,
    chunk_blocks: int = 1,
    tag: str = "",
    device: str = "cpu",
    extra: Sequence[str] = (),
) -> list[Proc]:
    """Start ``world`` ranks of ``kvserver worker`` (a fresh TP group) on ``device`` (``cpu``,
    or ``cuda``: every rank on one machine's GPUs, rank ``r`` on GPU ``r`` mod their count);
    returns once every rank wrote its ready file (``info["endpoint"]``). ``listen``: one bind
    address per rank (restart at the same address), default ephemeral ports; ``extra``: more
    flags for every rank (``--auth-token``, ``--curve-*``)."""
    model_file = tmp_path / "model.safetensors"
    dist_init = f"tcp://127.0.0.1:{free_port()}"
    addrs = list(listen) if listen is not None else ["tcp://127.0.0.1:0"] * world
    pending = []
    for rank in range(world):
        ready = tmp_path / f"worker{rank}{tag}.ready"
        log_path = tmp_path / f"worker{rank}{tag}.log"
        args = [
            sys.executable, "-m", "kvserver.cli", "worker",
            "--rank", str(rank), "--world-size", str(world),
            "--listen", addrs[rank], "--dist-init", dist_init,
            "--model-file", str(model_file), "--write-random-model-seed", str(MODEL_SEED),
            "--device", device, "--chunk-blocks", str(chunk_blocks), "--ready-file", str(ready),
        ]  # fmt: skip
        if daemon_zmq is not None:
            args += ["--kvserver", daemon_zmq]
        args += extra
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        STARTED.append((f"worker rank {rank}", proc.pid, log_path))
        pending.append((proc, ready, log_path, args))
    procs: list[Proc] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    for proc, ready, log_path, args in pending:
        try:
            wait_for_ready_file(ready, proc, deadline)
        except RuntimeError as exc:
            for p, *_ in pending:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            raise RuntimeError(f"worker did not start ({exc}):\n{log_path.read_text()}") from None
        procs.append(Proc(proc, json.loads(ready.read_text()), log_path, args))
    return procs


@dataclass(frozen=True, slots=True)
class Workload:
    """``conversations`` conversations of ``turns`` turns, interleaved round-robin: turn 1 is
    ``first`` random tokens, each later prompt = previous prompt + its output + ``user`` new
    tokens."""

    conversations: int = 2
    turns: int = 3
    first: int = 48
    user: int = 24
    max_tokens: int = 8
    vocab: int = 512
    seed: int = 1


@dataclass(slots=True)
class Turn:
    conversation: int
    prompt: list[int]
    output: list[int]
    gpu_cached: int
    kvserver: int
    computed: int


@dataclass(slots=True)
class WorkloadResult:
    turns: list[Turn] = field(default_factory=list)


def run_workload(
    port: int, w: Workload, progress: Any = None, timeout: float = 60.0
) -> WorkloadResult:
    """Send every turn of ``w`` to the scheduler's gRPC port, one at a time (a turn needs the
    previous turn's output); records each prompt, output and prompt-token sources."""
    rng = random.Random(w.seed)
    prompts = [[rng.randrange(w.vocab) for _ in range(w.first)] for _ in range(w.conversations)]
    result = WorkloadResult()
    with EngineClient(port) as c:
        for _turn in range(w.turns):
            for conv in range(w.conversations):
                msgs = list(
                    c.stub.Generate(
                        _request(prompts[conv], w.max_tokens),
                        timeout=timeout,
                        metadata=c.metadata(),
                    )
                )
                out = output_tokens(msgs)
                u = msgs[0].usage
                result.turns.append(
                    Turn(conv, list(prompts[conv]), out, u.gpu_cached_tokens, u.kvserver_tokens,
                         u.computed_tokens)
                )  # fmt: skip
                prompts[conv] = (
                    prompts[conv] + out + [rng.randrange(w.vocab) for _ in range(w.user)]
                )
                if progress is not None:
                    progress.update(1)
    return result


def _request(tokens: list[int], max_tokens: int) -> Any:
    from kvserver._proto.kvserver.v1 import engine_pb2 as pb

    return pb.GenerateRequest(token_ids=tokens, max_tokens=max_tokens, greedy=True)


def ideal_reusable(
    turns: Sequence[Turn], block_size: int, *, kv_computed_only: bool = False
) -> list[int]:
    """Per turn (in order), the tokens an infinite prefix cache could skip: the longest prefix,
    in full chunks of ``block_size`` tokens and at most ``len(prompt) - 1`` tokens (one token is
    always computed), that the prompt shares with any earlier turn's prompt + output.
    ``kv_computed_only``: without the last output token of each earlier turn (sampled, never
    fed back, so no cache can hold its KV)."""
    seen: list[list[int]] = []
    out: list[int] = []
    for t in turns:
        limit = (len(t.prompt) - 1) // block_size * block_size
        best = 0
        for s in seen:
            n = 0
            for a, b in zip(t.prompt[:limit], s, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n // block_size * block_size)
        out.append(best)
        seen.append(t.prompt + (t.output[:-1] if kv_computed_only else t.output))
    return out
