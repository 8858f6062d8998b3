"""benchmarks/transfer_instructions.py drives the tree's own CPU transfer engine: every kind
runs once without valgrind (planning, transfers of 16 chunks and of one, every layout) and
leaves nothing in flight (its assertion)."""

from __future__ import annotations

from benchmarks.transfer_instructions import KINDS, run_kinds


def test_every_kind_runs_once_through_the_engine() -> None:
    seconds = run_kinds(1, None)
    assert sorted(seconds) == sorted(KINDS)
