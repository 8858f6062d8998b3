"""Safe by default, on a real daemon started without any auth option: a random token in a
private file that this user's clients pick up by themselves (and present at the ZMQ handshake);
TCP without it is refused, health stays open; ``--no-auth`` opts out. (Another user cannot
read the 0600 file in the 0700 directory; that is the file modes checked here: this machine's
users cannot run its Python.)"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserver import wire
from kvserver.client import KVClient
from kvserver.grpc_client import GrpcClient
from kvserver.token_file import SHM_DIR_ENV, token_dir, token_path
from tests.kvserver.builders import make_keys, make_spec
from tests.support.daemon import DaemonProc, port_kept, raw_dealer, start_daemon, wait_until

pytestmark = pytest.mark.multiprocess


def raw_request(address: str, frame: bytes, token: str | None = None) -> wire.Reply:
    """``frame``'s reply on a bare DEALER presenting ``token`` at the handshake (None: the
    token file's)."""
    sock = raw_dealer(address, token)
    try:
        sock.send(frame)
        assert sock.poll(10_000)
        return wire.decode_reply(sock.recv_multipart()[0])
    finally:
        sock.close()


def handshakes_not_admitted(address: str) -> int:
    """Handshakes refused by the daemon's ZAP handler or failed before (no token at all)."""
    with KVClient(address, colocated=False) as kv:
        counts = kv.stats()["handshakes"]
        return int(counts["refused"] + counts["failed"])


def test_a_daemon_without_options_requires_its_own_random_token(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)
    try:
        paths = [token_path(d.info["zmq_port"]), token_path(d.info["grpc_port"])]
        for path in paths:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert len(d.token) >= 32

        spec = make_spec(model="test/default-auth")
        keys = make_keys(2, tag="default-auth")
        with KVClient(d.zmq_address, colocated=False) as kv:  # finds the token by itself
            ns = kv.register_namespace(spec)
            parts = [[bytes([i]) * spec.part_bytes] for i in range(2)]
            assert kv.store(ns.ns_id, keys, parts) == keys
        with GrpcClient(d.grpc_address) as g:
            assert g.lookup_keys(ns.ns_id, keys).hit_chunks == 2

        # TCP without the token: refused at the handshake, before any message is read
        # (test_handshake_auth.py); with it at the handshake, each request still needs it
        for token in ("", "not-the-token"):
            before = handshakes_not_admitted(d.zmq_address)
            sock = raw_dealer(d.zmq_address, token)
            try:
                sock.send(wire.encode_request(3, wire.NAMESPACES, {}))
                wait_until(lambda b=before: handshakes_not_admitted(d.zmq_address) > b)
                assert not sock.poll(0)
            finally:
                sock.close()
        reply = raw_request(d.zmq_address, wire.encode_request(3, wire.NAMESPACES, {}))
        assert reply.error is not None and reply.error.code == "unauthenticated"
        with grpc.insecure_channel(d.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/kvserver.v1.KVServer/ListNamespaces")(b"", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            check = health_pb2_grpc.HealthStub(channel).Check
            status = check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert d.terminate() == 0
    assert not any(Path(p).exists() for p in paths)


def test_no_auth_opts_out(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--no-auth")
    try:
        assert not Path(token_path(d.info["zmq_port"])).exists()
        assert raw_request(d.zmq_address, wire.encode_request(3, wire.NAMESPACES, {}), "").ok
    finally:
        assert d.terminate() == 0


def test_no_auth_removes_a_token_file_left_for_its_port(tmp_path: Path) -> None:
    """A daemon SIGKILLed on a port leaves its token file; a --no-auth daemon that gets the
    same port removes it (else same-user clients would send a stale token)."""
    killed = start_daemon(tmp_path / "killed", *port_kept())
    port = killed.info["zmq_port"]
    killed.kill()
    assert Path(token_path(port)).exists()
    d = start_daemon(tmp_path / "open", "--no-auth", "--zmq-port", str(port))
    try:
        assert not Path(token_path(port)).exists()
        assert raw_request(d.zmq_address, wire.encode_request(3, wire.NAMESPACES, {})).ok
    finally:
        assert d.terminate() == 0


def test_a_daemon_removes_the_token_files_of_killed_daemons_at_start(tmp_path: Path) -> None:
    """A daemon SIGKILLed leaves its token files (and arena); the next daemon to start in
    that directory removes them, and its own when it exits cleanly."""
    shm = tempfile.mkdtemp(dir=os.environ[SHM_DIR_ENV])  # no other test's daemons in it
    env = {SHM_DIR_ENV: shm}

    def files_of(d: DaemonProc) -> set[str]:
        ports = (d.info["zmq_port"], d.info["grpc_port"], d.info["peer_stream_port"])
        return {os.path.basename(token_path(port, shm)) for port in ports}

    killed = start_daemon(tmp_path / "killed", env=env)
    killed.kill()
    assert set(os.listdir(token_dir(shm))) == files_of(killed) and len(files_of(killed)) == 3

    d = start_daemon(tmp_path / "next", env=env)
    try:
        assert set(os.listdir(token_dir(shm))) == files_of(d)
        arena = os.path.basename(d.arena_path)  # the killed ones' arenas are gone too
        tokens = os.path.basename(token_dir(shm))
        assert set(os.listdir(shm)) == {tokens, arena, f"{arena}.sock"}
    finally:
        assert d.terminate() == 0
    assert os.listdir(token_dir(shm)) == []


def test_a_grpc_client_presents_a_restarted_daemons_new_token(tmp_path: Path) -> None:
    """The client reads the token file once, and again only when the daemon refuses the
    token: a daemon restarted on the same port (a new random token) is reached by the same
    client, which retries the refused call once."""
    d = start_daemon(tmp_path / "first", *port_kept("--grpc-port"))
    try:
        with GrpcClient(d.grpc_address) as g:
            spec = make_spec(model="test/restart-token")
            ns_id = g.register_namespace(spec).namespace_id
            first = d.token
            assert d.terminate() == 0
            d = start_daemon(tmp_path / "second", "--grpc-port", str(d.info["grpc_port"]))
            assert d.token != first
            assert g.list_namespaces() == []
            assert g.register_namespace(spec).namespace_id == ns_id
    finally:
        assert d.terminate() == 0
