"""Per-step JSONL trace of the scheduler. Off by default.

Runs in the scheduler process, called from ``Scheduler.schedule()``; not thread-safe. When
``SchedulerConfig.trace_path`` is unset the scheduler holds no tracer at all, so the cost in
production is one ``is None`` check per call site.

Format (version 1): one JSON object per line; every record has ``"type"``, ``"step"`` (the
``StepPlan.step`` it belongs to) and ``"t"`` (wall-clock seconds). Per step, in this order:

- ``snapshot``: the state entering the step — ``running``, ``waiting``,
  ``waiting_for_remote_kvs``, ``delayed_free``, ``free_blocks``, ``total_blocks``,
  ``gpu_cached_blocks``, ``usage``, ``evicted_blocks`` (cumulative), ``max_num_seqs``,
  ``token_budget``;
- ``prefix_cache``: one per admission lookup — ``req_id``, ``local_hit_tokens``,
  ``external_hit_tokens``, ``prompt_tokens``, ``num_tokens``, ``connector`` (class name or
  null), ``load_async``;
- ``decision``: the outcome — ``new``, ``resumed``, ``running``, ``preempted`` (request ids),
  ``num_scheduled_tokens`` (id → tokens), ``total_scheduled_tokens``.

The first line of a file is ``{"type": "header", "version": 1, ...}`` with the configuration.
Records are buffered and flushed at the end of every step, so a reader sees whole steps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from kvserver.errors import StorageError

TRACE_VERSION = 1


class StepTrace:
    """Appends trace records to ``path`` (created or appended to)."""

    def __init__(self, path: str | Path, header: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        try:
            self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise StorageError(
                f"cannot open the trace file: {exc.strerror}", path=str(path), errno=exc.errno
            ) from None
        self._write({"type": "header", "version": TRACE_VERSION, **(header or {})})
        self.flush()

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            record["t"] = round(time.time(), 6)
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def snapshot(self, step: int, **state: Any) -> None:
        """The state entering ``step`` (fields: see the module docstring)."""
        self._write({"type": "snapshot", "step": step, **state})

    def prefix_cache(
        self,
        step: int,
        *,
        req_id: str,
        local_hit_tokens: int,
        external_hit_tokens: int,
        prompt_tokens: int,
        num_tokens: int,
        connector: str | None,
        load_async: bool,
    ) -> None:
        self._write(
            {
                "type": "prefix_cache",
                "step": step,
                "req_id": req_id,
                "local_hit_tokens": local_hit_tokens,
                "external_hit_tokens": external_hit_tokens,
                "prompt_tokens": prompt_tokens,
                "num_tokens": num_tokens,
                "connector": connector,
                "load_async": load_async,
            }
        )

    def decision(
        self,
        step: int,
        *,
        new: list[str],
        resumed: list[str],
        running: list[str],
        preempted: list[str],
        num_scheduled_tokens: dict[str, int],
    ) -> None:
        """The outcome of ``step``; flushes the step's records."""
        self._write(
            {
                "type": "decision",
                "step": step,
                "new": new,
                "resumed": resumed,
                "running": running,
                "preempted": preempted,
                "num_scheduled_tokens": num_scheduled_tokens,
                "total_scheduled_tokens": sum(num_scheduled_tokens.values()),
            }
        )
        self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """Flush and close. Idempotent."""
        f, self._file = self._file, None
        if f is not None:
            f.close()


def read_trace(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a trace file, in order (a torn last line is skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                yield json.loads(line)
