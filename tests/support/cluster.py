"""The tests' import point for ``benchmarks.harness.cluster``
(which the benchmarks import too: they never import the tests)."""

from __future__ import annotations

from benchmarks.harness.cluster import (
    MODEL_SEED as MODEL_SEED,
)
from benchmarks.harness.cluster import (
    READY_TIMEOUT_S as READY_TIMEOUT_S,
)
from benchmarks.harness.cluster import (
    Turn as Turn,
)
from benchmarks.harness.cluster import (
    Workload as Workload,
)
from benchmarks.harness.cluster import (
    WorkloadResult as WorkloadResult,
)
from benchmarks.harness.cluster import (
    free_port as free_port,
)
from benchmarks.harness.cluster import (
    ideal_reusable as ideal_reusable,
)
from benchmarks.harness.cluster import (
    run_workload as run_workload,
)
from benchmarks.harness.cluster import (
    start_tp_workers as start_tp_workers,
)
