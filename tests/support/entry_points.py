"""Make the ``kvserver.commands`` entry points of pyproject.toml visible to the tests.

``kvserver scheduler`` / ``worker`` / ``bench`` are found through entry points, which exist only
where the package was installed from this tree's pyproject.toml (CI installs it fresh). A
developer running the suite against an older install, or with only PYTHONPATH, would otherwise
get the "not installed" stand-ins. :func:`declare_commands` writes what ``pip install`` would
write for them (a ``.dist-info`` with ``entry_points.txt``, generated from pyproject.toml) into
a temporary directory put first on ``sys.path`` and ``PYTHONPATH`` (so processes the tests start
see it too); where the installed metadata already declares them it does nothing.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

from kvserver.cli import COMMANDS_GROUP

ROOT = Path(__file__).resolve().parents[2]


def declared_commands() -> dict[str, str]:
    """``name -> "module:function"`` of the group in pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        doc = tomllib.load(f)
    commands: dict[str, str] = doc["project"]["entry-points"][COMMANDS_GROUP]
    return commands


def declare_commands() -> Path | None:
    """Declare pyproject's commands unless installed; the directory it added, or None."""
    declared = declared_commands()
    installed = {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP)}
    if all(installed.get(name) == value for name, value in declared.items()):
        return None
    directory = Path(tempfile.mkdtemp(prefix="kvserver-entry-points-"))
    atexit.register(shutil.rmtree, directory, True)
    dist = directory / "kvserver_source_tree-0.dist-info"
    dist.mkdir()
    metadata = "Metadata-Version: 2.1\nName: kvserver-source-tree\nVersion: 0\n"
    (dist / "METADATA").write_text(metadata)
    lines = [f"[{COMMANDS_GROUP}]", *(f"{k} = {v}" for k, v in declared.items())]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    sys.path.insert(0, str(directory))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(directory), os.environ.get("PYTHONPATH")) if p
    )
    return directory
