"""Key and certificate files that are not what they claim (``kvserver/key_files.py``): a
CURVE key file with a malformed or mismatched key, a clients directory with a ``.key`` that
holds none, ``/dev/zero`` as a key or a certificate. Each process that takes one (a real
``kvserver start``, ``kvserver scheduler``, ``kvserver worker``) exits at once with one
error line naming the file; the daemon before it builds its arena, the read bounded."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from kvserver.errors import InvalidArgument
from kvserver.key_files import MAX_KEY_FILE_BYTES, load_client_keys, load_curve_keys
from tests.support.ports import free_port

pytestmark = pytest.mark.multiprocess

#: the daemon's address-space limit in these runs: it starts in well under 1 GiB; an
#: unbounded read of /dev/zero (before) died at it of MemoryError instead of filling the host.
DAEMON_AS_LIMIT = 1 << 30


def key_file(path: Path, public: bytes, secret: bytes | None = None) -> str:
    """A libzmq certificate file holding these key texts, valid or not."""
    text = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def bad_key_files(directory: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the error says) for each way a key file can lie."""
    public, secret = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    (directory / "nokey.key_secret").write_bytes(b"\xff\xfe\x00 no key here\n" * 4)
    return {
        "a short secret key": (
            key_file(directory / "short.key_secret", public, b"abc"),
            "secret key in CURVE key file .* is not 40 Z85",
        ),
        "characters outside Z85": (
            key_file(directory / "alphabet.key_secret", b"~" * 40, secret),
            "public key in CURVE key file .* is not 40 Z85",
        ),
        "a Z85 group past 2**32": (
            key_file(directory / "overflow.key_secret", public, b"#" * 40),
            "secret key in CURVE key file .* is not 40 Z85",
        ),
        "a secret key of another pair": (
            key_file(directory / "mismatch.key_secret", other_public, secret),
            "secret key in CURVE key file .* is not its public key's",
        ),
        "no key at all": (str(directory / "nokey.key_secret"), "no public key in CURVE key"),
        "an endless device": ("/dev/zero", f"larger than {MAX_KEY_FILE_BYTES} bytes"),
    }


CASES = ["a short secret key", "characters outside Z85", "a Z85 group past 2**32",
         "a secret key of another pair", "no key at all", "an endless device"]  # fmt: skip


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (DAEMON_AS_LIMIT, DAEMON_AS_LIMIT))


def start_daemon_with(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``kvserver start ...flags`` run to its exit (it must not start)."""
    return subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "start", "--dram", "64MiB",
         "--zmq-port", str(free_port()), "--grpc-port", str(free_port()), "--pub-port", "-1",
         "--metrics-port", "-1", "--shm-dir", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=120, preexec_fn=_limit_address_space,
    )  # fmt: skip


#: a line of gRPC's C-core log ("E1207 02:02:06.532271   27089 file.cc:373] ...")
GRPC_LOG = re.compile(r"[EWID]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def assert_one_line_error(proc: subprocess.CompletedProcess[str], rc: int, pattern: str) -> None:
    assert proc.returncode == rc, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # gRPC's C core may log at exit under this test's address-space limit (once in CI: "E1207
    # ... ev_epoll1_linux.cc:373] ... epoll_wait error: Bad file descriptor"): not ours
    ours = [line for line in proc.stderr.strip().splitlines() if not GRPC_LOG.match(line)]
    assert " error: " in ours[-1] and re.search(pattern, ours[-1]), proc.stderr[-3000:]


@pytest.mark.parametrize("case", CASES)
def test_the_daemon_refuses_a_secret_key_file_that_lies_before_its_arena(
    tmp_path: Path, case: str
) -> None:
    """Before: a malformed key passed the start-up checks, then ``setsockopt`` raised a
    ZMQError traceback after the arena was pre-faulted; /dev/zero was read until memory ran
    out; a secret key of another pair started a daemon no client's handshake could reach."""
    path, error = bad_key_files(tmp_path)[case]
    proc = start_daemon_with(tmp_path, "--curve-secret-key-file", path)
    assert_one_line_error(proc, 1, error)
    assert path in proc.stderr
    assert "pre-faulting" not in proc.stderr  # refused before the arena was made


def test_the_daemon_refuses_a_clients_directory_with_a_key_file_that_holds_none(
    tmp_path: Path,
) -> None:
    """Before: ``ValueError: No public key found`` as a traceback, after the arena."""
    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    clients.mkdir()
    keys.mkdir()
    public, secret = zmq.curve_keypair()
    server = key_file(keys / "server.key_secret", public, secret)
    key_file(clients / "good.key", zmq.curve_keypair()[0])
    (clients / "notes.key").write_text("this is not a key\n")
    proc = start_daemon_with(
        tmp_path, "--curve-secret-key-file", server, "--curve-clients-dir", str(clients)
    )
    assert_one_line_error(proc, 1, "no public key in CURVE key file .*notes.key")
    assert "pre-faulting" not in proc.stderr


def test_the_daemon_refuses_an_endless_certificate_without_reading_it_all(tmp_path: Path) -> None:
    """Before: ``--tls-cert-file /dev/zero`` was read until the address space ran out."""
    pem = tmp_path / "key.pem"
    pem.write_text("not a key\n")
    proc = start_daemon_with(tmp_path, "--tls-cert-file", "/dev/zero", "--tls-key-file", str(pem))
    assert_one_line_error(proc, 1, "cannot read TLS certificate /dev/zero: larger than")


@pytest.mark.parametrize(
    "command",
    [
        ["scheduler", "--synthetic-workers", "1", "--kvserver", "tcp://10.0.0.5:9471",
         "--curve-server-key-file"],
        ["scheduler", "--synthetic-workers", "1", "--kvserver", "tcp://127.0.0.1:1",
         "--metrics-port", "-1", "--step-curve-server-key-file"],
        ["worker", "--rank", "0", "--world-size", "1", "--listen", "tcp://127.0.0.1:0",
         "--dist-init", "tcp://127.0.0.1:1", "--model-file", "/absent.safetensors",
         "--write-random-model-seed", "1", "--kvserver", "tcp://10.0.0.5:9471",
         "--curve-server-key-file"],
    ],
    ids=["scheduler-daemon-key", "scheduler-step-key", "worker-daemon-key"],
)  # fmt: skip
def test_a_client_process_refuses_a_public_key_file_that_lies(
    tmp_path: Path, command: list[str]
) -> None:
    """Before: ``zmq.error.ZMQError: Invalid argument`` as a traceback (exit 1)."""
    path = key_file(tmp_path / "server.key", b"~" * 40)
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", *command, path],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_one_line_error(proc, 2, "public key in CURVE key file .*server.key is not 40 Z85")


def test_good_key_files_load_as_libzmq_wrote_them(tmp_path: Path) -> None:
    import zmq.auth

    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "pair")
    public, secret = zmq.curve_keypair()
    assert load_curve_keys(secret_file) == zmq.auth.load_certificate(secret_file)
    assert load_curve_keys(public_file) == (zmq.auth.load_certificate(public_file)[0], None)
    key_file(tmp_path / "mine.key_secret", public, secret)
    assert load_curve_keys(str(tmp_path / "mine.key_secret")) == (public, secret)
    (tmp_path / ".hidden.key").write_text("skipped, as zmq.auth.load_certificates skips it\n")
    assert load_client_keys(str(tmp_path)) == {zmq.auth.load_certificate(public_file)[0]}
    with pytest.raises(InvalidArgument, match="cannot read CURVE clients directory"):
        load_client_keys(str(tmp_path / "absent"))
