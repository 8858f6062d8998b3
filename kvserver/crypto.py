"""Encryption and peer authentication on the wire: ZMQ CURVE keys, the token a ZMQ client
presents at the handshake (PLAIN), gRPC TLS credentials, and the same TLS files as
``ssl.SSLContext`` for the peer stream (``kvserver/daemon/stream_server.py``).

Runs in any process: the daemon (server side), every client, and a daemon acting as a client
of another daemon (the peer tier) — the client-side settings are one small value,
:class:`CurveClient`, that any code opening a DEALER or SUB applies with ``apply(sock)``.
Immutable settings plus pure functions: thread-safe.

Keys and certificates come from files (``docs/security.md``):

- CURVE: libzmq's certificate format (what ``zmq.auth.create_certificates`` writes):
  ``NAME.key`` holds the public key, ``NAME.key_secret`` (mode 0600) both keys. The daemon reads
  its ``.key_secret``; a client needs the daemon's ``.key`` and, when the daemon only admits
  listed clients, a ``.key_secret`` of its own whose ``.key`` is in the daemon's clients
  directory. Without one a client uses a fresh key pair per process.
- TLS: PEM files. The daemon: certificate chain + private key, and optionally a CA bundle
  whose certificates client certificates must chain to (mutual TLS). A client: the CA bundle
  that signed the daemon's certificate (a self-signed certificate is its own CA), optionally
  its own certificate + key.

:func:`make_curve_keys` and :func:`make_tls_cert` create them (``kvserver keys``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from kvserver.errors import InvalidArgument
from kvserver.key_files import load_curve_keys, read_key_file


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address to bind) only accepts connections from this host."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def endpoint_is_local(endpoint: str) -> bool:
    """True when a ZMQ ``endpoint`` (to bind or connect) stays on this host: ``ipc://``,
    ``inproc://``, or ``tcp://`` to a loopback address; ``tcp://*:PORT`` and any other host
    (a name included) reach beyond it."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return is_loopback(host)


@dataclass(frozen=True, slots=True)
class CurveServer:
    """The daemon's CURVE identity for its ROUTER and PUB; ``clients_dir``: when set, only
    clients whose public key is a ``.key`` file there may connect (checked by ZAP)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    clients_dir: str = ""

    @classmethod
    def from_file(cls, secret_file: str, clients_dir: str = "") -> CurveServer:
        public, secret = load_curve_keys(secret_file)
        if secret is None:
            raise InvalidArgument(f"no secret key in {secret_file} (use NAME.key_secret)")
        if clients_dir and not Path(clients_dir).is_dir():
            raise InvalidArgument(f"CURVE clients directory not found: {clients_dir}")
        return cls(public, secret, clients_dir)

    def apply(self, sock: Any) -> None:
        """Make ``sock`` (not yet bound) a CURVE server."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True


