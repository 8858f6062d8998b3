"""``kvserver`` itself (kvserver/cli.py): what every subcommand shares, a misspelt option and
Ctrl-C, as a user meets them."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.cli import main
from tests.support.ports import free_port


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["start", "--dramm", "8GiB"], "kvserver start: error: unrecognized arguments: "
         "--dramm (did you mean --dram?) 8GiB; kvserver start --help lists its options"),
        (["status", "--sever", "h:1", "--jsn"], "kvserver status: error: unrecognized "
         "arguments: --sever (did you mean --server?) h:1 --jsn (did you mean --json?); "
         "kvserver status --help lists its options"),
        (["hash", "--algo", "sha256", "--block-size", "4", "--xyzzy", "1"],
         "kvserver hash: error: unrecognized arguments: --xyzzy; kvserver hash --help"),
    ],
    ids=["start", "status", "hash"],
)  # fmt: skip
def test_a_misspelt_option_is_named_with_the_closest_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """Was: the top-level usage ("usage: kvserver [-h] [--version] COMMAND ...") and
    "kvserver: error: unrecognized arguments: --dramm 8GiB", no word of --dram."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    usage, line = capsys.readouterr().err.splitlines()
    assert usage.startswith(f"usage: kvserver {argv[0]} [options]"), usage
    assert line.startswith(said), line


