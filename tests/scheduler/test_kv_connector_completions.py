"""The connector's store completions riding on the next step's prepare_store (capability
``store_completions``, docs/connector.md "Daemon calls per step"), against a real daemon with
the fake TP workers of ``test_kv_connector``: a completion waits at most
``completion_hold_steps`` steps for a prepare_store to carry it, and never when no step may
follow."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserver.errors import InvalidArgument
from kvserver.wire import COMPLETE_STORE, PREPARE_STORE
from scheduler.kv_connector_types import KVConnectorConfig
from step_protocol import ConnectorMetadata
from tests.scheduler.test_kv_connector import (
    FakeRequest,
    Harness,
    make_spec,
    ready_chunks,
    stored_keys,
    tokens,
)
from tests.support.connector import bound
from tests.support.daemon import DaemonProc, start_daemon

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("carry"), "--page-size", "4KiB", "--dram", "4MiB")
    yield d
    assert d.terminate() == 0, d.log()


def decode(h: Harness, reqs: list[FakeRequest], steps: int) -> list[Counter[str]]:
    """Prefill ``reqs`` (all their tokens but the last) then ``steps`` decode steps; the calls
    of each step."""
    for r in reqs:
        assert h.admit(r) == (0, False)
    sent = h.conn.client.sent_by_op
    per_step: list[Counter[str]] = []
    for i in range(steps + 1):
        before = Counter(sent)
        if i:
            for r in reqs:
                r.append([7])
        h.step({r.request_id: (r, len(r.all_token_ids) - 1 if i == 0 else 1) for r in reqs})
        per_step.append(Counter(sent) - before)
    return per_step


@pytest.mark.parametrize(("tp", "dispatch"), [(1, False), (2, False), (1, True), (2, True)])
def test_completions_ride_on_the_next_prepare_store(
    daemon: DaemonProc, tp: int, dispatch: bool
) -> None:
    """Decode: a step that reserves new chunks carries the previous step's completions (no
    complete_store of its own); a step that reserves none sends them alone. Every chunk is
    stored, events and all, and no completion waits more than one step (the bound set here).
    The same when the scheduler calls ``dispatched()`` (the reservation is sent there)."""
    spec = make_spec(tp=tp, model=f"test/carry-{tp}-{dispatch}")
    h = Harness(daemon, spec, dispatch=dispatch, completion_hold_steps=1)
    try:
        # staggered lengths: some request fills a chunk (8 tokens) in every decode step
        reqs = [FakeRequest(f"r{i}", tokens(17 + i, base=100 * i), spec) for i in range(8)]
        per_step = decode(h, reqs, 12)
        # one message a step: from the third step on, the completions of the chunks reserved
        # two steps earlier (shipped and stored by the previous one) ride on the prepare_store
        assert all(c == {PREPARE_STORE: 1} for c in per_step), per_step
        assert h.conn.stats.carried_completions == len(per_step) - 2
        assert h.conn.has_pending_transfers  # the last completions are held
        before = Counter(h.conn.client.sent_by_op)
        h.step()  # ships the last stores; no prepare_store follows: their completions alone
        h.step()
        assert Counter(h.conn.client.sent_by_op) - before == {COMPLETE_STORE: 2}
        assert not h.conn.has_pending_transfers
        h.conn.drain()
        computed = {r.request_id: r.num_computed_tokens // spec.chunk_tokens for r in reqs}
        assert all(ready_chunks(daemon, r) == computed[r.request_id] for r in reqs)
        want = sorted(k for r in reqs for k in r.chunk_keys()[: computed[r.request_id]])
        assert sorted(stored_keys(h.conn)) == want
        s = h.conn.stats
        assert s.stored_chunks == s.granted_chunks == len(want) and s.completion_errors == 0
    finally:
        h.close()


@pytest.mark.parametrize("hold", [1, 3])
def test_a_held_completion_is_sent_within_completion_hold_steps(
    daemon: DaemonProc, hold: int
) -> None:
    """A completion held by update_connector_output keeps the connector stepping
    (has_pending_transfers) and waits for a prepare_store to carry it for at most
    ``completion_hold_steps`` steps: alone at the end of the last of them when none reserved
    anything; the chunks are then ready."""
    spec = make_spec(model=f"test/carry-held-{hold}")
    h = Harness(daemon, spec, completion_hold_steps=hold)
    try:
        r, other = FakeRequest("r", tokens(17), spec), FakeRequest("o", tokens(9, base=500), spec)
        assert h.admit(r) == (0, False) and h.admit(other) == (0, False)
        h.step({"r": (r, 16), "o": (other, 8)})  # reserves r's 2 chunks, o's 1
        sent = h.conn.client.sent_by_op
        h.step({"o": (other, 0)})  # ships them; the workers store; completions held
        assert h.conn.has_pending_transfers and sent[COMPLETE_STORE] == 0
        for _ in range(hold - 1):  # nothing to reserve: still held
            before = Counter(sent)
            h.step({"o": (other, 0)})
            assert Counter(sent) == before and h.conn.has_pending_transfers
        assert ready_chunks(daemon, r) == 0  # not sent yet
        before = Counter(sent)
        h.step({"o": (other, 0)})  # the last step it may wait: sent alone
        assert Counter(sent) - before == {COMPLETE_STORE: 1}
        h.conn.drain()
        assert ready_chunks(daemon, r) == 2 and ready_chunks(daemon, other) == 1
        assert not h.conn.has_pending_transfers
    finally:
        h.close()


def test_completion_hold_steps_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="completion_hold_steps"):
        KVConnectorConfig("tcp://127.0.0.1:1", make_spec(), completion_hold_steps=0)


def test_the_last_request_finishing_sends_its_completions_at_once(daemon: DaemonProc) -> None:
    """No unfinished request: no step may follow (vLLM stops stepping), so nothing is held."""
    spec = make_spec(model="test/carry-last")
    h = Harness(daemon, spec)
    try:
        r = FakeRequest("r", tokens(17), spec)
        assert h.admit(r) == (0, False)
        h.step({"r": (r, 16)})
        assert h.conn.request_finished(r, h.blocks["r"]) == (True, None)
        _, report = h.step()
        assert report.finished_sending == {"r"}
        assert not h.conn.has_pending_transfers
        assert h.conn.client.sent_by_op[COMPLETE_STORE] == 1
        kv = h.conn.client  # its requests are applied in order: the completion came first
        assert kv.lookup(spec.ns_id, r.chunk_keys()).hit_chunks == 2
    finally:
        h.close()


def test_reset_and_close_send_held_completions(daemon: DaemonProc) -> None:
    spec = make_spec(model="test/carry-reset")
    h = Harness(daemon, spec)
    try:
        r, other = FakeRequest("r", tokens(17), spec), FakeRequest("o", tokens(3, base=700), spec)
        assert h.admit(r) == (0, False) and h.admit(other) == (0, False)
        h.step({"r": (r, 16), "o": (other, 2)})
        h.step({"o": (other, 0)})
        assert h.conn.has_pending_transfers and h.conn.client.sent_by_op[COMPLETE_STORE] == 0
        h.conn.reset()
        assert not h.conn.has_pending_transfers
        assert ready_chunks(daemon, r) == 2  # sent before the release rolled back the rest
    finally:
        h.close()


def test_without_the_capability_completions_go_alone(daemon: DaemonProc) -> None:
    """A daemon that does not announce store_completions (an older one; its hello is cut to
    what such a daemon says): one complete_store per step, as before."""
    spec = make_spec(model="test/carry-old")
    h = Harness(daemon, spec)
    try:
        h.conn.probe()
        server = h.conn.client._s.server
        server["capabilities"] = []
        reqs = [FakeRequest(f"r{i}", tokens(17 + i, base=100 * i), spec) for i in range(8)]
        per_step = decode(h, reqs, 8)
        assert h.conn.stats.carried_completions == 0
        assert sum(c[COMPLETE_STORE] for c in per_step) >= 2
        h.step()
        h.conn.drain()
        assert all(ready_chunks(daemon, r) == r.num_computed_tokens // 8 for r in reqs)
    finally:
        h.close()


def test_daemon_down_counts_carried_completions_as_errors(tmp_path: Path) -> None:
    """The prepare_store that would carry them cannot be sent (the daemon was killed): the
    completions count as errors (the leases expire on the daemon), the step goes on."""
    d = start_daemon(tmp_path, "--page-size", "4KiB", "--dram", "4MiB")
    spec = make_spec(model="test/carry-down")
    h = Harness(d, spec, down_backoff_s=60, completion_hold_steps=1)  # patient while it lives
    try:
        reqs = [FakeRequest(f"r{i}", tokens(17, base=100 * i), spec) for i in range(2)]
        decode(h, reqs, 0)
        h.step({r.request_id: (r, 0) for r in reqs})  # shipped, stored, completions held
        assert h.conn.has_pending_transfers
        bound(h.conn, lookup_timeout_s=0.2, op_timeout_s=0.2)
        d.kill()
        h.step({r.request_id: (r, 0) for r in reqs})
        assert h.conn.stats.completion_errors >= 1
        assert not h.conn.has_pending_transfers
    finally:
        h.close()
        Path(d.arena_path).unlink(missing_ok=True)


def test_a_lookup_sends_held_completions_first(daemon: DaemonProc) -> None:
    """A prompt admitted while its prefix's completion is held hits it, as when completions
    went out at once (and its pin finds the chunks ready)."""
    spec = make_spec(model="test/carry-lookup")
    h = Harness(daemon, spec)
    try:
        r, other = FakeRequest("r", tokens(17), spec), FakeRequest("o", tokens(3, base=700), spec)
        assert h.admit(r) == (0, False) and h.admit(other) == (0, False)
        h.step({"r": (r, 16), "o": (other, 2)})
        h.step({"o": (other, 0)})
        assert h.conn.has_pending_transfers and h.conn.client.sent_by_op[COMPLETE_STORE] == 0
        same = FakeRequest("s", tokens(17), spec)
        assert h.admit(same) == (16, True)
        assert h.conn.client.sent_by_op[COMPLETE_STORE] == 1
        _, report = h.step()
        assert report.finished_recving == {"s"} and report.load_errors == {}
        h.assert_loaded(same, range(4))
    finally:
        h.close()


def test_dispatched_sends_the_reservation_after_the_plan(daemon: DaemonProc) -> None:
    """Once the scheduler calls ``dispatched()``, ``build_connector_meta`` only plans the
    step's reservation (a transfer is pending) and ``dispatched()`` sends it; in a step whose
    ``dispatched()`` does not come, the connector's next call sends it first."""
    spec = make_spec(model="test/dispatched")
    h = Harness(daemon, spec, dispatch=True)
    try:
        sent = h.conn.client.sent_by_op
        after_meta: list[tuple[Counter[str], bool]] = []
        build = h.conn.build_connector_meta

        def observed(plan: Any) -> ConnectorMetadata:  # records what it sent
            meta = build(plan)
            after_meta.append((Counter(sent), h.conn.has_pending_transfers))
            return meta

        h.conn.build_connector_meta = observed  # type: ignore[method-assign,assignment]
        reqs = [FakeRequest(f"r{i}", tokens(17, base=100 * i), spec) for i in range(2)]
        for r in reqs:
            assert h.admit(r) == (0, False)
        h.step()  # the first dispatched(): from now on the reservation waits for it
        for r, dispatch in zip(reqs, (True, False), strict=True):
            h.dispatch = dispatch
            before = Counter(sent)
            h.step({r.request_id: (r, 16)})  # plans its 2 chunks
            at_meta, pending = after_meta[-1]
            assert at_meta == before and pending  # planned, not sent
            # sent by dispatched(), or else first thing in update_connector_output
            assert sent[PREPARE_STORE] - before[PREPARE_STORE] == 1
        h.dispatch = True
        h.step()  # ships r1's stores; the workers write them
        h.step()
        h.conn.drain()
        assert all(ready_chunks(daemon, r) == 2 for r in reqs)
        assert not h.conn.has_pending_transfers
    finally:
        h.close()
