"""The tests' import point for ``benchmarks.harness.daemon``
(which the benchmarks import too: they never import the tests)."""

from __future__ import annotations

from benchmarks.harness.daemon import (
    READY_TIMEOUT_S as READY_TIMEOUT_S,
)
from benchmarks.harness.daemon import (
    DaemonProc as DaemonProc,
)
from benchmarks.harness.daemon import (
    raw_dealer as raw_dealer,
)
from benchmarks.harness.daemon import (
    start_daemon as start_daemon,
)
from benchmarks.harness.daemon import (
    wait_for_ready_file as wait_for_ready_file,
)
from benchmarks.harness.daemon import (
    wait_until as wait_until,
)
from tests.support.ports import free_port


def port_kept(flag: str = "--zmq-port") -> tuple[str, str]:
    """``flag`` and a port from :func:`tests.support.ports.free_port`, for a daemon that a test
    kills and starts again on the same port. Its own port 0 would be an ephemeral port, free
    between the two daemons for the kernel to give to anyone's next connection: the client
    reconnecting to it meanwhile (a TCP self-connect, its source port the same number) or
    another process's, and the second daemon would meet "Address already in use"."""
    return flag, str(free_port())