def _as_a_terminal() -> None:
    """The command's SIGINT as a terminal's foreground job has it: a suite started in the
    background (``.ci/run &``, ``nohup``) has SIGINT ignored, which its children inherit
    across exec, and a command that inherits an ignored SIGINT rightly keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.multiprocess
def test_ctrl_c_ends_a_command_as_sigint_does_without_a_traceback(tmp_path: Path) -> None:
    """``kvserver lookup --tokens-file -`` (or ``hash -``) waiting on its input, Ctrl-C: was a
    KeyboardInterrupt traceback of a dozen lines."""
    fifo = tmp_path / "tokens"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-m", "kvserver.cli", "lookup", "--model", "m", "--tokens-file",
           str(fifo), "--server", f"127.0.0.1:{free_port()}"]  # fmt: skip
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_a_terminal
    ) as proc:
        try:
            with open(fifo, "w"):  # returns once the command opened it: it waits on its input
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert proc.returncode == -signal.SIGINT, err  # as killed by it: a shell's loop stops
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert out == ""


def test_a_bad_start_flag_value_is_not_buried_under_the_whole_usage() -> None:
    """``kvserver start --grpc-port abc`` printed the 28 lines of every option's synopsis
    before the error; ``kvserver start --help`` lists them, with examples."""
    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "start", "--grpc-port", "abc"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "usage: kvserver start [options]",
        "kvserver start: error: argument --grpc-port: invalid int value: 'abc'; "
        "kvserver start --help lists its options",
    ]
    shown = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "start", "--help"],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "--dram SIZE " in shown and "--grpc-port PORT " in shown  # what a value is
    assert "\nexamples:\n  kvserver start " in shown and "\nexit status: 0 " in shown


#: a usage error of each subcommand (``kvserver --help`` lists them), of ``kvserver`` and of
#: the subcommands' modules run alone (``python -m scheduler``: no entry points):
#: name -> (module, argv, its short usage, its error)
USAGE_ERRORS = {
    "kvserver": ("kvserver.cli", [], "kvserver [options] COMMAND ...",
                 "the following arguments are required: COMMAND"),
    "hash": ("kvserver.cli", ["hash", "--algo", "sha256", "--block-size", "x", "1"],
             "kvserver hash [options] TOKEN [TOKEN ...]",
             "argument --block-size: invalid int value: 'x'"),
    "start": ("kvserver.cli", ["start", "--zmq-port"], "kvserver start [options]",
              "argument --zmq-port: expected one argument"),
    "status": ("kvserver.cli", ["status", "--timeout", "soon"], "kvserver status [options]",
               "argument --timeout: invalid float value: 'soon'"),
    "lookup": ("kvserver.cli", ["lookup", "--tokens", "1"], "kvserver lookup [options]",
               "the following arguments are required: --model"),
    "keys": ("kvserver.cli", ["keys", "kind"], "kvserver keys [options] KIND ...",
             "argument KIND: invalid choice: 'kind' (choose from 'curve', 'tls', 'token')"),
    "keys token": ("kvserver.cli", ["keys", "token"], "kvserver keys token [options] directory",
                   "the following arguments are required: directory"),
    "bench": ("kvserver.cli", ["bench", "--repeats", "x"], "kvserver bench [options]",
              "argument --repeats: invalid int value: 'x'"),
    "scheduler": ("kvserver.cli",
                  ["scheduler", "--workers", "tcp://127.0.0.1:1", "--synthetic-workers", "1"],
                  "kvserver scheduler [options]",
                  "argument --synthetic-workers: not allowed with argument --workers"),
    "worker": ("kvserver.cli", ["worker", "--rank", "0"], "kvserver worker [options]",
               "the following arguments are required: --world-size, --listen, --dist-init, "
               "--model-file"),
    "python -m scheduler": ("scheduler", ["--grpc-port", "x", "--synthetic-workers", "1"],
                            "kvserver scheduler [options]",
                            "argument --grpc-port: invalid int value: 'x'"),
    "python -m worker": ("worker", ["--rank"], "kvserver worker [options]",
                         "argument --rank: expected one argument"),
    "python -m benchmarks.bench_daemon": ("benchmarks.bench_daemon", ["--dram"],
                                          "kvserver bench [options]",
                                          "argument --dram: expected one argument"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(USAGE_ERRORS))
def test_every_usage_error_is_a_short_usage_and_the_error_saying_where_help_is(name: str) -> None:
    """``kvserver status`` / ``lookup`` / ``hash`` / ``scheduler`` / ``worker`` / ``bench``
    printed their whole synopsis (3 to 28 lines) above the error line; ``start`` printed
    one usage line and the error, no word of --help. ``python -m scheduler`` (and worker,
    bench), the subcommands without the entry points, say the same."""
    module, argv, usage, error = USAGE_ERRORS[name]
    result = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    prog = usage.split(" [options]")[0]
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"usage: {usage}",
        f"{prog}: error: {error}; {prog} --help lists its options",
    ]


def test_every_subcommand_has_its_usage_error_checked() -> None:
    """USAGE_ERRORS names every subcommand ``kvserver --help`` lists (one added later too)."""
    from kvserver.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) <= set(USAGE_ERRORS)


@pytest.mark.parametrize(
    ("argv", "said", "status"),
    [
        (["start", "--dram", "0"], "kvserver start: error: dram: size must be positive", 2),
        (["keys", "token", "{file}/keys"], "kvserver keys: error: cannot write in ", 2),
        (["keys", "curve", "{file}"], "kvserver keys: error: {file} is a file, not a directory", 2),
        (["scheduler", "--synthetic-workers", "1", "--tls-cert-file", "{file}"],
         "kvserver scheduler: error: tls_cert_file and tls_key_file go together", 2),
        (["worker", "--rank", "0", "--world-size", "1", "--listen", "bogus", "--dist-init",
          "tcp://127.0.0.1:1", "--model-file", "{file}"],
         "kvserver worker: error: bad --listen 'bogus'", 2),
        (["hash", "--algo", "sha256", "--block-size", "4", "x"], "kvserver hash: error: ", 2),
        (["bench", "--dram", "abc"], "kvserver bench: error: --dram: bad size 'abc'", 2),
    ],
    ids=["start", "keys-under-a-file", "keys-a-file", "scheduler", "worker", "hash", "bench"],
)  # fmt: skip
def test_every_subcommand_says_error_on_its_error_line(
    tmp_path: Path, argv: list[str], said: str, status: int
) -> None:
    """``kvserver status`` / ``lookup`` / ``hash`` wrote ``kvserver CMD: error: ...``, while
    ``start``, ``keys``, ``scheduler`` and ``worker`` wrote ``kvserver CMD: ...`` (no word
    that it is an error); ``keys`` under a file was a NotADirectoryError traceback; ``bench
    --dram abc`` was "kvserver bench: daemon did not start:", a blank line, the daemon's
    error, exit status 1."""
    file = tmp_path / "a-file"
    file.write_text("")
    argv = [a.replace("{file}", str(file)) for a in argv]
    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", *argv],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == status, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(said.replace("{file}", str(file))), line


@pytest.mark.parametrize(
    "command", ["hash", "start", "status", "lookup", "keys", "bench", "scheduler", "worker"]
)
def test_every_subcommands_help_is_plain_text_with_whole_sentences(command: str) -> None:
    """``kvserver bench --help`` was a paragraph of its module's docstring: reST quotes
    (````--zmq````) and cut at the colon announcing the list of what it measures."""
    result = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", command, "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    description = result.stdout.split("\n\n")[1]  # after the usage
    assert "``" not in result.stdout
    assert not description.rstrip().endswith(":"), description
