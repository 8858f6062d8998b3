"""The Redis reference of ``kvserver bench``: what users run today (target >= 3x).

Runs in the bench process, which starts one ``redis-server`` child (:class:`RedisRef`) and talks
to it with redis-py; one bench, one thread, nothing here is thread-safe. Call order:
:func:`redis_unavailable` (None, or why the reference is skipped) → ``RedisRef(...).start()`` →
:meth:`RedisRef.store_load` any number of times → :meth:`RedisRef.close`.

The server: ``redis-server`` on 127.0.0.1 and an ephemeral port (a free port is picked and
retried if another process takes it first), persistence off (``--save ''``, ``--appendonly
no``), ``maxmemory`` large enough for two batches with ``noeviction`` (a bench that overflowed
it would fail loudly instead of timing evictions), its working directory and log in the bench's
temporary directory; SIGTERM (then SIGKILL) at the end. Redis allocates with its own jemalloc,
so the glibc settings the other processes of the run share do not apply to it.

One round stores and loads the same parts as kvserver's ``put`` + ``get``, in one of two
client modes (:data:`MODES`; the bench measures both and holds kvserver to the faster):

- ``pipelined`` mirrors kvserver's two round trips: one redis-py pipeline
  (``transaction=False``) of ``SET key part`` for every part of the batch, sent and answered as
  one round trip, then one pipeline of ``GET key`` for the same keys;
- ``per-command``: ``SET`` then ``GET`` one key at a time, a round trip each. With parts of
  256 KiB and more the round trips cost little and Redis is often faster this way (it never
  buffers a whole batch), so pipelining alone would handicap it.

The parts are memoryviews, which redis-py sends without copying them into its command buffer;
values come back as ``bytes``, parsed by hiredis when the ``hiredis`` package is installed (the
``bench`` extra pulls it in; else by redis-py's pure-Python parser, several times slower —
:attr:`RedisRef.client` says which).

Keys are fresh 32-byte strings every round (as kvserver's are); after the timed part of a round
they are deleted, untimed, so Redis never holds more than one batch and never evicts while
kvserver's figure includes the eviction of older chunks from its fixed DRAM tier. The
comparison is therefore, if anything, tilted towards Redis.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.ports import free_port as _free_port

DEFAULT_SERVER = "redis-server"
READY_TIMEOUT_S = 30.0
SOCKET_TIMEOUT_S = 60.0
#: attempts at an ephemeral port another process could take between our probe and Redis' bind.
PORT_ATTEMPTS = 3
#: maxmemory beyond twice the largest batch (Redis' own structures, client buffers).
MAXMEMORY_HEADROOM = 256 << 20
#: client modes of a round (module docstring).
MODES = ("pipelined", "per-command")


def redis_unavailable(server: str = DEFAULT_SERVER) -> str | None:
    """Why the Redis reference cannot run here (missing binary or package), or None."""
    if shutil.which(server) is None:
        return (
            f"{server!r} not found on PATH (install it: apt-get install redis-server, or pass "
            f"--redis-server PATH)"
        )
    try:
        importlib.import_module("redis")
    except ImportError:
        return "the redis Python package is not installed (pip install 'kvserver[bench]')"
    return None


class RedisRef:
    """A ``redis-server`` child and a redis-py client of it (see the module docstring)."""

    def __init__(
        self,
        workdir: Path,
        max_batch_bytes: int,
        *,
        server: str = DEFAULT_SERVER,
        host: str = "127.0.0.1",
    ) -> None:
        self._workdir = workdir
        self._maxmemory = 2 * max_batch_bytes + MAXMEMORY_HEADROOM
        self._server = server
        self._host = host
        self._proc: subprocess.Popen[bytes] | None = None
        self._client: Any = None
        #: ``redis-server`` version, once started.
        self.server_version = ""
        #: the redis-py version and the reply parser it uses, once started.
        self.client = ""

    @property
    def log_path(self) -> Path:
        return self._workdir / "redis.log"

    def start(self) -> None:
        """Start the server, wait until it answers PING; RuntimeError if it will not start."""
        redis = importlib.import_module("redis")
        for _attempt in range(PORT_ATTEMPTS):
            port = _free_port(self._host)
            self._proc = subprocess.Popen(self._args(port), stdout=subprocess.DEVNULL)
            client = redis.Redis(host=self._host, port=port, socket_timeout=SOCKET_TIMEOUT_S)
            if self._wait_ready(client):
                self._client = client
                break
            client.close()
            self._stop()
        else:
            raise RuntimeError(f"redis-server did not start:\n{self._log_tail()}")
        self.server_version = str(self._client.info("server")["redis_version"])
        parser = "hiredis" if importlib.import_module("redis.utils").HIREDIS_AVAILABLE else "python"
        self.client = f"redis-py {redis.__version__} ({parser} parser)"

    def store_load(
        self, parts: Sequence[memoryview], mode: str = "pipelined"
    ) -> tuple[float, list[bytes]]:
        """One round in ``mode`` (one of :data:`MODES`, see the module docstring): seconds of
        the SETs + GETs, and the values the GETs returned.

        REQUIRES: :meth:`start` succeeded.
        """
        if mode not in MODES:
            raise ValueError(f"unknown Redis mode {mode!r}; valid: {', '.join(MODES)}")
        redis = importlib.import_module("redis")
        keys = [os.urandom(32) for _ in parts]
        client = self._client
        try:
            start = time.perf_counter()
            if mode == "pipelined":
                pipe = client.pipeline(transaction=False)
                for key, part in zip(keys, parts, strict=True):
                    pipe.set(key, part)
                stored = pipe.execute()
                for key in keys:
                    pipe.get(key)
                values: list[bytes] = pipe.execute()
            else:
                stored = [client.set(key, part) for key, part in zip(keys, parts, strict=True)]
                values = [client.get(key) for key in keys]
            seconds = time.perf_counter() - start
            client.delete(*keys)
        except redis.RedisError as exc:  # OOM, a dead server, a timeout: the bench fails
            raise RuntimeError(f"Redis reference failed: {exc}") from exc
        if not all(stored):
            raise RuntimeError("Redis refused a SET")
        return seconds, values

    def close(self) -> None:
        """Close the client and stop the server (SIGTERM, then SIGKILL). Idempotent."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._stop()

    def _args(self, port: int) -> list[str]:
        return [
            self._server, "--bind", self._host, "--port", str(port), "--save", "",
            "--appendonly", "no", "--maxmemory", str(self._maxmemory),
            "--maxmemory-policy", "noeviction", "--dir", str(self._workdir),
            "--logfile", str(self.log_path), "--loglevel", "warning", "--databases", "1",
        ]  # fmt: skip

    def _wait_ready(self, client: Any) -> bool:
        """True once the server answers PING; False if it exited (port taken) or timed out."""
        redis = importlib.import_module("redis")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self._proc is not None and self._proc.poll() is None:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)  # polling for the listener, bounded by the deadline
        return False

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"
