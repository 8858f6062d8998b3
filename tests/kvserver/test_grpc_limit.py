"""kvserver/grpc_limit.py against the real servers: idle HTTP/2 connections (the client preface,
an empty SETTINGS and the ACK of the server's, then nothing) held open on the daemon's gRPC port
and the scheduler's engine port. One address holding many is cut to its share and another client
is served; many addresses together never take the daemon to its descriptor limit. Before: every
connection was kept for ever (4,000 from one address: +54 MB and +4,000 descriptors in the
daemon)."""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvserver.grpc_limit import MAX_CONNECTIONS_PER_ADDRESS
from tests.scheduler.procs import EngineClient, start_scheduler
from tests.support.daemon import DaemonProc, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess

#: the HTTP/2 client connection preface, an empty SETTINGS frame and the ACK of the server's
#: (RFC 9113 §3.4, §6.5): without the ACK gRPC closes the connection after ~60 s by itself
PREFACE = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    + bytes([0, 0, 0, 4, 1, 0, 0, 0, 0])
)
WAIT_S = 60.0  # the servers count every 0.5 s; a loaded machine may take far longer


class IdleConnections:
    """``count`` idle HTTP/2 connections to ``port``, from 127.0.0.2 and on (``sources``
    addresses in turn)."""

    def __init__(self, port: int, count: int, sources: int = 1) -> None:
        self.socks: list[socket.socket] = []
        for i in range(count):
            s = socket.socket()
            self.socks.append(s)
            s.bind((f"127.0.0.{2 + i % sources}", 0))
            s.connect(("127.0.0.1", port))
            s.sendall(PREFACE)
            s.setblocking(False)
        self._closed: set[int] = set()

    def closed(self) -> int:
        """How many the server has closed so far (their end read)."""
        for i, s in enumerate(self.socks):
            if i in self._closed:
                continue
            try:
                while s.recv(65536):  # the server's SETTINGS (and GOAWAY) read and dropped
                    pass
                self._closed.add(i)
            except BlockingIOError:
                pass
            except OSError:  # reset
                self._closed.add(i)
        return len(self._closed)

    def close(self) -> None:
        for s in self.socks:
            s.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path, "--dram", "16MiB")
    try:
        yield d
    finally:
        d.terminate()


def lookup(d: DaemonProc, channel: grpc.Channel) -> grpc.StatusCode:
    """An authenticated Lookup of an unknown namespace: NOT_FOUND when it was served."""
    call = channel.unary_unary("/kvserver.v1.KVServer/Lookup")
    try:
        call(bytes([0x0A, 4]) + b"none", timeout=30,
             metadata=(("authorization", f"Bearer {d.token}"),))  # fmt: skip
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_one_address_holding_idle_connections_is_cut_to_its_share_and_others_served(
    daemon: DaemonProc,
) -> None:
    count = MAX_CONNECTIONS_PER_ADDRESS + 200
    before = fds(daemon.proc.pid)
    idle = IdleConnections(int(daemon.info["grpc_port"]), count)
    try:
        wait_until(lambda: idle.closed() >= count - MAX_CONNECTIONS_PER_ADDRESS, WAIT_S)
        assert idle.closed() == count - MAX_CONNECTIONS_PER_ADDRESS  # the oldest are kept
        # gRPC closes a descriptor once it has seen the connection's end
        wait_until(lambda: fds(daemon.proc.pid) <= before + MAX_CONNECTIONS_PER_ADDRESS + 8, WAIT_S)
        with grpc.insecure_channel(daemon.grpc_address) as channel:
            assert lookup(daemon, channel) == grpc.StatusCode.NOT_FOUND
        assert (
            f"connections shut down (127.0.0.2 held more than {MAX_CONNECTIONS_PER_ADDRESS}, "
            in (daemon.log())
        )
    finally:
        idle.close()
    assert daemon.proc.poll() is None


def test_the_daemons_share_per_address_is_a_setting(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--dram", "16MiB",
                     env={"KVSERVER_GRPC_MAX_CONNECTIONS_PER_ADDRESS": "8"})  # fmt: skip
    idle = IdleConnections(int(d.info["grpc_port"]), 40)
    try:
        wait_until(lambda: idle.closed() >= 32, WAIT_S)
        with grpc.insecure_channel(d.grpc_address) as channel:
            assert lookup(d, channel) == grpc.StatusCode.NOT_FOUND
        assert idle.closed() == 32
    finally:
        idle.close()
        d.terminate()


def test_many_addresses_never_take_the_daemon_to_its_descriptor_limit(tmp_path: Path) -> None:
    """Soft limit 256 descriptors: at most 128 gRPC connections; 300 from 30 addresses (10
    each, under the per-address share) took every descriptor the daemon had."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        d = start_daemon(tmp_path, "--dram", "16MiB")  # inherits the soft limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    idle = None
    try:
        with grpc.insecure_channel(d.grpc_address) as channel:
            assert lookup(d, channel) == grpc.StatusCode.NOT_FOUND  # connected before
            idle = IdleConnections(int(d.info["grpc_port"]), 300, sources=30)
            wait_until(lambda: idle.closed() >= 300 - 127, WAIT_S)  # 128 less the channel
            wait_until(lambda: fds(d.proc.pid) < 256 - 64, WAIT_S)
            assert lookup(d, channel) == grpc.StatusCode.NOT_FOUND
            idle.close()
            idle = None
            with grpc.insecure_channel(d.grpc_address) as fresh:  # served once they are gone
                assert lookup(d, fresh) == grpc.StatusCode.NOT_FOUND
    finally:
        if idle is not None:
            idle.close()
        d.terminate()


def test_the_schedulers_engine_port_cuts_one_address_to_its_share(tmp_path: Path) -> None:
    sched = start_scheduler(tmp_path, "--synthetic-workers", "1", "--metrics-port", "-1")
    count = MAX_CONNECTIONS_PER_ADDRESS + 100
    idle = IdleConnections(int(sched.info["grpc_port"]), count)
    try:
        wait_until(lambda: idle.closed() >= count - MAX_CONNECTIONS_PER_ADDRESS, WAIT_S)
        with EngineClient(sched.info["grpc_port"]) as client:
            assert client.stats() is not None
    finally:
        idle.close()
        assert sched.terminate() == 0


def test_the_schedulers_share_per_address_is_a_flag(tmp_path: Path) -> None:
    """``kvserver scheduler --grpc-max-connections-per-address 8``: 40 idle connections from
    one address are cut to 8 (the daemon's setting of that name, on the scheduler's engine
    port); a client is still served."""
    sched = start_scheduler(tmp_path, "--synthetic-workers", "1", "--metrics-port", "-1",
                            "--grpc-max-connections-per-address", "8")  # fmt: skip
    idle = IdleConnections(int(sched.info["grpc_port"]), 40)
    try:
        wait_until(lambda: idle.closed() >= 32, WAIT_S)
        with EngineClient(sched.info["grpc_port"]) as client:
            assert client.stats() is not None
        assert idle.closed() == 32
    finally:
        idle.close()
        assert sched.terminate() == 0
