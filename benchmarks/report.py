"""Writing a benchmark's results: the JSON document, and the PNG chart beside it.

Runs in the bench process, once at the end of a run. Charts need matplotlib; without it the
JSON is still written and the line printed says there is no chart.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def save_report(path: Path, document: Any, write_chart: Callable[[Path], bool]) -> None:
    """Write ``document`` as JSON to ``path`` (making its folder), then the chart to ``path``
    with suffix ``.png`` (``write_chart`` returns False when matplotlib is missing); prints
    what was written. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    chart = path.with_suffix(".png")
    if write_chart(chart):
        print(f"wrote {path} and {chart}")
    else:
        print(f"wrote {path} (no matplotlib: no chart)")
