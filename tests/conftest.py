"""Suite-wide set-up: the ``kvserver.commands`` entry points (tests/support/entry_points.py)."""

from __future__ import annotations

from tests.support.entry_points import declare_commands

declare_commands()
