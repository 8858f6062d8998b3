"""A real small filesystem for the tests of full disks and full shared memory: a tmpfs of a
given size mounted under the test's directory (root only), and its unmounting."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def mount_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` on ``path`` (root only); False where that is not allowed."""
    path.mkdir()
    if os.geteuid() != 0:
        return False
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


def unmount(path: Path) -> None:
    """Unmount what :func:`mount_tmpfs` mounted on ``path`` (nothing if it is not mounted)."""
    subprocess.run(["umount", str(path)], capture_output=True, timeout=30)
