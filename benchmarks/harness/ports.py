"""Ports for processes that are told their port before they start (compose commands, Redis
servers, torch's rendezvous), picked where the kernel never picks.

Binding port 0, reading the number and closing the socket leaves a window: until the child
binds, the kernel may hand the same number to anyone's next ``connect()`` or ``bind(0)`` as an
ephemeral port (it did: a worker of the compose cluster met "Address already in use" in CI
because the daemon started just before it had opened connections). :func:`free_port` picks
from outside the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), checks
that nothing listens or is bound there, and never hands a number out twice in one process, so
only a process that binds that exact number on purpose can still take it.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 10000  # below are many well-known and registered services
_given: set[int] = set()
_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, inclusive (Linux's default where it can't be read)."""
    try:
        low, high = (int(v) for v in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def _candidates() -> list[int]:
    low, high = ephemeral_range()
    ports = [*range(_LOWEST, low), *range(high + 1, 65536)]
    if not ports:  # an ephemeral range covering everything: nothing is safe, take any
        ports = list(range(_LOWEST, 65536))
    return ports


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and that the kernel will not give out as an
    ephemeral port; never the same number twice in this process. Raises ``RuntimeError``
    when none is found in 1,000 tries."""
    pool = _candidates()
    with _lock:
        for _ in range(1000):
            port = random.choice(pool)
            if port in _given or not _bindable(host, port):
                continue
            _given.add(port)
            return port
    raise RuntimeError(f"no free port on {host} outside the ephemeral range after 1,000 tries")
