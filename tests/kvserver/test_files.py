"""kvserver/files.py: write_atomic replaces a file whole, or leaves it as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.files import write_atomic


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