@dataclass(frozen=True, slots=True)
class CurveClient:
    """What a client needs to reach a CURVE daemon: its public key, and the client's pair."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)

    @classmethod
    def from_files(cls, server_key_file: str, client_secret_file: str = "") -> CurveClient:
        """The daemon's public key from ``server_key_file`` (its ``.key``); the client's pair
        from ``client_secret_file``, or a fresh one."""
        server, _ = load_curve_keys(server_key_file)
        if client_secret_file:
            public, secret = load_curve_keys(client_secret_file)
            if secret is None:
                raise InvalidArgument(f"no secret key in {client_secret_file}")
        else:
            public, secret = zmq.curve_keypair()
        return cls(server, public, secret)

    def apply(self, sock: Any) -> None:
        """Make ``sock`` (not yet connected) a CURVE client of the daemon."""
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key


#: the PLAIN user name kvserver's clients present at the ZMQ handshake; the daemon checks only
#: the password, which is the token (``kvserver/daemon/zap.py``).
PLAIN_USERNAME = b"kvserver"
#: the longest token (UTF-8 bytes) the PLAIN mechanism carries; the daemon refuses longer ones.
MAX_TOKEN_BYTES = 255


def apply_token(sock: Any, token: str) -> None:
    """Make ``sock`` (not yet connected) present ``token`` at the ZMQ handshake: the PLAIN
    mechanism with the token as password, what a daemon that requires a token and has no CURVE
    key demands of every client (``docs/wire.md``, "The handshake"). Raises InvalidArgument for
    a token the mechanism cannot carry (empty, or over 255 bytes)."""
    password = token.encode()
    if not 0 < len(password) <= MAX_TOKEN_BYTES:
        raise InvalidArgument(f"an auth token is 1 to {MAX_TOKEN_BYTES} bytes", size=len(password))
    sock.plain_username = PLAIN_USERNAME
    sock.plain_password = password


@dataclass(frozen=True, slots=True)
class TlsServer:
    """The daemon's gRPC TLS: ``cert_file`` + ``key_file``; ``client_ca_file``: when set,
    clients must present a certificate signed by it (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    def credentials(self) -> Any:
        import grpc

        cert = read_key_file(self.cert_file, "TLS certificate")
        key = read_key_file(self.key_file, "TLS key")
        ca = read_key_file(self.client_ca_file, "TLS client CA") if self.client_ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate, key and client CA for the peer stream's server end: TLS 1.2
        or later; a client certificate that chains to ``client_ca_file`` is required when it
        is set (mutual TLS, as on gRPC); no session tickets (a peer keeps its few connections
        open, none is resumed). Raises InvalidArgument naming a file that cannot be used."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.num_tickets = 0
        _load_chain(ctx, self.cert_file, self.key_file)
        if self.client_ca_file:
            _load_ca(ctx, self.client_ca_file, "TLS client CA")
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True, slots=True)
class TlsClient:
    """A gRPC client's TLS: the CA that signed the daemon's certificate; its own certificate
    and key when the daemon requires client certificates; ``server_name`` overrides the name
    checked against the certificate (default: the host of the target)."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def credentials(self) -> Any:
        import grpc

        ca = read_key_file(self.ca_file, "TLS CA")
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("a TLS client certificate needs both cert_file and key_file")
        cert = read_key_file(self.cert_file, "TLS certificate") if self.cert_file else None
        key = read_key_file(self.key_file, "TLS key") if self.key_file else None
        return grpc.ssl_channel_credentials(ca, key, cert)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """The same files for a peer stream client (a daemon fetching from its peers): TLS 1.2
        or later; the server's certificate must chain to a certificate of ``ca_file`` (every
        certificate there is a trust anchor, so one self-signed certificate for the fleet
        works) and name the host dialled (``check_hostname``; the caller passes
        ``server_name`` or the host as ``server_hostname``); this client's certificate is
        presented when the server asks for one (mutual TLS). Raises InvalidArgument naming a
        file that cannot be used."""
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("a TLS client certificate needs both cert_file and key_file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        _load_ca(ctx, self.ca_file, "TLS CA")
        if self.cert_file:
            _load_chain(ctx, self.cert_file, self.key_file)
        return ctx


def _load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    read_key_file(cert_file, "TLS certificate")  # a clear error for a missing/unreadable file
    read_key_file(key_file, "TLS key")
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise InvalidArgument(
            f"cannot use TLS certificate {cert_file} with key {key_file}: {exc}", path=cert_file
        ) from None


def _load_ca(ctx: ssl.SSLContext, ca_file: str, what: str) -> None:
    read_key_file(ca_file, what)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise InvalidArgument(f"not a {what} file (PEM): {ca_file}: {exc}", path=ca_file) from None


#: the client options, named as the daemon's flags (``docs/security.md``, "Client options"):
#: option -> what it is. The same names are CLI flags (``--curve-server-key-file``), config
#: fields and the vLLM plug-in's ``kv_connector_extra_config`` keys.
CLIENT_OPTIONS: dict[str, str] = {
    "curve_server_key_file": "the daemon's CURVE public key (its NAME.key): use CURVE on ZMQ",
    "curve_secret_key_file": (
        "this client's CURVE key pair (NAME.key_secret) when the daemon lists its clients "
        "(curve_clients_dir); default: a fresh pair per process"
    ),
    "tls_ca_file": "the CA (PEM) that signed the daemon's gRPC certificate: use TLS on gRPC",
    "tls_cert_file": "this client's certificate (PEM) when the daemon requires one (mTLS)",
    "tls_key_file": "this client's private key (PEM), with tls_cert_file",
    "tls_server_name": "the name checked against the daemon's certificate (default: the host)",
}


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """How a client secures its connections to a daemon, by the names of
    :data:`CLIENT_OPTIONS` (file paths; "" = unset). ``curve()`` / ``tls()`` read the files
    and raise InvalidArgument naming the option for a missing or malformed one."""

    curve_server_key_file: str = ""
    curve_secret_key_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""

    def __post_init__(self) -> None:
        for name in CLIENT_OPTIONS:
            if not isinstance(getattr(self, name), str):
                raise InvalidArgument(f"{name} must be a string (a file path)")
        if self.curve_secret_key_file and not self.curve_server_key_file:
            raise InvalidArgument("curve_secret_key_file needs curve_server_key_file")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise InvalidArgument("tls_cert_file and tls_key_file go together")
        if (self.tls_cert_file or self.tls_server_name) and not self.tls_ca_file:
            raise InvalidArgument(
                "tls_cert_file, tls_key_file and tls_server_name need tls_ca_file"
            )

    @classmethod
    def from_mapping(cls, values: Any) -> ClientSecurity:
        """From any object with the option names as keys (a dict) or attributes (argparse's
        Namespace); missing or None ones are unset."""
        if isinstance(values, dict):
            return cls(**{k: values.get(k) or "" for k in CLIENT_OPTIONS})
        return cls(**{k: getattr(values, k, None) or "" for k in CLIENT_OPTIONS})

    def curve(self) -> CurveClient | None:
        """The CURVE client settings (keys read now); None without curve_server_key_file."""
        if not self.curve_server_key_file:
            return None
        return CurveClient.from_files(self.curve_server_key_file, self.curve_secret_key_file)

    def tls(self) -> TlsClient | None:
        """The gRPC TLS settings (files read when a channel is made); None without
        tls_ca_file."""
        if not self.tls_ca_file:
            return None
        client = TlsClient(self.tls_ca_file, self.tls_cert_file, self.tls_key_file,
                           self.tls_server_name)  # fmt: skip
        client.credentials()  # a missing or unreadable file: an error now, naming it
        return client


def add_client_security_args(
    parser: Any, *, curve: bool = True, tls: bool = False, token: bool = False
) -> None:
    """Add the :data:`CLIENT_OPTIONS` flags (``--curve-*`` for a ZMQ client, ``--tls-*`` for
    a gRPC client) to an argparse parser; read them back with
    :meth:`ClientSecurity.from_mapping`. ``token``: also ``--auth-token`` (default
    ``$KVSERVER_AUTH_TOKEN``, else ``""``: the client then reads the token file a daemon on this
    host left for its user) and ``--auth-token-file`` (default ``$KVSERVER_AUTH_TOKEN_FILE``;
    read them back with ``kvserver.token_file.client_auth_token``)."""
    if token:
        parser.add_argument(
            "--auth-token",
            default=os.environ.get("KVSERVER_AUTH_TOKEN", ""),
            metavar="TOKEN",
            help="the daemon's token (default: $KVSERVER_AUTH_TOKEN, else the token file a "
            "daemon on this host left for its user)",
        )
        parser.add_argument(
            "--auth-token-file",
            default=os.environ.get("KVSERVER_AUTH_TOKEN_FILE", ""),
            metavar="FILE",
            help="read the daemon's token from FILE instead (default: "
            "$KVSERVER_AUTH_TOKEN_FILE; 'kvserver keys token' makes one)",
        )
    for name, help_text in CLIENT_OPTIONS.items():
        if (name.startswith("curve") and curve) or (name.startswith("tls") and tls):
            metavar = "NAME" if name == "tls_server_name" else "FILE"
            parser.add_argument("--" + name.replace("_", "-"), metavar=metavar, default="",
                                help=help_text + " (docs/security.md)")  # fmt: skip


# ----------------------------------------------------------------------------- making keys


def make_curve_keys(directory: str, name: str) -> tuple[str, str]:
    """Create ``NAME.key`` and ``NAME.key_secret`` (0600) in ``directory``; returns their
    paths. Refuses to overwrite."""
    os.makedirs(directory, exist_ok=True)
    public = os.path.join(directory, f"{name}.key")
    secret = public + "_secret"
    for path in (public, secret):
        if os.path.exists(path):
            raise InvalidArgument(f"refusing to overwrite {path}")
    old = os.umask(0o077)
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def make_tls_cert(
    directory: str, name: str, hosts: Sequence[str], *, days: int = 365
) -> tuple[str, str]:
    """A self-signed certificate (its own CA) for ``hosts`` (DNS names or IP addresses):
    ``NAME.crt`` and ``NAME.pem`` (private key, 0600) in ``directory``; returns their paths.
    Refuses to overwrite. Uses the ``cryptography`` package."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise InvalidArgument("a TLS certificate needs at least one host name or address")
    os.makedirs(directory, exist_ok=True)
    cert_path = os.path.join(directory, f"{name}.crt")
    key_path = os.path.join(directory, f"{name}.pem")
    for path in (cert_path, key_path):
        if os.path.exists(path):
            raise InvalidArgument(f"refusing to overwrite {path}")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    alt: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    old = os.umask(0o077)
    try:
        with open(key_path, "wb") as fh:
            fh.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
    finally:
        os.umask(old)
    with open(cert_path, "wb") as fh:
        fh.write(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(cert_path, 0o644)
    return cert_path, key_path
