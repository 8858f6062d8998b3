"""The default token of a server, left in a file only its own user can read.

Runs in the servers (writes: the daemon, the scheduler's front door) and in every client
process (reads); plain functions and one small class, thread-safe as far as the filesystem is.

Safe by default: a daemon started without ``--auth-token`` (and without ``--no-auth``) makes a
random token and requires it on every data-plane request and KVServer RPC; so does the
scheduler for its gRPC front door (``--engine-auth-token``, ``--engine-no-auth``). A server
writes its token (or the configured one) to ``<shm_dir>/kvserver-tokens-<uid>/port-<port>.token``
for each of its TCP ports — the directory 0700 and owned by the server's user, the files 0600 —
(the daemon's beside its arena) and removes them on shutdown. A client of the same user that
connects to a loopback address without a token of its own reads the file of that port
(:class:`TokenFile`); another user cannot read it, so cannot use the server. A token is never
looked up for a non-loopback address (it would be sent to another host).

A token can also live in a file of its own (``--auth-token-file``, a deployment's shared
secret, made by ``kvserver keys token``): :func:`read_token_file` reads it and refuses one that
other users may read; :func:`make_token_file` makes one.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Iterable

from kvserver.arena import DEFAULT_SHM_DIR
from kvserver.crypto import is_loopback
from kvserver.errors import InvalidArgument, KVServerError

SHM_DIR_ENV = "KVSERVER_SHM_DIR"
#: a token file larger than this is not a token.
MAX_TOKEN_FILE = 4096
#: the shortest token a token file may hold.
MIN_TOKEN_CHARS = 16
_ADDRESS = re.compile(r"^(?:tcp://)?(?P<host>\[[^\]]*\]|[^:/]+):(?P<port>\d+)$")


def server_token(configured: str, no_auth: bool) -> str:
    """The token a server (the daemon, the scheduler's front door) requires: ``configured``,
    else none with ``no_auth``, else a new random one — safe by default; write it with
    :func:`write_token_files` so that its own user's clients find it."""
    if configured:
        return configured
    return "" if no_auth else secrets.token_urlsafe(32)


def token_dir(shm_dir: str | None = None) -> str:
    """This user's token directory under ``shm_dir`` (default: $KVSERVER_SHM_DIR, /dev/shm)."""
    base = shm_dir or os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR
    return os.path.join(base, f"kvserver-tokens-{os.getuid()}")


def token_path(port: int, shm_dir: str | None = None) -> str:
    return os.path.join(token_dir(shm_dir), f"port-{port}.token")


def _private_dir(path: str) -> None:
    """Create ``path`` 0700, or check that an existing one is ours and private."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise KVServerError(
            f"token directory {path} is not a private directory of this user; remove it "
            "(or choose another --shm-dir)",
            path=path,
        )


def write_token_files(token: str, ports: Iterable[int], shm_dir: str | None = None) -> list[str]:
    """Write ``token`` for each port (0600, atomically); returns the paths. Raises
    KVServerError when the directory is not private to this user, OSError when unwritable."""
    directory = token_dir(shm_dir)
    _private_dir(directory)
    paths = []
    for port in ports:
        path = token_path(port, shm_dir)
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token)
        os.replace(tmp, path)
        paths.append(path)
    return paths


def remove_token_files(paths: Iterable[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _port_of(address: str) -> int | None:
    """The port of a loopback ``address`` (``tcp://127.0.0.1:9471``, ``localhost:9470``,
    ``[::1]:9470``); None for anything else."""
    m = _ADDRESS.match(address.strip())
    if m is None or not is_loopback(m["host"]):
        return None
    return int(m["port"])


class TokenFile:
    """The default token of the daemon at ``address``: read from its file when the file
    changes (a restarted daemon writes a new one), "" when there is none. Cheap enough to ask
    per request (one ``stat``)."""

    def __init__(self, address: str, shm_dir: str | None = None) -> None:
        port = _port_of(address)
        self.path = token_path(port, shm_dir) if port is not None else None
        self._seen: tuple[int, int] | None = None
        self._token = ""

    def token(self) -> str:
        if self.path is None:
            return ""
        try:
            st = os.stat(self.path)
        except OSError:
            self._seen, self._token = None, ""
            return ""
        seen = (st.st_ino, st.st_mtime_ns)
        if seen != self._seen:
            try:
                with open(self.path) as fh:
                    self._token = fh.read().strip()
            except OSError:  # another user's, or gone meanwhile
                self._token = ""
            self._seen = seen
        return self._token


def read_token_file(path: str, where: str = "") -> str:
    """The token in ``path`` (stripped). Raises InvalidArgument, prefixed with ``where``, for
    a file other users may read or write (0600 or 0640 are fine), an unreadable, oversized or
    non-text file, or a token under :data:`MIN_TOKEN_CHARS` characters."""
    prefix = f"{where}: " if where else ""
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_mode & stat.S_IRWXO:
                raise InvalidArgument(
                    f"{prefix}token file {path} is accessible to other users; "
                    "chmod 600 it (or 640 for a group)"
                )
            data = fh.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise InvalidArgument(f"{prefix}cannot read token file {path}: {exc}") from None
    if len(data) > MAX_TOKEN_FILE:
        raise InvalidArgument(f"{prefix}token file {path} is too large for a token")
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        raise InvalidArgument(f"{prefix}token file {path} is not text") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgument(
            f"{prefix}the token in {path} is shorter than {MIN_TOKEN_CHARS} characters"
        )
    return token


def make_token_file(directory: str, name: str = "auth") -> str:
    """A new random token in ``directory/NAME.token`` (0600); returns its path. Refuses to
    overwrite (InvalidArgument)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.token")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise InvalidArgument(f"refusing to overwrite {path}") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(32) + "\n")
    return path


def client_auth_token(values: object) -> str:
    """The token a client sends, from its parsed options (argparse's Namespace or any object
    with ``auth_token`` / ``auth_token_file`` attributes): the file's when ``auth_token_file``
    is set, else ``auth_token``, else "" (then a loopback daemon's token file is used).
    Raises InvalidArgument for an unusable file."""
    path = getattr(values, "auth_token_file", None) or ""
    if path:
        return read_token_file(path, "auth_token_file")
    return str(getattr(values, "auth_token", None) or "")
