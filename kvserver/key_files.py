"""Reading the key and certificate files an operator names (CURVE ``.key`` / ``.key_secret``,
a CURVE clients directory, TLS PEM files): bounded, checked, each failure one
``InvalidArgument`` naming the file.

Used by ``kvserver/crypto.py`` (every process that takes such a file: the daemon, its
clients, the scheduler, the workers, the vLLM plug-in) and ``kvserver/daemon/zap.py`` (the
clients directory). Pure functions over files, no state: thread-safe.

Nothing here trusts a file's contents: a file is read up to :data:`MAX_KEY_FILE_BYTES`
(``/dev/zero`` or a FIFO nobody writes is refused, not read for ever), and a CURVE key is
40 Z85 characters decoding to 32 bytes, a secret key the one of its public key. Before, a
malformed key passed the start-up checks and failed ``setsockopt`` later, a traceback after
the daemon had built its arena; a ``.key`` without a key in the clients directory was a
traceback too.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import zmq
from zmq.utils import z85

from kvserver.errors import InvalidArgument
from kvserver.files import TooLarge, read_limited

#: the largest key or certificate file read (a CURVE key file is ~200 bytes, a certificate
#: chain or a CA bundle a few to a few hundred KiB).
MAX_KEY_FILE_BYTES = 4 << 20


def read_key_file(path: str, what: str) -> bytes:
    """The bytes of ``path`` (``what`` names it in the error: "TLS certificate", ...)."""
    try:
        return read_limited(path, MAX_KEY_FILE_BYTES)
    except TooLarge:
        raise InvalidArgument(
            f"cannot read {what} {path}: larger than {MAX_KEY_FILE_BYTES} bytes", path=path
        ) from None
    except TimeoutError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc}", path=path) from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read {what} {path}: {exc.strerror}", path=path) from None


def _field(data: bytes, name: bytes) -> bytes | None:
    """The value of the first ``name = "..."`` line (libzmq's certificate format)."""
    for line in data.splitlines():
        line = line.strip()
        if line.startswith(name):
            return line.split(b"=", 1)[-1].strip(b" \t'\"")
    return None


def _z85_key(value: bytes, which: str, path: str) -> bytes:
    try:
        ok = len(value) == 40 and len(z85.decode(value)) == 32
    except (ValueError, KeyError, struct.error):  # length, alphabet, a group past 2**32
        ok = False
    if not ok:
        raise InvalidArgument(
            f"the {which} key in CURVE key file {path} is not 40 Z85 characters "
            "(make the file with kvserver keys curve)",
            path=path,
        )
    return value


def load_curve_keys(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) Z85 keys from a libzmq certificate file (``.key`` or
    ``.key_secret``). Raises InvalidArgument naming the file: unreadable, too large, no
    public key, a key that is not a CURVE key, a secret key not the public key's."""
    data = read_key_file(path, "CURVE key file")
    public = _field(data, b"public-key")
    if not public:
        raise InvalidArgument(f"no public key in CURVE key file {path}", path=path)
    public = _z85_key(public, "public", path)
    secret = _field(data, b"secret-key")
    if secret is None:
        return public, None
    secret = _z85_key(secret, "secret", path)
    if zmq.curve_public(secret) != public:
        raise InvalidArgument(
            f"the secret key in CURVE key file {path} is not its public key's", path=path
        )
    return public, secret


def load_client_keys(directory: str) -> frozenset[bytes]:
    """The Z85 public keys of the ``.key`` files in ``directory`` (``curve_clients_dir``).
    Raises InvalidArgument naming the directory, or the first file that is not a key."""
    try:
        names = sorted(
            n for n in os.listdir(directory) if n.endswith(".key") and not n.startswith(".")
        )  # what zmq.auth.load_certificates globbed
    except OSError as exc:
        raise InvalidArgument(
            f"cannot read CURVE clients directory {directory}: {exc.strerror}", path=directory
        ) from None
    return frozenset(load_curve_keys(str(Path(directory) / name))[0] for name in names)
