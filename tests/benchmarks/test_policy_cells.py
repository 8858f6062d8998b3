"""benchmarks/policy_cells.py: a cell is ``bench_policies``' replay of the same trace, budget
and seed (its hit rate is the recorded one to the last digit while the policy is unchanged),
and the summary reads the recorded references of that replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import policy_cells
from benchmarks.policy_cells import REFERENCE, main, recorded, replay_cell, summarize


@pytest.mark.parametrize("policy", ["chain", "prefix"])
def test_a_cell_gives_the_recorded_hit_rate_of_its_replay(policy: str) -> None:
    """system at 5 %, seed 0: the recorded run's figure for the policy, to the last digit
    (fails when the policy's decisions change and results/policies.json was not rerun)."""
    reference = json.loads(REFERENCE.read_text())
    assert (
        replay_cell((policy, "system", "5%", 0)) == recorded(reference, "system", "5%", 0)[policy]
    )


def test_the_summary_reads_the_gap_closed_against_the_references() -> None:
    reference = {
        "traces": {
            "chat": {
                "seeds": [0, 1],
                "per_seed": [
                    {
                        "hit_rates": {
                            "5%": {"arc": 0.5, "belady": 0.7, "prefix": 0.55, "chain": 0.6}
                        }
                    },
                    {"hit_rates": {"5%": {"arc": 0.4, "belady": 0.8, "prefix": 0.5, "chain": 0.6}}},
                ],
            }
        }
    }
    cells = [("chain", "chat", "5%", 0), ("chain", "chat", "5%", 1), ("chain", "chat", "10%", 0)]
    lines = summarize("chain", cells, [0.6, 0.6, 0.75], reference)
    assert lines[0].split() == [
        "chat", "5%", "0.60000", "closes", "+50.0%", "(50%", "/", "50%)", "vs", "recorded",
        "+0.00000", "over", "prefix,", "worst", "seed", "+0.05000",
    ]  # fmt: skip
    assert lines[1].split() == ["chat", "10%", "0.75000", "0.75000"]  # no reference: rates alone


def test_main_writes_each_cells_hit_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(policy_cells, "REFERENCE", tmp_path / "none.json")
    out = tmp_path / "cells.json"
    argv = ["--policy", "lru", "--traces", "system", "--budgets", "20%", "--seeds", "0"]
    assert (
        main([*argv, "--jobs", "1", "--reference", str(tmp_path / "none.json"), "--json", str(out)])
        == 0
    )
    rates = json.loads(out.read_text())
    assert list(rates) == ["lru@system@20%@0"]
    assert rates["lru@system@20%@0"] == replay_cell(("lru", "system", "20%", 0))
    assert capsys.readouterr().out.startswith("system")
