"""kvserver/grpc_engine.py: the polling engine is selected before grpc loads, never over an
operator's GRPC_EXPERIMENTS, and never once grpc is imported (it would be a silent no-op)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserver.grpc_engine import ENV, POLLING_EXPERIMENTS, use_polling_engine

PROBE = (
    "import os, sys\n"
    "{before}\n"
    "from kvserver.grpc_engine import use_polling_engine\n"
    "print(use_polling_engine(), repr(os.environ.get('GRPC_EXPERIMENTS')), 'grpc' in sys.modules)"
)


def _probe(before: str = "", env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


def test_sets_the_variable_in_a_fresh_process_without_importing_grpc() -> None:
    assert _probe() == f"True {POLLING_EXPERIMENTS!r} False"


@pytest.mark.parametrize("value", ["", "event_engine_client"])
def test_an_operators_value_wins(value: str) -> None:
    assert _probe(env={ENV: value}) == f"False {value!r} False"


def test_too_late_once_grpc_is_imported() -> None:
    assert _probe(before="import grpc") == "False None True"


def test_a_given_mapping() -> None:
    env: dict[str, str] = {}
    if "grpc" in sys.modules:  # this test process may have loaded it already
        assert use_polling_engine(env) is False and env == {}
    else:
        assert use_polling_engine(env) is True and env == {ENV: POLLING_EXPERIMENTS}
    kept = {ENV: "x"}
    assert use_polling_engine(kept) is False and kept == {ENV: "x"}
