"""Benchmarks: each one prints its figures as ratios to a reference measured in the same run.

``bench_daemon`` is ``kvserver bench`` (registered through the ``kvserver.commands`` entry
point); the other ``bench_*`` modules are scripts (``python3 benchmarks/bench_X.py``). The
library (``kvserver/``) never imports this package.
"""
