"""Scrape a real /metrics endpoint and parse it with prometheus_client's own parser (tests)."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Key = tuple[str, tuple[tuple[str, str], ...]]


class Scrape:
    """One scrape: ``families`` (name → type) and sample values by (name, sorted labels)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: dict[Key, float] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                self.samples[_key(sample)] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The sample ``name`` with exactly ``labels``; KeyError if absent."""
        return self.samples[(name, tuple(sorted(labels.items())))]

    def names(self) -> set[str]:
        """Every sample name (``_total``, ``_bucket``, ``_count`` ... included)."""
        return {name for name, _ in self.samples}


def _key(sample: Sample) -> Key:
    return sample.name, tuple(sorted(sample.labels.items()))


def scrape(url: str, timeout: float = 10.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return Scrape(response.read().decode())


#: units a metric name may carry, as its last word (before ``_total`` for a counter)
UNITS = ("bytes", "seconds", "ratio")


def convention_faults(s: Scrape, prefix: str) -> list[str]:
    """The families of ``s`` that break Prometheus' naming conventions: a name outside
    ``prefix`` and ``process_``, not snake case, a counter whose samples lack ``_total``, a
    ``_total`` that is not a counter, or a unit word (bytes, seconds, ratio) anywhere but at
    the end (``kvserver_ssd_written_bytes_total`` is fine, ``kvserver_bytes_written`` is not)."""
    faults = []
    for name, kind in s.types.items():
        words = name.split("_")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or words[0] not in (prefix, "process"):
            faults.append(f"{name}: not {prefix}_snake_case")
        if kind == "counter" and f"{name}_total" not in s.names():
            faults.append(f"{name}: a counter without _total")
        if kind != "counter" and name.endswith("_total"):
            faults.append(f"{name}: _total on a {kind}")
        if any(unit in words[:-1] for unit in UNITS):
            faults.append(f"{name}: its unit is not its last word")
    return faults
