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

Files of killed servers: a server holds a shared ``flock`` on each file it wrote for as long
as it runs (:class:`TokenFiles`); the kernel drops it when the process dies, however it dies.
At start the daemon and the scheduler remove the files of their kind (``port-<port>.token``
and their half-written ``.tmp<pid>`` twins, this user's, in this directory) that no process
holds that lock on and whose port nothing on this host listens on
(:func:`reap_stale_token_files`). A lock rather than a pid: the file is named by its port
(that is how clients find it), and a held lock is the one test that a reused pid or another pid
namespace sharing ``/dev/shm`` cannot fool; the port test keeps the file of a running server
that predates the lock.

A token can also live in a file of its own (``--auth-token-file``, a deployment's shared
secret, made by ``kvserver keys token``): :func:`read_token_file` reads it and refuses one that
other users may read; :func:`make_token_file` makes one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Iterable

from kvserver.arena import DEFAULT_SHM_DIR
from kvserver.crypto import is_loopback
from kvserver.errors import InvalidArgument, KVServerError
from kvserver.files import TooLarge, read_limited, remove_if_unheld

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


class TokenFiles:
    """The token files one server wrote for its TCP ports (:func:`write_token_files`), each
    held under a shared ``flock`` until :meth:`close`, which removes them (idempotent). Owned
    by the server's start-up/shutdown code; not thread-safe."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self._fds: list[int] = []

    def _write(self, token: str, path: str) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        self._fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # before the name is visible: never reaped meanwhile
            os.write(fd, token.encode())
            os.replace(tmp, path)
        except BaseException:
            remove_token_files([tmp])
            raise
        self.paths.append(path)

    def close(self) -> None:
        remove_token_files(self.paths)
        for fd in self._fds:
            os.close(fd)
        self.paths, self._fds = [], []


def write_token_files(token: str, ports: Iterable[int], shm_dir: str | None = None) -> TokenFiles:
    """Write ``token`` for each port (0600, atomically), each file locked while the returned
    :class:`TokenFiles` is open (close it at shutdown: that removes them). Raises KVServerError
    when the directory is not private to this user, OSError when unwritable (nothing is left
    written then)."""
    directory = token_dir(shm_dir)
    _private_dir(directory)
    files = TokenFiles()
    try:
        for port in ports:
            files._write(token, token_path(port, shm_dir))
    except BaseException:
        files.close()
        raise
    return files


def remove_token_files(paths: Iterable[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


_TOKEN_NAME = re.compile(r"^port-(?P<port>\d{1,5})\.token(?:\.tmp\d+)?$")


def reap_stale_token_files(shm_dir: str | None = None) -> list[str]:
    """Remove this user's token files in :func:`token_dir` left by servers that died without
    cleaning up (SIGKILL, OOM): only names of this module's kind, only files no live process
    holds the lock of (:class:`TokenFiles`) and whose port no socket on this host listens on
    (read from ``/proc/net``; when it cannot be read, nothing is removed). Returns the removed
    paths. Safe beside running servers: a server locks its file before it is visible, and binds
    its port before it writes it."""
    directory = token_dir(shm_dir)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    candidates = [(name, m["port"]) for name in names if (m := _TOKEN_NAME.match(name))]
    if not candidates:
        return []
    listening = _listening_ports()
    if listening is None:
        return []
    removed: list[str] = []
    for name, port in candidates:
        path = os.path.join(directory, name)
        if int(port) not in listening and remove_if_unheld(
            path, os.O_NONBLOCK, os.unlink, stat.S_ISREG
        ):
            removed.append(path)
    return removed


def _listening_ports() -> set[int] | None:
    """The TCP ports a socket listens on in this network namespace (``/proc/net/tcp``,
    ``tcp6``); None when neither can be read."""
    ports: set[int] = set()
    read_any = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split(None, 4)
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports if read_any else None


def _port_of(address: str) -> int | None:
    """The port of a loopback ``address`` (``tcp://127.0.0.1:9471``, ``localhost:9470``,
    ``[::1]:9470``); None for anything else."""
    m = _ADDRESS.match(address.strip())
    if m is None or not is_loopback(m["host"]):
        return None
    return int(m["port"])


class TokenFile:
    """The default token of the daemon at ``address``, "" when it has none.

    :meth:`token` is the token last read (read on first use; no system call after that: it is
    asked per request); :meth:`reload` reads the file again if it changed (one ``stat``; a
    restarted daemon writes a new one). Clients reload when they open a connection and when the
    daemon refuses the token (a refused handshake, ``Unauthenticated``), then retry once."""

    def __init__(self, address: str, shm_dir: str | None = None) -> None:
        port = _port_of(address)
        self.path = token_path(port, shm_dir) if port is not None else None
        self._seen: tuple[int, int] | None = None
        self._token = ""
        self._loaded = False

    def token(self) -> str:
        return self._token if self._loaded else self.reload()

    def reload(self) -> str:
        self._loaded = True
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
    non-text file (a FIFO or device with no end within ``files.READ_WAIT_S`` is unreadable),
    or a token under :data:`MIN_TOKEN_CHARS` characters."""
    prefix = f"{where}: " if where else ""
    try:
        if os.stat(path).st_mode & stat.S_IRWXO:
            raise InvalidArgument(
                f"{prefix}token file {path} is accessible to other users; "
                "chmod 600 it (or 640 for a group)"
            )
        # bounded in time too: open() of a FIFO nobody writes waited for ever, deaf to SIGTERM
        data = read_limited(path, MAX_TOKEN_FILE)
    except TooLarge:
        raise InvalidArgument(f"{prefix}token file {path} is too large for a token") from None
    except OSError as exc:  # the reason alone (was "[Errno 2] No such file ...: 'PATH'" too);
        reason = exc.strerror or str(exc)  # TimeoutError too: a FIFO or device with no end
        raise InvalidArgument(f"{prefix}cannot read token file {path}: {reason}") from None
    try:
        token = data.decode().strip()
    except UnicodeDecodeError:
        raise InvalidArgument(f"{prefix}token file {path} is not text") from None
    if not token:
        raise InvalidArgument(f"{prefix}token file {path} is empty")
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
