"""Reading callgrind's per-kind dumps: the instruction-count benchmarks (lookup_instructions.py,
store_instructions.py) run each kind of call N times between two ``callgrind_control --dump
kind<I>x<N>`` and read the totals back here."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

_TRIGGER = re.compile(r"^desc: Trigger: .*kind(\d+)x(\d+)\s*$", re.M)
_SUMMARY = re.compile(r"^summary: (\d+)$", re.M)


def dump_name(index: int, n: int) -> str:
    """The dump name that marks ``n`` calls of kind ``kinds[index]``."""
    return f"kind{index}x{n}"


def per_call(out: Path, pattern: str, kinds: Sequence[str]) -> dict[str, float]:
    """Instructions per call of each of ``kinds`` (in their order) in the dumps of ``out``
    matching ``pattern`` (e.g. ``daemon.*.*``); dumps without a kind (the warm-up one, the
    final one) are skipped. SystemExit naming the kinds no dump counted."""
    counts: dict[str, float] = {}
    for path in out.glob(pattern):
        text = path.read_text(errors="replace")[:4096]
        trigger, total = _TRIGGER.search(text), _SUMMARY.search(text)
        if trigger is None or total is None:
            continue
        counts[kinds[int(trigger.group(1))]] = int(total.group(1)) / int(trigger.group(2))
    missing = [kind for kind in kinds if kind not in counts]
    if missing:
        raise SystemExit(f"no callgrind dump of {missing} ({pattern}) in {out}")
    return {kind: counts[kind] for kind in kinds}
