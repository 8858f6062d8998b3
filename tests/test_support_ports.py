"""The tests' port picker: outside the kernel's ephemeral range, free, never the same twice."""

from __future__ import annotations

import socket

import pytest

from benchmarks.harness.ports import ephemeral_range
from tests.support.ports import free_port


def test_ports_are_outside_the_ephemeral_range_free_and_distinct() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(not low <= p <= high and 10000 <= p <= 65535 for p in ports)
    with socket.socket() as s:  # the last one is still free to bind
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_someone_else_listens_on_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pick is random; the injected choice offers a port another socket holds first."""
    import benchmarks.harness.ports as ports

    low, _ = ephemeral_range()
    holder = socket.socket()
    for port in range(low - 1, 10000, -1):  # a port outside the range that we can hold
        try:
            holder.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    holder.listen()
    held = holder.getsockname()[1]
    offers = iter([held, held - 1, held - 2, held - 3])
    monkeypatch.setattr(ports.random, "choice", lambda pool: next(offers))
    try:
        got = free_port()
        assert got != held and got in (held - 1, held - 2, held - 3)
    finally:
        holder.close()
