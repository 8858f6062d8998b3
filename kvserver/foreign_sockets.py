"""Sockets this process holds but another part of it owns: read one's addresses, shut it down.

Used by the bounds on connections that a library accepts for us without a hook on accept: gRPC
core's (``grpc_limit.py``, the descriptors listed in ``/proc/self/fd``) and libzmq's
(``daemon/pub_limit.py``, the descriptors its monitor reports; ``daemon/zmq_send.py``, a
request's ``SRCFD``). Stateless functions; callable from any thread (each call opens and closes
its own duplicate).

A descriptor number is not a socket. Its owner may close it at any moment (gRPC from its own
threads, libzmq from its I/O thread) and the next ``open``/``accept`` in the process may get the
same number for something else. So every call here works on a duplicate (``dup(2)``): the
socket object made on it closes the duplicate only, never the owner's descriptor, and the
owner's socket stays open until the owner closes it. Given the socket's ``inode`` (its number in
``/proc/self/fd``, ``socket:[INODE]``), a call first checks that the duplicate still is that
socket, so what it reads or shuts down is that socket or nothing. Without one, the caller
accepts that the number may have become another socket since it learnt it; ``shut_down`` then
checks what it can: the local port, or the whole connection as read earlier (``same_as``).

``shutdown(2)`` ends the connection for both ends without closing any descriptor: the owner
reads the end of its stream, drops the connection and closes its descriptor itself.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["Connection", "connection", "shut_down"]

_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


@dataclass(frozen=True, slots=True)
class Connection:
    """A TCP connection as its socket reports it."""

    #: the peer's host; an IPv4 peer of a dual-stack socket in its IPv4 form (not ``::ffff:``)
    host: str
    peer_port: int
    #: the port of this end (the listener's, for an accepted connection)
    local_port: int


def connection(fd: int, inode: int | None = None) -> Connection | None:
    """The TCP connection on descriptor ``fd`` if it is one (and, given ``inode``, still socket
    ``inode``); None for anything else: a listener or an unconnected socket (no peer), a Unix
    socket, a descriptor that is not a socket, one closed meanwhile. Never raises OSError."""
    sock = _borrow(fd, inode)
    if sock is None:
        return None
    with sock:  # closes the duplicate only
        return _connection(sock)


def shut_down(
    fd: int,
    *,
    inode: int | None = None,
    local_port: int | None = None,
    same_as: Connection | None = None,
) -> bool:
    """End the TCP connection on ``fd`` both ways (``shutdown(2)``; the owner's descriptor stays
    open) if it still is socket ``inode``, a connection to ``local_port`` and the connection
    ``same_as`` (its peer and ports; each checked when given); True if it was shut down, False
    if it was not such a connection (or could not be shut down). Never raises OSError."""
    sock = _borrow(fd, inode)
    if sock is None:
        return False
    with sock:
        found = _connection(sock)
        if (
            found is None
            or (local_port is not None and found.local_port != local_port)
            or (same_as is not None and found != same_as)
        ):
            return False
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        return True


def _borrow(fd: int, inode: int | None) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (the caller closes it), or None where ``fd`` is
    closed, is no socket, or is not socket ``inode`` (when given)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if inode is not None and os.fstat(dup).st_ino != inode:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:  # not a socket: the duplicate is still ours to close
        os.close(dup)
        return None


def _connection(sock: socket.socket) -> Connection | None:
    if sock.family not in _TCP_FAMILIES or sock.type != socket.SOCK_STREAM:
        return None
    try:
        peer, local = sock.getpeername(), sock.getsockname()
    except OSError:  # a listener, or no longer connected
        return None
    return Connection(str(peer[0]).removeprefix("::ffff:"), int(peer[1]), int(local[1]))
