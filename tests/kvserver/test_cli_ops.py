"""``kvserver status`` and ``kvserver lookup`` (kvserver/cli_ops.py), driven through a tiny local
parser against an in-process gRPC front end, plus the real CLI against a real daemon."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserver import cli_ops
from kvserver.cli import main
from tests.kvserver.builders import make_spec
from tests.kvserver.daemon.test_grpc_server import InProcessServer, chunk_keys
from tests.support.daemon import start_daemon
from tests.support.ports import free_port


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Parse ``argv`` with a parser holding only the two commands and run the handler."""
    parser = argparse.ArgumentParser(prog="kvserver")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_ops.add_status(sub)
    cli_ops.add_lookup(sub)
    args = parser.parse_args(argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    srv = InProcessServer(tmp_path)
    yield srv
    srv.close()


def test_status_table_and_json(server: InProcessServer, capsys: pytest.CaptureFixture[str]) -> None:
    spec = make_spec(model="llama/8b")
    ns_id = server.register(spec)
    server.store(ns_id, chunk_keys(spec, list(range(48))))
    rc, out, err = run(capsys, "status", "--server", server.address)
    assert rc == 0 and err == ""
    assert "TIER" in out and "EVICTIONS" in out and "NAMESPACE" in out
    assert "fleet: none (standalone; kvserver start --cluster URL joins one)" in out
    assert "ssd: none (kvserver start --ssd-dir DIR --ssd SIZE adds one)" in out
    dram_row = next(line for line in out.splitlines() if line.startswith("dram"))
    assert dram_row.split()[:3] == ["dram", "CPU", "chain"] and "1.0 MiB" in dram_row
    ns_row = next(line for line in out.splitlines() if line.startswith(ns_id))
    assert "llama/8b" in ns_row and "dram:3" in ns_row
    rc, out, _ = run(capsys, "status", "--server", server.address, "--json")
    data = json.loads(out)
    assert rc == 0 and data["tiers"][0]["entries"] == 3
    assert data["namespaces"][0]["namespace_id"] == ns_id


def test_status_of_a_daemon_without_events_says_so(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh daemon's event log was shown as "events: seq 1..0"."""
    rc, out, _ = run(capsys, "status", "--server", server.address)
    assert rc == 0 and "  events: none yet (log " in out
    spec = make_spec(model="llama/8b")
    server.store(server.register(spec), chunk_keys(spec, list(range(16))))
    rc, out, _ = run(capsys, "status", "--server", server.address)
    assert rc == 0 and "  events: seq 1..1 (log " in out


def test_lookup_prints_hit_and_tier_split(
    server: InProcessServer,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_spec(model="m")
    ns_id = server.register(spec)
    tokens = list(range(100))  # 6 full chunks of 16 + 4 tokens
    server.store(ns_id, chunk_keys(spec, tokens)[:2])
    rc, out, err = run(
        capsys,
        "lookup",
        "--server",
        server.address,
        "--model",
        "m",
        "--tokens",
        ",".join(map(str, tokens)),
    )
    assert rc == 0, err
    assert "hit: 32 of 100 tokens, 2 of 6 chunks (33.3%)" in out
    assert "tiers: dram 2 chunks (32 tokens)" in out and ns_id in out
    path = tmp_path / "tokens.txt"
    path.write_text(" ".join(map(str, tokens)) + "\n")
    rc, out, _ = run(
        capsys,
        "lookup",
        "--server",
        server.address,
        "--model",
        "m",
        "--tokens-file",
        str(path),
        "--json",
    )
    assert rc == 0
    assert json.loads(out) == {
        "namespace_id": ns_id,
        "model": "m",
        "num_tokens": 100,
        "hit_tokens": 32,
        "hit_chunks": 2,
        "num_chunks": 6,
        "chunk_tokens": 16,
        "tiers": {"dram": 2},
    }
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(map(str, tokens))))
    rc, out, _ = run(
        capsys,
        "lookup",
        "--server",
        server.address,
        "--model",
        "m",
        "--tokens-file",
        "-",
        "--cache-salt",
        "other-tenant",
    )
    assert rc == 0 and "hit: 0 of 100 tokens" in out


def test_lookup_picks_the_namespace(
    server: InProcessServer, capsys: pytest.CaptureFixture[str]
) -> None:
    a = server.register(make_spec(model="m"))
    b = server.register(make_spec(model="m", hash_algo="xxhash_cbor"))
    base = ("lookup", "--server", server.address, "--tokens", "1,2,3")
    rc, _, err = run(capsys, *base, "--model", "m")
    assert rc == 2 and "--namespace" in err and a in err and b in err
    rc, out, _ = run(capsys, *base, "--model", "m", "--namespace", b)
    assert rc == 0 and b in out and "xxhash_cbor" in out
    rc, _, err = run(capsys, *base, "--model", "m", "--namespace", "ffffffffffffffff")
    assert rc == 1 and "not registered" in err
    rc, _, err = run(capsys, *base, "--model", "nope")
    assert rc == 1 and "no namespace is registered for model 'nope'" in err and "'m'" in err


def test_bad_arguments_exit_2(server: InProcessServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.register(make_spec(model="m"))
    base = ("lookup", "--server", server.address, "--model", "m")
    assert run(capsys, *base, "--tokens", "1,x,3")[0] == 2
    assert run(capsys, *base, "--tokens", "-5")[0] == 2
    assert run(capsys, *base, "--tokens", "1", "--lora", "nocolon")[0] == 2
    rc, _, err = run(capsys, *base, "--tokens-file", "/nonexistent/tokens")
    assert rc == 2 and "cannot read" in err
    assert run(capsys, "status", "--server", server.address, "--timeout", "0")[0] == 2
    assert cli_ops.parse_tokens("1, 2\n3\t4,,") == [1, 2, 3, 4]


def test_unreachable_daemon_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    for argv in (("status",), ("lookup", "--model", "m", "--tokens", "1")):
        started = time.monotonic()
        rc, out, err = run(capsys, *argv, "--server", address, "--timeout", "2")
        assert rc == 1 and out == ""
        assert f"cannot reach the daemon at {address}; is `kvserver start` running" in err
        assert time.monotonic() - started < 10


@pytest.mark.multiprocess
def test_status_at_the_daemons_zmq_or_metrics_port_names_the_grpc_port(tmp_path: Path) -> None:
    """``kvserver status --server HOST:9471`` (the data port, or 9473: metrics) said "cannot
    reach the daemon ... is `kvserver start` running there?" of a daemon that was running."""
    d = start_daemon(tmp_path, "--dram", "2MiB")
    try:
        for port in (d.info["zmq_port"], d.info["zmq_port"], d.info["metrics_port"]):
            status = subprocess.run(
                [sys.executable, "-m", "kvserver.cli", "status", "--server",
                 f"127.0.0.1:{port}", "--timeout", "5"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert status.returncode == 1 and status.stdout == ""
            first = status.stderr.splitlines()[0]
            assert f"127.0.0.1:{port} answered, but not as a gRPC server" in first, first
            assert "--grpc-port`, 9470 by default" in first
    finally:
        assert d.terminate() == 0, d.log()


def test_auth_token_from_flag_or_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = InProcessServer(tmp_path, auth_token="tok")
    try:
        monkeypatch.delenv("KVSERVER_AUTH_TOKEN", raising=False)
        # no token file either: a daemon SIGKILLed earlier on this port may have left one in
        # the shared token directory, and the CLI would send its (wrong) token
        monkeypatch.setenv("KVSERVER_SHM_DIR", str(tmp_path / "shm"))
        rc, _, err = run(capsys, "status", "--server", srv.address)
        assert rc == 1 and "Bearer" in err
        assert "pass --auth-token-file FILE or --auth-token TOKEN" in err  # what to do
        assert run(capsys, "status", "--server", srv.address, "--auth-token", "tok")[0] == 0
        monkeypatch.setenv("KVSERVER_AUTH_TOKEN", "tok")
        assert run(capsys, "status", "--server", srv.address)[0] == 0
    finally:
        srv.close()


def cli_has_status() -> bool:
    from kvserver.cli import build_parser

    try:
        build_parser().parse_args(["status", "--help"])
    except SystemExit as exc:
        return exc.code == 0
    return False


@pytest.mark.multiprocess
def test_real_cli_against_real_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not cli_has_status():
        pytest.skip("kvserver/cli.py does not wire `status` / `lookup` yet")
    capsys.readouterr()
    proc = start_daemon(tmp_path, "--dram", "2MiB", "--auth-token", "t0k")
    try:
        env_args = [sys.executable, "-m", "kvserver.cli"]
        common = ["--server", proc.grpc_address, "--auth-token", "t0k"]
        status = subprocess.run(
            [*env_args, "status", *common, "--json"], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["tiers"][0]["capacity_bytes"] == 2 << 20
        lookup = subprocess.run(
            [*env_args, "lookup", *common, "--model", "none", "--tokens", "1,2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert lookup.returncode == 1 and "no namespace" in lookup.stderr
        assert proc.terminate() == 0
    finally:
        proc.kill()


@pytest.mark.multiprocess
def test_status_names_a_fixed_peer_list_as_such(tmp_path: Path) -> None:
    """A daemon with --peers is not standalone: its status says where the peers went."""
    proc = start_daemon(tmp_path, "--dram", "2MiB", "--peers", f"tcp://127.0.0.1:{free_port()}")
    try:
        status = subprocess.run(
            [sys.executable, "-m", "kvserver.cli", "status", "--server", proc.grpc_address],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert "fleet: none (a fixed list of peers, --peers: the peer tier below)" in status.stdout
        assert any(line.startswith("peer ") for line in status.stdout.splitlines())
        assert proc.terminate() == 0
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("given", "target"),
    [
        ("127.0.0.1", "127.0.0.1:9470"),
        ("kvserver", "kvserver:9470"),
        ("127.0.0.1:9", "127.0.0.1:9"),
        ("[::1]", "[::1]:9470"),
        ("::1", "[::1]:9470"),
        ("[::1]:5", "[::1]:5"),
        ("dns:///kvserver:9470", "dns:///kvserver:9470"),
        ("tcp://127.0.0.1:5", "127.0.0.1:5"),  # was: "Misformatted domain name"
        ("tcp://kvserver", "kvserver:9470"),
        ("unix:/run/kvserver.sock", "unix:/run/kvserver.sock"),
    ],
)
def test_server_without_a_port_gets_the_daemons_grpc_port(given: str, target: str) -> None:
    """--server 127.0.0.1 dialled 443 (gRPC's default) instead of the daemon's 9470."""
    assert cli_ops.server_address(given) == target


@pytest.mark.parametrize("server", ["127.0.0.1:99999", "[::1]:0", "kv-host:", "h:9x"])
def test_a_server_port_that_is_not_1_to_65535_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], server: str
) -> None:
    """Was: gRPC dialled it modulo 65536 (:99999 reached port 34463) and the error said
    'cannot reach the daemon at 127.0.0.1:99999; is `kvserver start` running there?'."""
    with pytest.raises(SystemExit) as info:
        main(["status", "--server", server, "--timeout", "1"])
    assert info.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"kvserver status: error: argument --server: {server!r}: port "), line
    assert line.endswith("is not 1-65535; kvserver status --help lists its options"), line


@pytest.mark.parametrize(
    ("scheme", "tls"), [("http", ""), ("https", "; over TLS, with --tls-ca-file FILE")]
)
def test_a_server_given_as_a_url_is_a_usage_error_saying_host_port(scheme: str, tls: str) -> None:
    """Was: gRPC took the URL for a host name, waited out --timeout and said "cannot reach the
    daemon at http://127.0.0.1:9470 within 5s; is `kvserver start` running there?" ("errors
    resolving ...: Misformatted domain name"), exit 1, with the daemon running there."""
    url = f"{scheme}://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "status", "--server", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"kvserver status: error: argument --server: {url!r} is a URL: give the daemon's gRPC "
        f"address as HOST[:PORT], e.g. 127.0.0.1:9470{tls}; kvserver status --help lists its "
        "options"
    )


def test_status_server_without_port_reaches_the_default_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, _out, err = run(capsys, "status", "--server", "127.0.0.2", "--timeout", "0.5")
    assert rc == 1 and "127.0.0.2:9470" in err


@pytest.mark.multiprocess
def test_a_daemon_with_another_shm_dir_says_where_its_clients_find_its_token(
    tmp_path: Path,
) -> None:
    """``kvserver start --shm-dir DIR`` leaves its token under DIR, where ``kvserver status``
    looks only when KVSERVER_SHM_DIR says so: status said "only the user who started it
    finds it by itself" to that very user, and the start-up line did not say either."""
    shm = tmp_path / "shm"
    shm.mkdir()
    d = start_daemon(tmp_path, "--dram", "2MiB", "--shm-dir", str(shm))
    try:
        line = next(x for x in d.log().splitlines() if "kvserver listening:" in x)
        assert f"find it in {shm}/kvserver-tokens-" in line
        assert f" when KVSERVER_SHM_DIR={shm} is set for them)" in line
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVER_")}
        cmd = [sys.executable, "-m", "kvserver.cli", "status", "--server", d.grpc_address]
        alone = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert alone.returncode == 1, alone.stderr
        assert "for a daemon started with --shm-dir DIR, set KVSERVER_SHM_DIR=DIR)" in (
            alone.stderr
        )
        told = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              env={**env, "KVSERVER_SHM_DIR": str(shm)})  # fmt: skip
        assert told.returncode == 0, told.stderr
    finally:
        assert d.terminate() == 0, d.log()


@pytest.mark.multiprocess
def test_tls_on_one_side_only_is_said_so_not_called_unreachable(tmp_path: Path) -> None:
    """A client in clear text at a TLS daemon (``--keys-dir``), or a TLS client at a daemon
    in clear text: both were "cannot reach the daemon ... within 5s; is `kvserver start`
    running there?" of a daemon that was running, the second under a line of gRPC's C core
    ("I1206 ... ssl_transport_security.cc] Handshake failed ...")."""
    keys = tmp_path / "keys"
    secure = start_daemon(tmp_path / "a", "--dram", "2MiB", "--keys-dir", str(keys))
    plain = start_daemon(tmp_path / "b", "--dram", "2MiB")
    try:
        status = [sys.executable, "-m", "kvserver.cli", "status", "--timeout", "30"]
        clear = subprocess.run([*status, "--server", secure.grpc_address],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert clear.returncode == 1
        assert clear.stderr.splitlines()[0] == (
            f"kvserver status: error: {secure.grpc_address} closed the connection at once: a "
            "daemon serving gRPC over TLS (kvserver start --tls-cert-file or --keys-dir) needs "
            "--tls-ca-file FILE (its certificate, e.g. server.crt of its keys directory)"
        )
        tls = subprocess.run(
            [*status, "--server", plain.grpc_address, "--tls-ca-file", str(keys / "server.crt")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert tls.returncode == 1
        first = tls.stderr.splitlines()[0]  # (was gRPC's own log line)
        assert first.startswith(
            f"kvserver status: error: the TLS handshake with {plain.grpc_address} failed: does "
            "the daemon serve gRPC over TLS"
        ), first
    finally:
        assert secure.terminate() == 0, secure.log()
        assert plain.terminate() == 0, plain.log()
