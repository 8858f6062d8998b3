"""kvserver: a KV-cache service for LLM inference.

This package holds the daemon and everything its clients share with it (block hashing, wire
formats, the Python client). It never imports ``scheduler``, ``worker`` or ``torch``.
"""

__version__ = "0.1.0"
