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
