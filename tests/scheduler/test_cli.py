"""scheduler/cli.py: ``kvserver scheduler`` runs gRPC core's polling engine, as ``kvserver start``
does (kvserver/grpc_engine.py): the variable is set before anything imports grpc, so it takes
effect, and an operator's value wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.grpc_engine import ENV, POLLING_EXPERIMENTS

#: runs ``kvserver scheduler`` up to the process's main, which reports instead of starting.
PROBE = """
import os, sys, types
stub = types.ModuleType("scheduler.process")
def main(config):
    print(repr(os.environ.get("GRPC_EXPERIMENTS")), "grpc" in sys.modules)
    return 0
stub.main = main
sys.modules["scheduler.process"] = stub
from kvserver.cli import main as cli
sys.exit(cli(["scheduler", "--synthetic-workers", "1", "--grpc-port", "0"]))
"""


def _probe(env: dict[str, str]) -> str:
    base = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_scheduler_selects_the_polling_engine_before_grpc_loads() -> None:
    assert _probe({}) == f"{POLLING_EXPERIMENTS!r} False"


@pytest.mark.parametrize("value", ["", "event_engine_client"])
def test_an_operators_value_wins(value: str) -> None:
    assert _probe({ENV: value}) == f"{value!r} False"


@pytest.mark.multiprocess
def test_a_grpc_port_in_use_is_one_line_naming_the_flag_that_moves_it() -> None:
    """``kvserver scheduler --grpc-port P`` with P taken: exit 1, the flag to give; was
    "Failed to bind ...; set GRPC_VERBOSITY=debug environment variable ..." (gRPC's words)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvserver.cli", "scheduler", "--synthetic-workers", "1",
             "--host", "127.0.0.1", "--grpc-port", str(port), "--metrics-port", "-1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvserver scheduler: error: cannot bind gRPC to 127.0.0.1:{port}"), last
    assert "choose another with --grpc-port PORT" in last and "GRPC_VERBOSITY" not in last


@pytest.mark.parametrize("name", ["scheduler", "worker"])
def test_help_names_each_value_states_examples_and_exit_statuses(name: str) -> None:
    """``kvserver scheduler --help`` / ``worker --help`` as ``kvserver start --help`` (session
    13): each value a metavar saying what it is (was: ``--step-timeout-s STEP_TIMEOUT_S``,
    ``--rank RANK``, ``--ready-file READY_FILE``), examples, the exit statuses."""
    from tests.test_docs import subcommand_parsers

    parser = subcommand_parsers()[name]
    shouted = [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.nargs != 0 and a.metavar is None and a.choices is None
    ]
    assert shouted == []
    shown = parser.format_help()
    assert f"\nexamples:\n  kvserver {name} " in shown and "\nexit status: 0 " in shown


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--ready-file", "{tmp}/missing/ready.json"],
         "cannot write --ready-file {tmp}/missing/ready.json: No such file"),
        (["--log-level", "loud"], "log_level must be one of DEBUG, INFO"),
        (["--trace", "{tmp}/missing/trace.jsonl"],
         "cannot write --trace {tmp}/missing/trace.jsonl: No such file"),
    ],
    ids=["ready-file", "log-level", "trace"],
)  # fmt: skip
def test_a_bad_value_is_one_line_before_the_scheduler_starts(
    tmp_path: Path, args: list[str], said: str
) -> None:
    """Was: an unwritable --ready-file a FileNotFoundError traceback once serving (then the
    scheduler stopped); --log-level loud taken as INFO without a word."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "scheduler", "--synthetic-workers", "1",
         "--grpc-port", "0", "--metrics-port", "-1", *args],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"kvserver scheduler: error: {said.replace('{tmp}', str(tmp_path))}")
