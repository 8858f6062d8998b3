"""``kvserver worker`` refuses what it cannot run with one line and exit status 2 (usage),
before any start-up work: no torch, no model file, ``--device cuda`` without CUDA, a
malformed ``--listen``. Run as ``python3 -m worker`` (the same parser as ``kvserver worker``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
