"""Start real scheduler and synthetic worker processes on loopback (tests and benchmarks)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from benchmarks.harness.proc import READY_TIMEOUT_S as READY_TIMEOUT_S
from benchmarks.harness.proc import Proc as Proc
from benchmarks.harness.proc import start_process
from benchmarks.harness.proc import wait_for_ready_file as wait_for_ready_file
from kvserver._proto.kvserver.v1 import engine_pb2 as pb
from kvserver._proto.kvserver.v1 import engine_pb2_grpc
from kvserver.crypto import TlsClient
from kvserver.grpc_format import bearer_metadata
from kvserver.token_file import TokenFile


def _start(args: list[str], ready: Path, log_path: Path) -> Proc:
    proc, info = start_process(args, ready, log_path, name=str(args[2:4]))
    return Proc(proc, info, log_path, args)


def start_worker(tmp_path: Path, name: str, bind: str = "tcp://127.0.0.1:0", *extra: str) -> Proc:
    """``python -m scheduler.synthetic`` bound on loopback (``extra``: more of its flags);
    ``info["endpoint"]``."""
    ready = tmp_path / f"{name}.ready"
    args = [sys.executable, "-m", "scheduler.synthetic", "--bind", bind, "--ready-file",
            str(ready), *extra]  # fmt: skip
    return _start(args, ready, tmp_path / f"{name}.log")


def start_scheduler(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None, grpc_port: int = 0
) -> Proc:
    """``kvserver scheduler`` on loopback (gRPC port ``grpc_port``, 0 = ephemeral);
    ``info["grpc_port"]``. ``env``: its environment (default: this one)."""
    ready = tmp_path / f"scheduler-{time.monotonic_ns()}.ready"
    args = [
        sys.executable, "-m", "kvserver.cli", "scheduler",
        "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--metrics-port", "0",
        "--ready-file", str(ready), *extra,
    ]  # fmt: skip
    log_path = tmp_path / f"scheduler-{time.monotonic_ns()}.log"
    proc, info = start_process(args, ready, log_path, name=str(args[2:4]), env=env)
    return Proc(proc, info, log_path, args)


class EngineClient:
    """A tiny blocking client of kvserver.v1.Engine (closes its channel); over TLS with
    ``tls`` (a ``kvserver.crypto.TlsClient``). Presents ``auth_token``, else the token the
    scheduler left for this user (``kvserver/token_file.py``; read per call, so a restarted
    scheduler's new token is picked up); ``auth_token=""``: none at all."""

    def __init__(
        self, port: int, tls: TlsClient | None = None, auth_token: str | None = None
    ) -> None:
        target = f"127.0.0.1:{port}"
        self._auth_token = auth_token
        self._token_file = TokenFile(target) if auth_token is None else None
        if tls is None:
            self.channel = grpc.insecure_channel(target)
        else:
            self.channel = grpc.secure_channel(target, tls.credentials(), options=tls.options())
        self.stub = engine_pb2_grpc.EngineStub(self.channel)  # type: ignore[no-untyped-call]

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def stream(self, tokens: list[int], max_tokens: int, **kw: Any) -> Iterator[Any]:
        req = pb.GenerateRequest(token_ids=tokens, max_tokens=max_tokens, greedy=True, **kw)
        return self.stub.Generate(  # type: ignore[no-any-return]
            req, timeout=60, metadata=self.metadata()
        )

    def generate(self, tokens: list[int], max_tokens: int, **kw: Any) -> list[Any]:
        return list(self.stream(tokens, max_tokens, **kw))

    def stats(self) -> Any:
        return self.stub.EngineStats(pb.EngineStatsRequest(), timeout=10, metadata=self.metadata())

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The call metadata presenting the token (None: no token)."""
        token = self._auth_token if self._token_file is None else self._token_file.reload()
        return bearer_metadata(token or "")


def output_tokens(msgs: list[Any]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]
