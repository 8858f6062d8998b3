"""kvserver/files.py: write_atomic replaces a file whole, or leaves it as it was; read_limited
stops at its byte limit and, for a FIFO or device, at its wait."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvserver.files import TooLarge, read_limited, write_atomic


@pytest.mark.parametrize("data", ["text é", b"\x00bytes\xff"])
def test_write_atomic_replaces_the_file_with_exactly_the_data(
    tmp_path: Path, data: str | bytes
) -> None:
    path = tmp_path / "ready.json"
    path.write_text("old")
    write_atomic(str(path), data)
    got = path.read_bytes()
    assert got == (data.encode() if isinstance(data, str) else data)
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]  # no temporary file left


def test_a_failed_replace_leaves_the_target_and_no_temporary_file(tmp_path: Path) -> None:
    """The target is a non-empty directory: the rename fails, nothing else changes."""
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("keep")
    with pytest.raises(OSError):
        write_atomic(str(target), "new")
    assert (target / "inside").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_read_limited_reads_a_file_up_to_its_limit_and_refuses_one_byte_more(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b"x" * 100)
    assert read_limited(str(path), 100) == b"x" * 100
    with pytest.raises(TooLarge, match=f"{path} is larger than 99 bytes"):
        read_limited(str(path), 99)


def test_read_limited_stops_an_endless_device_at_its_limit() -> None:
    """/dev/zero never ends: was read until memory ran out."""
    with pytest.raises(TooLarge):
        read_limited("/dev/zero", 1 << 20)


def test_read_limited_gives_up_on_a_fifo_nobody_writes(tmp_path: Path) -> None:
    """Was: open() blocked for ever waiting for a writer."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TimeoutError, match=r"no end of file within 0\.2 s"):
        read_limited(str(fifo), 1024, wait_s=0.2)


def test_read_limited_reads_a_fifo_to_its_writers_end(tmp_path: Path) -> None:
    """A pipe with a writer (``--config <(...)``) is read whole, however slowly it comes."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as fh:
            for _ in range(3):
                fh.write(b"dram = 1\n")
                fh.flush()

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert read_limited(str(fifo), 1024, wait_s=60.0) == b"dram = 1\n" * 3
    finally:
        writer.join(60)
