"""The tests' import point for ``benchmarks.harness.procs``
(which the benchmarks import too: they never import the tests)."""

from __future__ import annotations

from benchmarks.harness.procs import (
    READY_TIMEOUT_S as READY_TIMEOUT_S,
)
from benchmarks.harness.procs import (
    EngineClient as EngineClient,
)
from benchmarks.harness.procs import (
    Proc as Proc,
)
from benchmarks.harness.procs import (
    output_tokens as output_tokens,
)
from benchmarks.harness.procs import (
    start_scheduler as start_scheduler,
)
from benchmarks.harness.procs import (
    start_worker as start_worker,
)
