"""Scrape a real /metrics endpoint and parse it with prometheus_client's own parser (tests)."""

from __future__ import annotations

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
