"""kvserver/cli.py: the ``kvserver hash`` subcommand."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from kvserver.cli import main
from kvserver.hashing import BlockHasher

REPO_ROOT = Path(__file__).resolve().parents[2]

# From tests/vectors/block_hashes.json (tests/kvserver/test_hashing.py checks all of them).
COUNTING_64 = [str(t) for t in range(64)]
WITH_LORA_SHA256_CBOR = [
    "adc803fcae840973111bd63bf15dac6da359258fb73e16dbe87f95a5c33d7ef1",
    "f0a6392d45f9a891f235f66558e5d3b3928979e8b251bef62c32526edcd0179b",
    "8aca0ec834b220daffa0ec3a47e45e6c2a9daf7556d766ab929af28ab61a2f2c",
    "74201f5048cda17d2f7778b6cba669292d7ac932b6a8858b695e71a2893f47c0",
]
COUNTING_XXHASH_CBOR = [
    "f2313f4548e185b1a011187a342021cc",
    "74ee692fcce0684e02de354d6ca364b4",
    "ba446d3f8c0903b1e39d2d10585de305",
    "d2a4cd8afca0dfca731dcbbf379d0a90",
]
WITH_CACHE_SALT_SHA256 = [
    "255b152c89e763273cf1498dce0dfd4efdf44000fe683cd2af1845b5b8426a35",
    "0b121889fe54bbf6ac27a6b0308093ef6888870e46ccb622615af235d422e992",
    "ffc80a183d8ebc628d79d80ff745af5b73b1eb158e1b885bf71814c023020d8a",
    "6d243c21a873a3ae464d7f08e649678e55c486adce3944fd42bb4f63fa3510b2",
]


def run_hash(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    """(exit code, stdout lines, stderr) of ``kvserver hash ARGS`` run in-process."""
    rc = main(["hash", *args])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def test_prints_vector_hashes_with_lora(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--algo", "sha256_cbor", "--block-size", "16", "--lora", "sql-adapter:/adapters/sql"]
    rc, lines, err = run_hash(capsys, *args, *COUNTING_64)
    assert (rc, lines, err) == (0, WITH_LORA_SHA256_CBOR, "")


def test_comma_separated_tokens_and_cache_salt(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--algo", "sha256", "--block-size", "16", "--cache-salt", "tenant-a"]
    rc, lines, _ = run_hash(capsys, *args, ",".join(COUNTING_64[:30]), *COUNTING_64[30:])
    assert (rc, lines) == (0, WITH_CACHE_SALT_SHA256)


def test_tokens_from_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stdin = " ".join(COUNTING_64[:20]) + "\n" + ",".join(COUNTING_64[20:60]) + ",\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc, lines, _ = run_hash(
        capsys, "--algo", "xxhash_cbor", "--block-size", "16", "-", "60,61", "62", "63"
    )
    assert (rc, lines) == (0, COUNTING_XXHASH_CBOR)


def test_chunk_blocks_prints_last_block_of_each_full_chunk(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--algo", "xxhash_cbor", "--block-size", "8", "--chunk-blocks", "3"]
    rc, lines, err = run_hash(capsys, *args, *COUNTING_64)
    blocks = BlockHasher("xxhash_cbor", 8).hash_blocks(range(64))
    assert (rc, lines) == (0, [blocks[2].hex(), blocks[5].hex()])
    assert "2 block(s) form no full chunk" in err


def test_seed_and_partial_tail(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--algo", "sha256", "--block-size", "16", "--seed", "42"]
    rc, lines, err = run_hash(capsys, *args, *COUNTING_64[:40])
    expected = BlockHasher("sha256", 16, seed="42").hash_blocks(range(32))
    assert (rc, lines) == (0, [h.hex() for h in expected])
    assert "last 8 token(s) form no full block" in err


def test_lora_path_may_contain_colons(capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines, _ = run_hash(
        capsys, "--algo", "sha256", "--block-size", "2", "--lora", "a:b:c", "1", "2"
    )
    expected = BlockHasher("sha256", 2).hash_blocks([1, 2], lora=("a", "b:c"))
    assert (rc, lines) == (0, [expected[0].hex()])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--algo", "md5", "--block-size", "16", "1"], "sha256, sha256_cbor, xxhash_cbor"),
        (["--algo", "sha256", "--block-size", "16", "1", "x"], "bad token 'x'"),
        (["--algo", "sha256", "--block-size", "16", "1,-5"], "bad token '-5'"),
        (["--algo", "sha256", "--block-size", "16", "1.5"], "bad token '1.5'"),
        (["--algo", "sha256", "--block-size", "16", str(1 << 32)], "in [0, 2**32)"),
        (["--algo", "sha256", "--block-size", "16", "--lora", "nocolon", "1"], "NAME:PATH"),
        (["--algo", "sha256", "--block-size", "0", "1"], "block_size"),
        (["--algo", "sha256", "--block-size", "4", "--chunk-blocks", "0", "1"], "chunk_blocks"),
    ],
    ids=["algo", "token", "negative", "float", "over-32-bit", "lora", "block-size", "chunk-blocks"],
)
def test_bad_input_exits_2_with_a_message(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc, lines, err = run_hash(capsys, *args)
    assert (rc, lines) == (2, [])
    assert err.startswith("kvserver hash: error: ")
    assert message in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["hash", "--block-size", "16", "1"])
    assert info.value.code == 2
    assert "--algo" in capsys.readouterr().err


def test_hash_and_lookup_share_one_token_parser() -> None:
    """Token ids are parsed in one place (kvserver.cli_ops.parse_tokens), one limit for both."""
    from kvserver import cli_ops

    assert cli_ops.parse_tokens(f"0, {(1 << 32) - 1}\n7") == [0, (1 << 32) - 1, 7]
    with pytest.raises(ValueError, match="2\\*\\*32"):
        cli_ops.parse_tokens(str(1 << 32))


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserver import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kvserver {__version__}\n"


def test_console_entry_point_runs_as_a_process() -> None:
    args = ["--algo", "sha256_cbor", "--block-size", "16", "--lora", "sql-adapter:/adapters/sql"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver.cli", "hash", *args, *COUNTING_64],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (proc.returncode, proc.stdout.splitlines(), proc.stderr) == (
        0,
        WITH_LORA_SHA256_CBOR,
        "",
    )
