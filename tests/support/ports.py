"""The tests' import point for ``benchmarks.harness.ports``: ports for processes told their port
before they start, picked outside the kernel's ephemeral range (see there why)."""

from __future__ import annotations

from benchmarks.harness.ports import free_port as free_port
