"""The project's processes started on loopback with ephemeral ports, for the benchmarks and
the tests: the daemon (``daemon``), the scheduler and synthetic workers (``procs``), real
tensor-parallel workers and the multi-turn workload (``cluster``). Each starts the real command
(``python -m kvserver.cli ...``) as a subprocess and waits for its ready file; nothing here
imports the packages it starts. The tests import these through tests/support/ and
tests/scheduler/procs.py."""
