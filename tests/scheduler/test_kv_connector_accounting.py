"""Where the chunks the scheduler connector plans to store end up (ConnectorStats' store
accounting, docs/connector.md "Store accounting"), and the bound on the events nobody takes.

A real scheduler with synthetic workers drives the real connector against real daemons on
loopback: one without reuse gating, one with ``--store-threshold 2``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvserver.events import BlockStored
from kvserver.namespace import NamespaceSpec
from scheduler.kv_connector import KVServerSchedulerConnector
from scheduler.kv_connector_types import ConnectorStats
from tests.scheduler.builders import Harness, harness
from tests.support.connector import patient_config
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess

BS = 4  # tests.scheduler.builders.BLOCK


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("acct"), "--page-size", "4KiB", "--dram", "64MiB")
    yield d
    d.terminate()


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(
        tmp_path_factory.mktemp("acct-gated"),
        "--page-size", "4KiB", "--dram", "64MiB", "--store-threshold", "2",
    )  # fmt: skip
    yield d
    d.terminate()


def connector(daemon: DaemonProc, model: str, **config: Any) -> KVServerSchedulerConnector:
    spec = NamespaceSpec(
        model=model, dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8,
        block_size=BS, chunk_blocks=1,
    )  # fmt: skip
    return KVServerSchedulerConnector(patient_config(daemon.zmq_address, spec, **config))


def run(conn: KVServerSchedulerConnector, prompts: list[list[int]], **kw: Any) -> Harness:
    """Every prompt (8 new tokens each) to the end; the replies still due applied."""
    h = harness(connector=conn, num_gpu_blocks=256, max_num_seqs=16, **kw)
    for i, prompt in enumerate(prompts):
        h.add(f"q{i}", prompt, max_tokens=8)
    h.run()
    conn.drain()
    return h


def accounted(s: ConnectorStats) -> int:
    """The planned chunks given a fate (nothing is in flight after :func:`run`)."""
    return (
        s.shared_chunks + s.present_chunks + s.filtered_chunks + s.unreserved_chunks
        + s.granted_chunks
    )  # fmt: skip


def test_every_planned_chunk_is_accounted_for(daemon: DaemonProc) -> None:
    """Eight requests sharing a 4-chunk prefix, admitted together then prefilled over several
    steps: each request plans the shared chunks too, so more chunks are planned than stored
    — planned_chunks counts per request — and the counters say where each one went: the
    prefix is asked for once per batch (shared) and, in later batches, found present; every
    chunk granted is stored once the run is over."""
    prefix = list(range(1000, 1016))
    prompts = [prefix + list(range(100 * i, 100 * i + 9)) for i in range(8)]
    conn = connector(daemon, "acct-shared")
    run(conn, prompts, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    s = conn.stats
    assert s.planned_chunks == accounted(s)
    assert s.shared_chunks > 0 and s.present_chunks > 0
    assert s.filtered_chunks == s.unreserved_chunks == 0
    assert s.stored_chunks == s.granted_chunks < s.planned_chunks
    stored = [k for e in conn.take_events() if isinstance(e, BlockStored) for k in e.keys]
    assert len(stored) == len(set(stored)) == s.stored_chunks
    # every distinct full chunk of every request (prompt and output: 25 + 8 - 1 tokens
    # computed, 8 chunks of 4) is stored exactly once
    assert s.stored_chunks == 4 + 8 * 4
    conn.close()


def test_chunks_the_reuse_gate_refuses_are_counted_as_filtered(gated: DaemonProc) -> None:
    """With ``--store-threshold 2`` a prompt seen once is not stored: its chunks are counted as
    filtered, not as lost; the same prompt seen again (a second lookup) is stored."""
    prompt = list(range(500, 525))
    conn = connector(gated, "acct-gated")
    run(conn, [prompt])
    s = conn.stats
    assert s.planned_chunks == accounted(s) == s.filtered_chunks > 0
    assert s.stored_chunks == s.granted_chunks == 0
    run(conn, [prompt])
    s = conn.stats
    assert s.planned_chunks == accounted(s)
    assert s.stored_chunks == s.granted_chunks > 0
    conn.close()


def test_events_nobody_takes_are_bounded(daemon: DaemonProc) -> None:
    """A process that never calls take_events keeps at most max_pending_events of them, the
    newest; the others are counted as dropped and their gap shows in ``seq``."""
    conn = connector(daemon, "acct-events", max_pending_events=2)
    prompts = [list(range(3000 + 100 * i, 3000 + 100 * i + 25)) for i in range(6)]
    run(conn, prompts, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    s = conn.stats
    events = conn.take_events()
    assert len(events) == 2 and s.dropped_events > 0
    assert [e.seq for e in events] == [s.dropped_events + 1, s.dropped_events + 2]
    assert conn.take_events() == []
    conn.close()
