"""CURVE on the ZMQ sockets and TLS on gRPC, on a real daemon: keys and certificates made by
``kvserver keys``, clients that have them are served, clients that lack them are not; a
daemon bound beyond loopback refuses to start without them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import zmq

from kvserver import wire
from kvserver.client import KVClient
from kvserver.crypto import (
    CLIENT_OPTIONS,
    ClientSecurity,
    CurveClient,
    TlsClient,
    add_client_security_args,
    is_loopback,
)
from kvserver.daemon.config import DaemonConfig
from kvserver.errors import InvalidArgument, KVServerError
from kvserver.grpc_client import GrpcClient
from tests.kvserver.builders import make_keys, make_spec
from tests.support.daemon import start_daemon, wait_until

pytestmark = pytest.mark.multiprocess


def keys(directory: Path, kind: str, name: str, *extra: str) -> list[str]:
    """Run ``kvserver keys KIND DIR --name NAME ...``; the paths it printed."""
    cli = [sys.executable, "-m", "kvserver.cli", "keys"]
    out = subprocess.run(
        [*cli, kind, str(directory), "--name", name, *extra],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.split()


def test_keys_are_made_with_private_files_and_never_overwritten(tmp_path: Path) -> None:
    public, secret = keys(tmp_path, "curve", "server")
    cert, key = keys(tmp_path, "tls", "server", "--host", "127.0.0.1")
    assert (Path(secret).stat().st_mode & 0o777, Path(key).stat().st_mode & 0o777) == (
        0o600,
        0o600,
    )
    assert Path(public).read_text().count("public-key") == 1
    assert "BEGIN CERTIFICATE" in Path(cert).read_text()
    again = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "keys", "curve", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr


@pytest.mark.parametrize(
    "host, loopback",
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("10.0.0.5", False), ("::", False), ("kvserver", False)],
)  # fmt: skip
def test_a_host_beyond_loopback_needs_curve_and_tls_or_an_explicit_flag(
    host: str, loopback: bool
) -> None:
    assert is_loopback(host) is loopback
    if loopback:
        DaemonConfig(host=host)
        return
    with pytest.raises(InvalidArgument, match="curve_secret_key_file and tls_cert_file"):
        DaemonConfig(host=host)
    with pytest.raises(InvalidArgument, match="tls_cert_file"):
        DaemonConfig(host=host, curve_secret_key_file="/k")
    DaemonConfig(host=host, insecure_remote=True)
    DaemonConfig(host=host, curve_secret_key_file="/k", tls_cert_file="/c", tls_key_file="/p")


def test_the_daemon_refuses_to_listen_beyond_loopback_in_clear(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "start", "--host", "0.0.0.0", "--grpc-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--insecure-remote" in proc.stderr


def test_curve_and_tls_serve_clients_with_keys_and_nobody_else(tmp_path: Path) -> None:
    """CURVE ROUTER + PUB, TLS gRPC: a CURVE client stores and loads, a CURVE subscriber gets
    the events; a plain ZMQ client and a plain gRPC channel get nothing."""
    server_key, server_secret = keys(tmp_path, "curve", "server")
    cert, key = keys(tmp_path, "tls", "server", "--host", "127.0.0.1", "--host", "localhost")
    d = start_daemon(
        tmp_path,
        "--curve-secret-key-file",
        server_secret,
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key,
    )
    curve = CurveClient.from_files(server_key)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        spec = make_spec(model="test/curve")
        with KVClient(d.zmq_address, curve=curve, colocated=False) as kv:
            ns = kv.register_namespace(spec)
            chunk_keys = make_keys(3, tag="curve")
            parts = [[bytes([i]) * spec.part_bytes] for i in range(3)]
            assert kv.store(ns.ns_id, chunk_keys, parts) == chunk_keys
            assert [[bytes(p) for p in r] for r in kv.load(ns.ns_id, chunk_keys)] == parts

            sub.linger = 0
            curve.apply(sub)
            sub.setsockopt(zmq.SUBSCRIBE, wire.TOPIC_PREFIX.encode())
            sub.connect(d.pub_address)
            probes = iter(make_keys(500, tag="probe"))

            def event_arrives() -> bool:
                kv.store(ns.ns_id, [next(probes)], [[bytes(spec.part_bytes)]])
                return sub.poll(50) != 0

            wait_until(event_arrives)
            assert sub.recv_multipart()[0].startswith(wire.TOPIC_PREFIX.encode())

        with (
            KVClient(d.zmq_address, colocated=False, timeout=1.0) as plain,
            pytest.raises(KVServerError),
        ):
            plain.hello()

        with GrpcClient(d.grpc_address, tls=TlsClient(cert)) as g:
            assert ns.ns_id in {n.namespace_id for n in g.list_namespaces()}
        channel = grpc.insecure_channel(d.grpc_address)
        with pytest.raises(grpc.RpcError):
            channel.unary_unary("/kvserver.v1.KVServer/Stats")(b"", timeout=2)
        channel.close()
    finally:
        sub.close()
        assert d.terminate() == 0


def test_mutual_tls_and_a_curve_client_list(tmp_path: Path) -> None:
    """With a client CA, only gRPC clients with a certificate it signed are served; with a
    CURVE clients directory, only listed client keys are."""
    server_key, server_secret = keys(tmp_path, "curve", "server")
    clients = tmp_path / "clients"
    _listed_key, listed_secret = keys(clients, "curve", "router")
    _stranger_key, stranger_secret = keys(tmp_path / "elsewhere", "curve", "stranger")
    cert, key = keys(tmp_path, "tls", "server", "--host", "127.0.0.1")
    client_cert, client_key = keys(tmp_path, "tls", "client", "--host", "router.example")
    d = start_daemon(
        tmp_path,
        "--curve-secret-key-file",
        server_secret,
        "--curve-clients-dir",
        str(clients),
        "--tls-cert-file",
        cert,
        "--tls-key-file",
        key,
        "--tls-client-ca-file",
        client_cert,
    )
    try:
        listed = CurveClient.from_files(server_key, listed_secret)
        with KVClient(d.zmq_address, curve=listed, colocated=False) as kv:
            assert kv.hello()["protocol_version"] == wire.PROTOCOL_VERSION
        stranger = CurveClient.from_files(server_key, stranger_secret)
        with (
            KVClient(d.zmq_address, curve=stranger, colocated=False, timeout=1.0) as kv,
            pytest.raises(KVServerError),
        ):
            kv.hello()

        with GrpcClient(d.grpc_address, tls=TlsClient(cert, client_cert, client_key)) as g:
            assert g.stats().server_version
        with (
            GrpcClient(d.grpc_address, tls=TlsClient(cert), timeout=2.0) as g,
            pytest.raises(KVServerError),
        ):
            g.stats()
    finally:
        assert d.terminate() == 0


def test_client_options_are_one_vocabulary_checked_up_front(tmp_path: Path) -> None:
    """docs/security.md "Client options": the same names as flags and mapping keys; bad
    combinations and unreadable files are errors naming them, before anything connects."""
    import argparse

    parser = argparse.ArgumentParser()
    add_client_security_args(parser, curve=True, tls=True)
    args = parser.parse_args(["--curve-server-key-file", "/s.key", "--tls-ca-file", "/ca"])
    assert ClientSecurity.from_mapping(args) == ClientSecurity.from_mapping(
        {"curve_server_key_file": "/s.key", "tls_ca_file": "/ca"}
    )
    assert {a.dest for a in parser._actions} - {"help"} == set(CLIENT_OPTIONS)
    assert ClientSecurity().curve() is None and ClientSecurity().tls() is None
    for bad, needle in [
        ({"curve_secret_key_file": "/k"}, "needs curve_server_key_file"),
        ({"tls_ca_file": "/ca", "tls_cert_file": "/c"}, "go together"),
        ({"tls_server_name": "kv"}, "need tls_ca_file"),
    ]:
        with pytest.raises(InvalidArgument, match=needle):
            ClientSecurity.from_mapping(bad)
    with pytest.raises(InvalidArgument, match="cannot read CURVE key file /absent"):
        ClientSecurity(curve_server_key_file="/absent").curve()
    with pytest.raises(InvalidArgument, match="cannot read TLS CA /absent"):
        ClientSecurity(tls_ca_file="/absent").tls()
    public, secret = keys(tmp_path, "curve", "server")
    curve = ClientSecurity(curve_server_key_file=public, curve_secret_key_file=secret).curve()
    assert curve is not None and curve.server_key == curve.public_key  # its own pair here


@pytest.mark.parametrize(
    "command",
    [
        ["scheduler", "--synthetic-workers", "1", "--kvserver", "tcp://10.0.0.5:9471"],
        ["worker", "--rank", "0", "--world-size", "1", "--listen", "tcp://127.0.0.1:0",
         "--dist-init", "tcp://127.0.0.1:1", "--model-file", "/absent.safetensors",
         "--write-random-model-seed", "1", "--kvserver", "tcp://10.0.0.5:9471"],
    ],
)  # fmt: skip
def test_scheduler_and_worker_refuse_an_unreadable_key_file(command: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", *command,
         "--curve-server-key-file", "/absent/server.key"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "cannot read CURVE key file /absent/server.key" in proc.stderr


def test_every_failed_handshake_is_explained_in_the_option_names() -> None:
    """kvserver/client/handshake.py: what each monitor event of a client socket means, for
    each of its mechanisms (none, a token: PLAIN, CURVE keys)."""
    from kvserver.client.handshake import explain

    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    assert explain(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, "curve") is None
    cases = [
        (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, "curve", "curve_clients_dir"),
        (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, "plain", "refused this client's auth token"),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, "curve", "curve_server_key_file is not"),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, "null", "probably requires a token"),
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, "plain", "probably requires CURVE"),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, "null", "requires a token at the"),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, "plain", "takes no token"),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, "curve", "does not use CURVE"),
        (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x10000001, "curve", "ZMTP protocol error"),
    ]
    for event, value, mechanism, needle in cases:
        why = explain(event, value, mechanism)
        assert why is not None and needle in str(why), (event, value, mechanism, why)
        # a refused or a missing token: worth re-reading the token file (Unauthenticated)
        unauthenticated = (event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and mechanism == "plain") or (
            event != zmq.EVENT_HANDSHAKE_FAILED_AUTH and mechanism == "null"
        )
        assert why.unauthenticated == unauthenticated
