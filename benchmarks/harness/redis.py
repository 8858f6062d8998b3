"""Real ``redis-server`` processes on loopback with ephemeral ports (tests and benchmarks).

``RedisServer.start(tmp)``: one server, persistence off, its log in ``tmp`` (``binary``: another
server of the same protocol, e.g. a ``valkey-server``); ``kill()`` (SIGKILL,
data lost as in a crash) and ``restart()`` (same port) for failure tests; ``paused(ms, mode)``
for a server that stalls. ``RedisCluster``
starts N servers with ``--cluster-enabled yes`` and joins them with ``redis-cli --cluster
create`` (masters only). Both wait until the server answers PING / the cluster is ``ok``.

``cli(*args)`` runs ``redis-cli`` and returns what it printed; a ``redis-cli`` that printed
nothing and failed (no connection, a reset) raises :class:`RedisCliError` with what it said,
and one that does not answer within its timeout raises ``subprocess.TimeoutExpired``: neither
passes for an empty reply.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.ports import free_port as _free_port

READY_TIMEOUT_S = 60.0
#: how long one ``redis-cli`` may take (2 shared cores at load 10-15: generous)
CLI_TIMEOUT_S = 30.0


class RedisCliError(RuntimeError):
    """``redis-cli`` printed nothing and exited with an error (it could not reach the server,
    or lost the connection): the message has its exit code and what it wrote to stderr."""


def _cli(port: int, *args: str, timeout: float = CLI_TIMEOUT_S, cacert: str = "") -> str:
    tls = ["--tls", "--cacert", cacert] if cacert else []
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *tls, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    reply = out.stdout.strip()
    if out.returncode != 0 and not reply:
        raise RedisCliError(
            f"redis-cli {' '.join(args[:2])} on port {port} exited with {out.returncode}: "
            f"{out.stderr.strip() or '(nothing on stderr)'}"
        )
    return reply


@dataclass
class RedisServer:
    directory: Path
    port: int
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    #: TLS only (``--tls-port``): the server's certificate (its own CA) and key files.
    tls_cert: str = ""
    tls_key: str = ""
    #: the server program (``redis-server``, or a ``valkey-server``: the same flags)
    binary: str = "redis-server"

    @classmethod
    def start(
        cls,
        directory: Path,
        *extra: str,
        port: int = 0,
        tls: tuple[str, str] | None = None,
        binary: str = "redis-server",
    ) -> RedisServer:
        """``tls``: (certificate, key) files: serve TLS only, no client certificates."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = tls or ("", "")
        server = cls(directory, port or _free_port(), extra, tls_cert=cert, tls_key=key,
                     binary=binary)  # fmt: skip
        server.restart()
        return server

    @property
    def url(self) -> str:
        if self.tls_cert:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_cert}"
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        """(Re)start on the same port; returns once it answers PING."""
        assert self.proc is None or self.proc.poll() is not None, "still running"
        self.starts += 1
        log = self.directory / f"redis-{self.port}-{self.starts}.log"
        listen = ["--port", str(self.port)]
        if self.tls_cert:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                      self.tls_cert, "--tls-key-file", self.tls_key, "--tls-ca-cert-file",
                      self.tls_cert, "--tls-auth-clients", "no"]  # fmt: skip
        args = [
            self.binary, *listen, "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.directory),
            "--logfile", str(log), *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        # ready = our own process answers: a PONG from another server that took the port (a
        # concurrent run) must not pass, nor may a server that did not start be left running
        while not self._answers_as(self.proc.pid):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                text = log.read_text() if log.exists() else "(no log)"
                raise RuntimeError(f"{self.binary} did not start on port {self.port}: {text}")
            time.sleep(0.02)  # polling for readiness, bounded by the deadline

    def _answers_as(self, pid: int) -> bool:
        """Whether the server on our port answers and is process ``pid``."""
        try:
            info = self.cli("INFO", "server")
        except (RedisCliError, subprocess.TimeoutExpired):  # not yet listening, or a loaded
            return False  # machine: ask again until the deadline
        for line in info.splitlines():
            if line.startswith("process_id:"):
                return line.partition(":")[2].strip() == str(pid)
        return False

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> str:
        """``redis-cli *args`` against this server; what it printed (see the module
        docstring for its failures)."""
        return _cli(self.port, *args, timeout=timeout, cacert=self.tls_cert)

    @contextlib.contextmanager
    def paused(self, ms: int, mode: str = "ALL") -> Iterator[None]:
        """The server paused for the block (``CLIENT PAUSE ms mode``), unpaused after it.

        Under ``ALL`` the server postpones every client's commands until the pause ends, the
        ``CLIENT UNPAUSE`` sent after the block included: nothing ends such a pause early, and
        the unpause returns only when the pause is over. Its ``redis-cli`` therefore waits
        what is left of the pause on top of its own timeout (a fixed 10 s once let it time out
        under load, the unpause lost). Under ``WRITE`` the unpause runs at once."""
        assert self.cli("CLIENT", "PAUSE", str(ms), mode) == "OK"
        ends = time.monotonic() + ms / 1000
        try:
            yield
        finally:
            left = max(0.0, ends - time.monotonic())
            assert self.cli("CLIENT", "UNPAUSE", timeout=left + CLI_TIMEOUT_S) == "OK"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _is_master(server: RedisServer) -> bool:
    return server.cli("ROLE").split()[:1] == ["master"]


def _ready(server: RedisServer) -> bool:
    """A cluster node that sees the cluster ``ok`` and, a replica, has synchronised."""
    if "cluster_state:ok" not in server.cli("CLUSTER", "INFO"):
        return False
    return _is_master(server) or "master_link_status:up" in server.cli("INFO", "replication")


@dataclass
class RedisCluster:
    servers: list[RedisServer] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        directory: Path,
        nodes: int = 3,
        tls: tuple[str, str] | None = None,
        binary: str = "redis-server",
        replicas: int = 0,
    ) -> RedisCluster:
        """``tls``: (certificate, key): every node serves TLS only, the bus too. ``binary``:
        the server program (a ``valkey-server``: the same flags, the same cluster protocol).
        ``replicas``: per master (``nodes`` masters), started too; returns once each has
        synchronised with its master (a failover then promotes one)."""
        cluster = cls()
        try:
            for i in range(nodes * (1 + replicas)):
                d = directory / f"node{i}"
                d.mkdir(parents=True, exist_ok=True)
                conf = str(d / "nodes.conf")
                # the bus port, explicit: the default (port + 10000) may exceed 65535
                bus = str(_free_port())
                flags = ["--cluster-enabled", "yes", "--cluster-config-file", conf,
                         "--cluster-port", bus]  # fmt: skip
                if tls is not None:
                    flags += ["--tls-cluster", "yes"]
                cluster.servers.append(
                    RedisServer.start(
                        d, *flags, "--cluster-node-timeout", "2000", tls=tls, binary=binary
                    )
                )
            cli_tls = ["--tls", "--cacert", tls[0]] if tls is not None else []
            subprocess.run(
                ["redis-cli", *cli_tls, "--cluster", "create",
                 *[f"127.0.0.1:{s.port}" for s in cluster.servers], "--cluster-yes",
                 "--cluster-replicas", str(replicas)],
                capture_output=True, check=True, timeout=30,
            )  # fmt: skip
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not all(_ready(s) for s in cluster.servers):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not become ok")
                time.sleep(0.05)  # polling for cluster state, bounded by the deadline
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def master_of(self, key: str) -> RedisServer:
        """The live master that holds keys of ``key``'s slot (the slot must hold some)."""
        live = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
        if not live:
            raise LookupError("no node of the cluster is running")
        # (a live node's answer: servers[0] may be the master a test killed; its redis-cli
        # printed nothing, and every live master's count of slot "" passed for its keys)
        slot = live[0].cli("CLUSTER", "KEYSLOT", key)
        for s in live:
            if _is_master(s) and s.cli("CLUSTER", "COUNTKEYSINSLOT", slot) != "0":
                return s
        raise LookupError(f"no live master holds keys of slot {slot}")

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{s.port}" for s in self.servers)
        cert = self.servers[0].tls_cert if self.servers else ""
        if cert:
            return f"rediss+cluster://{nodes}?ssl_ca_certs={cert}"
        return f"redis+cluster://{nodes}"

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
