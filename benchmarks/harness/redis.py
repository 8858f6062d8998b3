"""Real ``redis-server`` processes on loopback with ephemeral ports (tests and benchmarks).

``RedisServer.start(tmp)``: one server, persistence off, its log in ``tmp`` (``binary``: another
server of the same protocol, e.g. a ``valkey-server``); ``kill()`` (SIGKILL,
data lost as in a crash) and ``restart()`` (same port) for failure tests. ``RedisCluster``
starts N servers with ``--cluster-enabled yes`` and joins them with ``redis-cli --cluster
create`` (masters only). Both wait until the server answers PING / the cluster is ``ok``.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.ports import free_port as _free_port

READY_TIMEOUT_S = 60.0


def _cli(port: int, *args: str, timeout: float = 10.0, cacert: str = "") -> str:
    tls = ["--tls", "--cacert", cacert] if cacert else []
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *tls, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout.strip()


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
        except subprocess.TimeoutExpired:  # a loaded machine: ask again until the deadline
            return False
        for line in info.splitlines():
            if line.startswith("process_id:"):
                return line.partition(":")[2].strip() == str(pid)
        return False

    def cli(self, *args: str) -> str:
        return _cli(self.port, *args, cacert=self.tls_cert)

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
        slot = self.servers[0].cli("CLUSTER", "KEYSLOT", key)
        for s in self.servers:
            alive = s.proc is not None and s.proc.poll() is None
            if alive and _is_master(s) and s.cli("CLUSTER", "COUNTKEYSINSLOT", slot) != "0":
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
