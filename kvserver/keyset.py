"""A daemon's keys made on its first start: ``kvserver start --keys-dir DIR``.

Runs in the daemon process while its configuration is read (``DaemonConfig``), before anything
listens; plain functions over the filesystem. For a container started with no other setup
(``deploy/Dockerfile``'s default command): whatever of the key set is missing in ``DIR`` is made
with the same functions as ``kvserver keys`` (docs/security.md), what is there is kept, so a
volume keeps one identity across restarts:

- ``server.key`` / ``server.key_secret``: the daemon's CURVE pair;
- ``client.key`` / ``client.key_secret``: a client pair, its public key listed in ``clients/``
  (the daemon's clients directory: only listed keys may connect);
- ``server.crt`` / ``server.pem``: a self-signed TLS certificate for this host's name,
  ``localhost``, 127.0.0.1, ::1 and the advertised address;
- ``auth.token``: the daemon's token.

Clients copy ``server.key``, ``client.key_secret``, ``server.crt`` and ``auth.token``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from kvserver.crypto import make_curve_keys, make_tls_cert
from kvserver.errors import InvalidArgument
from kvserver.token_file import make_token_file


@dataclass(frozen=True, slots=True)
class KeySet:
    """The daemon-side files of a key set (paths)."""

    curve_secret_key_file: str
    curve_clients_dir: str
    tls_cert_file: str
    tls_key_file: str
    auth_token_file: str


def ensure_key_set(directory: str, tls_hosts: Sequence[str]) -> KeySet:
    """Make what is missing of the key set in ``directory`` (see the module docstring); keep
    the rest. Raises InvalidArgument when a file cannot be made (naming it) or the
    ``cryptography`` package is missing."""
    path = os.path.join
    if os.path.exists(directory) and not os.path.isdir(directory):  # was "[Errno 17] File exists"
        raise InvalidArgument(f"keys_dir: {directory} is a file, not a directory")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for name in ("server", "client"):
            if not os.path.exists(path(directory, f"{name}.key_secret")):
                make_curve_keys(directory, name)
        clients = path(directory, "clients")
        os.makedirs(clients, exist_ok=True)
        if not os.path.exists(path(clients, "client.key")):
            shutil.copyfile(path(directory, "client.key"), path(clients, "client.key"))
        if not os.path.exists(path(directory, "server.pem")):
            try:
                make_tls_cert(directory, "server", list(dict.fromkeys(tls_hosts)))
            except ImportError:
                raise InvalidArgument(
                    "keys_dir: making a TLS certificate needs the 'cryptography' package "
                    "(pip install 'kvserver[tls]')"
                ) from None
        if not os.path.exists(path(directory, "auth.token")):
            make_token_file(directory, "auth")
    except OSError as exc:  # the reason, and the file when not the directory itself
        where = f" ({exc.filename})" if exc.filename and exc.filename != directory else ""
        reason = f"{exc.strerror}{where}" if exc.strerror else str(exc)
        raise InvalidArgument(f"keys_dir: cannot make keys in {directory}: {reason}") from None
    return KeySet(
        curve_secret_key_file=path(directory, "server.key_secret"),
        curve_clients_dir=clients,
        tls_cert_file=path(directory, "server.crt"),
        tls_key_file=path(directory, "server.pem"),
        auth_token_file=path(directory, "auth.token"),
    )
