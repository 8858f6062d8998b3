"""SchedulerConfig / ProcessConfig validation: one clear InvalidArgument naming the field."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvserver.errors import InvalidArgument
from scheduler.config import ProcessConfig, SchedulerConfig


def test_defaults_and_derived_values() -> None:
    cfg = SchedulerConfig(num_gpu_blocks=11, block_size=4)
    assert cfg.usable_blocks == 10 and cfg.model_len == 40
    assert SchedulerConfig(num_gpu_blocks=11, block_size=4, max_model_len=12).model_len == 12


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"num_gpu_blocks": 1}, "num_gpu_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"policy": "lifo"}, "policy"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"max_model_len": 10**9}, "max_model_len"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "max_num_batched"),
    ],
)
def test_bad_scheduler_configs(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        SchedulerConfig(**kw)
    assert field in str(info.value)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"workers": ("tcp://a:1",), "synthetic_workers": 2},
        {"workers": ("a:1",)},
        {"synthetic_workers": 1, "step_timeout_s": 0},
        {"synthetic_workers": 1, "kvserver_lookup_timeout_s": 0},
        {"synthetic_workers": 1, "kvserver_op_timeout_s": -1.0},
        {"synthetic_workers": 1, "chunk_blocks": 0},
        {"synthetic_workers": 1, "grpc_max_connections_per_address": 0},
    ],
)
def test_bad_process_configs(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        ProcessConfig(**kw)
    assert ProcessConfig(synthetic_workers=2).num_workers == 2


def test_a_kvserver_address_the_client_refuses_is_refused_naming_the_field() -> None:
    """``--kvserver tcp://HOST`` (no port) or ``:99999``: was taken, and the connector's first
    call raised a bare ZMQError (or timed out for ever); now the config refuses it."""
    for address in ("tcp://127.0.0.1", "tcp://127.0.0.1:99999", "nosuch://x"):
        with pytest.raises(InvalidArgument, match=r"^kvserver: bad daemon address '"):
            ProcessConfig(synthetic_workers=1, kvserver=address)
    for address in ("tcp://127.0.0.1:9471", "127.0.0.1", "ipc:///run/kv.sock"):
        assert ProcessConfig(synthetic_workers=1, kvserver=address).kvserver == address


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("tcp://127.0.0.1:notaport", "port 'notaport' is not 1-65535"),
        ("tcp://127.0.0.1:99999", "port '99999' is not 1-65535"),
        ("tcp://:9500", "no host"),
        ("ipc://", "no ipc:// path"),
    ],
)
def test_a_worker_address_zmq_cannot_connect_to_is_one_error_line(address: str, why: str) -> None:
    """``kvserver scheduler --workers ADDRESS``. Before: ``zmq.error.ZMQError: Invalid
    argument`` as a traceback (no port number, an empty ipc:// path), or a hello that waited
    ``--hello-timeout-s`` for a port no worker can have (99999)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "scheduler", "--workers", address,
         "--grpc-port", "0", "--metrics-port", "-1", "--hello-timeout-s", "120"],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"kvserver scheduler: error: bad worker address {address!r}: {why}; "
        "give tcp://HOST:PORT or ipc://PATH"
    )
    assert ProcessConfig(workers=("tcp://[::1]:9500", "ipc:///run/w0")).num_workers == 2


def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserver.cli import main

    assert main(["scheduler", "--synthetic-workers", "1", "--num-gpu-blocks", "1"]) == 2
    assert "num_gpu_blocks" in capsys.readouterr().err
    flag = "--grpc-max-connections-per-address"
    assert main(["scheduler", "--synthetic-workers", "1", flag, "0"]) == 2
    assert "grpc_max_connections_per_address" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["scheduler", "--synthetic-workers", "1", "--workers", "tcp://a:1"])
    assert info.value.code == 2
