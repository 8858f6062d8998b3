"""kvserver/foreign_sockets.py on real sockets of this process: a TCP connection's addresses read
and its connection shut down through a duplicate, the owner's descriptor left open; nothing
read or cut once the number names another socket (its inode, or the connection read earlier),
or where it is no TCP connection (a listener, a Unix socket, a pipe, a closed descriptor)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from kvserver.foreign_sockets import Connection, connection, shut_down


class Pair:
    """A loopback TCP connection: ``client`` connected from 127.0.0.1 to ``listener`` (bound
    to ``host``), ``server`` its accepted end (the socket a library would own)."""

    def __init__(
        self, family: socket.AddressFamily = socket.AF_INET, host: str = "127.0.0.1"
    ) -> None:
        self.listener = socket.socket(family)
        try:
            if family == socket.AF_INET6:
                self.listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self.listener.bind((host, 0))
            self.listener.listen()
            self.port = self.listener.getsockname()[1]
            self.client = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        except OSError:
            self.listener.close()
            raise
        self.server, _ = self.listener.accept()
        self.server.settimeout(30)

    def close(self) -> None:
        for sock in (self.client, self.server, self.listener):
            sock.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_connection_reads_its_addresses(pair: Pair) -> None:
    client_port = pair.client.getsockname()[1]
    expected = Connection("127.0.0.1", client_port, pair.port)
    assert connection(pair.server.fileno()) == expected
    assert connection(pair.server.fileno(), inode(pair.server)) == expected
    assert connection(pair.client.fileno()) == Connection("127.0.0.1", pair.port, client_port)


def test_reading_leaves_the_owners_descriptor_open_and_no_duplicate_behind(pair: Pair) -> None:
    before = open_descriptors()
    for _ in range(100):
        assert connection(pair.server.fileno()) is not None
        assert connection(pair.listener.fileno()) is None
    assert open_descriptors() == before
    pair.client.sendall(b"still open")
    assert pair.server.recv(64) == b"still open"


def test_a_number_that_names_another_socket_now_is_not_read_nor_cut(pair: Pair) -> None:
    """The owner closed the socket and the number was reused (dup2 stands in for the next
    accept): with the old inode nothing is read, nothing is shut down."""
    other = Pair()
    try:
        old = inode(pair.server)
        number = pair.server.fileno()
        os.dup2(other.server.fileno(), number)  # ``number`` is now other's connection
        assert connection(number) == connection(other.server.fileno())  # no inode: read
        assert connection(number, old) is None
        assert shut_down(number, inode=old) is False
        other.server.sendall(b"x")
        assert other.client.recv(1) == b"x"  # other's connection was not cut
    finally:
        other.close()


def test_shut_down_ends_the_connection_for_both_ends_not_the_descriptor(pair: Pair) -> None:
    assert shut_down(pair.server.fileno(), inode=inode(pair.server)) is True
    assert pair.client.recv(64) == b""  # the peer reads the end of the stream
    assert pair.server.recv(64) == b""  # so does the owner, on its own descriptor
    os.fstat(pair.server.fileno())  # which is still open


def test_shut_down_checks_the_local_port(pair: Pair) -> None:
    fd = pair.server.fileno()
    assert shut_down(fd, local_port=pair.client.getsockname()[1]) is False  # not the port
    pair.client.sendall(b"y")
    assert pair.server.recv(1) == b"y"  # not cut
    assert shut_down(fd, local_port=pair.port, inode=inode(pair.server)) is True
    assert pair.client.recv(64) == b""


def test_shut_down_checks_the_connection_read_earlier(pair: Pair) -> None:
    """Without an inode (a request's SRCFD): the connection as read at the send must still be
    the one on the number (another connection on a reused number is not cut)."""
    fd = pair.server.fileno()
    read = connection(fd)
    assert read is not None
    other = Pair()
    try:
        assert shut_down(fd, same_as=connection(other.server.fileno())) is False
        pair.client.sendall(b"w")
        assert pair.server.recv(1) == b"w"  # not cut
    finally:
        other.close()
    assert shut_down(fd, same_as=read) is True
    assert pair.client.recv(64) == b""


def test_a_wrong_inode_cuts_nothing(pair: Pair) -> None:
    assert shut_down(pair.server.fileno(), inode=inode(pair.client)) is False
    pair.client.sendall(b"z")
    assert pair.server.recv(1) == b"z"


def test_what_is_no_tcp_connection_gives_none_and_is_not_cut(pair: Pair) -> None:
    left, right = socket.socketpair()
    read_end, write_end = os.pipe()
    closed = socket.socket()
    number = closed.fileno()
    closed.close()
    try:
        for fd in (pair.listener.fileno(), left.fileno(), read_end, number, -1):
            assert connection(fd) is None
            assert shut_down(fd) is False
        left.sendall(b"u")
        assert right.recv(1) == b"u"  # the Unix socket was not shut down
    finally:
        for sock in (left, right):
            sock.close()
        os.close(read_end)
        os.close(write_end)


def test_an_ipv4_peer_of_a_dual_stack_listener_is_named_in_its_ipv4_form() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        p = Pair(socket.AF_INET6, "::")
    except OSError as exc:  # a host without IPv6
        pytest.skip(f"no dual-stack listener here: {exc}")
    try:
        found = connection(p.server.fileno())
        assert found is not None and found.host == "127.0.0.1"
        assert found.local_port == p.port
    finally:
        p.close()
