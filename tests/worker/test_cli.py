"""``kvserver worker`` refuses what it cannot run with one line and exit status 2 (usage),
before any start-up work: no torch, no model file, ``--device cuda`` without CUDA, a
malformed ``--listen``. Run as ``python3 -m worker`` (the same parser as ``kvserver worker``)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ports import free_port

BASE = ["--rank", "0", "--world-size", "1", "--dist-init", "tcp://127.0.0.1:1"]


def run_worker(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = (
        f"{prelude}import runpy, sys; sys.argv = ['worker', *sys.argv[1:]]; "
        "runpy.run_module('worker', run_name='__main__')"
    )
    cmd = [sys.executable, "-c", code, *BASE, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip()
    assert line.startswith("kvserver worker: error: ") and "\n" not in line, line
    for word in words:
        assert word in line, line


def test_a_missing_model_file_says_how_to_get_one(tmp_path: Path) -> None:
    missing = tmp_path / "none.safetensors"
    result = run_worker("--listen", "tcp://127.0.0.1:0", "--model-file", str(missing))
    refused(result, "model file not found", str(missing), "--write-random-model-seed")


@pytest.mark.parametrize("listen", ["foo", "127.0.0.1:9500", "tcp://127.0.0.1", "tcp://h:99999"])
def test_a_bad_listen_address_is_a_usage_error(tmp_path: Path, listen: str) -> None:
    result = run_worker("--listen", listen, "--model-file", str(tmp_path / "m"))
    refused(result, "bad --listen", listen)


def test_device_cuda_without_cuda_is_a_usage_error(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"")
    result = run_worker(
        "--listen", "tcp://127.0.0.1:0", "--model-file", str(model), "--device", "cuda"
    )
    refused(result, "--device cuda", "--device cpu")


def test_without_torch_it_says_which_extra_to_install(tmp_path: Path) -> None:
    """torch made unimportable in the child (a None entry in sys.modules: ImportError)."""
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"")
    result = run_worker(
        "--listen", "tcp://127.0.0.1:0", "--model-file", str(model),
        prelude="import sys; sys.modules['torch'] = None; ",
    )  # fmt: skip
    refused(result, "needs torch", "pip install '.[torch]'")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--rank", "1"], ["--rank 1 --world-size 1", "0 to world size - 1"]),
        (["--world-size", "0"], ["--world-size 0", "at least 1"]),
        (["--dist-init", "127.0.0.1:29500"], ["bad --dist-init", "tcp://10.0.0.5:29500"]),
        (["--kvserver", "kv-host:99999"], ["bad --kvserver 'kv-host:99999'", "1-65535"]),
        (["--ready-file", "{tmp}/missing/ready.json"], ["cannot write --ready-file"]),
        (["--log-level", "loud"], ["bad --log-level 'loud'", "DEBUG, INFO"]),
        (["--threads", "-1"], ["bad --threads -1"]),
    ],
    ids=["rank", "world-size", "dist-init", "kvserver", "ready-file", "log-level", "threads"],
)
def test_a_bad_value_is_a_usage_error_before_the_model_is_read(
    tmp_path: Path, args: list[str], words: list[str]
) -> None:
    """Was: the model loaded first (here: a traceback for the empty file), then 'num_heads is
    not divisible by the TP world size (world_size=0)', 'No rendezvous handler for ://', a
    worker serving for ever with a daemon address no one can reach, a FileNotFoundError once
    serving, and --log-level loud taken as INFO."""
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run_worker("--listen", "tcp://127.0.0.1:0", "--model-file", str(model), *args)
    refused(result, *words)


def test_a_model_file_that_is_not_safetensors_is_one_line(tmp_path: Path) -> None:
    """Was: a SafetensorError traceback (exit 1)."""
    model = tmp_path / "m.safetensors"
    model.write_text("not a model\n")
    result = run_worker("--listen", "tcp://127.0.0.1:0", "--model-file", str(model))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvserver worker: error: cannot read --model-file {model}: "), line


def _as_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as tests/kvserver/test_cli.py says why
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.multiprocess
def test_ctrl_c_while_rank_0_waits_for_the_other_ranks_ends_it(tmp_path: Path) -> None:
    """Scenario: rank 0 of 2 started, rank 1 not (yet); the operator presses Ctrl-C. Was:
    nothing happened (torch's rendezvous waits in C++, where Python's handler never runs)
    until the rendezvous timed out, 60 s later."""
    model = tmp_path / "m.safetensors"
    cmd = [sys.executable, "-m", "kvserver.cli", "worker", "--rank", "0", "--world-size", "2",
           "--dist-init", f"tcp://127.0.0.1:{free_port()}", "--listen", "tcp://127.0.0.1:0",
           "--model-file", str(model), "--write-random-model-seed", "1"]  # fmt: skip
    with subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, preexec_fn=_as_a_terminal
    ) as proc:
        try:
            assert proc.stderr is not None
            for line in proc.stderr:  # the line says it waits, once SIGINT ends it
                if "waiting for the other ranks" in line:
                    break
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=45)  # the rendezvous itself waits 60 s
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert proc.returncode == -signal.SIGINT, err
    assert "Traceback" not in err, err
