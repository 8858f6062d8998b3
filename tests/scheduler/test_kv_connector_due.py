"""The store calendar (scheduler/kv_connector_due.py): it finds exactly the requests a scan of
every scheduled request finds, in the same order, while looking at a few of them per step in
steady decode.

The calendar alone is driven with hand-made steps (no daemon: it plans nothing); the whole
connector is compared with one whose calendar scans every step (the planner before the
calendar), both driven by identical schedulers against one real daemon, in namespaces of
their own."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserver.client import KVClient
from kvserver.namespace import NamespaceSpec
from scheduler.kv_connector import KVServerSchedulerConnector
from scheduler.kv_connector_due import StoreCalendar
from scheduler.kv_connector_request import RequestState
from scheduler.request import Request
from step_protocol import CachedRequestData, NewRequestData, StepPlan
from tests.scheduler.builders import Harness, harness
from tests.support.connector import patient_config
from tests.support.daemon import DaemonProc, start_daemon

BS = 4  # tests.scheduler.builders.BLOCK


# ----------------------------------------------------------------------------- the calendar


class Steps:
    """Requests and hand-made steps for a calendar (``chunk_tokens`` = 8: two 4-token blocks),
    with the planner's part done by the test: :meth:`store` for the requests whose stores go
    out; the others due are checked again at the next step, as the planner does."""

    def __init__(self) -> None:
        self.calendar = StoreCalendar(8)
        self.reqs: dict[str, RequestState] = {}
        self.requests: dict[str, Request] = {}
        self.sent: set[str] = set()
        self.not_out: set[str] = set()
        self.done: dict[str, int] = {}
        self.step_no = 0

    def add(self, req_id: str, num_tokens: int) -> RequestState:
        request = self.requests[req_id] = Request(req_id, list(range(num_tokens)), max_tokens=99)
        state = self.reqs[req_id] = RequestState(request, self.calendar.moved)
        return state

    def step(self, sched: dict[str, int]) -> list[tuple[str, int]]:
        """Schedule ``sched`` (request -> tokens): a request's first step lists it in
        ``new_reqs``, later ones in ``cached_reqs`` with the blocks it needs more; returns the
        calendar's due requests and their tokens after the step."""
        self.calendar.recheck(self.reqs[r] for r in sorted(self.not_out))
        self.step_no += 1
        new, cached = [], []
        for req_id, n in sched.items():
            req = self.requests[req_id]
            done = req.num_computed_tokens + n
            while len(req.all_token_ids) < done:
                req.append_output_token(7)
            blocks = -(-done // BS)
            if req_id not in self.sent:
                self.sent.add(req_id)
                new.append(NewRequestData(req_id, list(req.all_token_ids), list(range(blocks)),
                                          req.num_computed_tokens, 99))  # fmt: skip
            else:
                have = len(self.reqs[req_id].block_ids)
                cached.append(CachedRequestData(req_id, list(range(have, max(have, blocks))),
                                                req.num_computed_tokens, []))  # fmt: skip
        due = self.calendar.take(StepPlan(self.step_no, new, cached, dict(sched)), self.reqs)
        for req_id, n in sched.items():
            self.requests[req_id].num_computed_tokens += n
        self.not_out = {st.req_id for st, _ in due}
        self.done = {st.req_id: done for st, done in due}
        return [(st.req_id, done) for st, done in due]

    def store(self, req_id: str, chunks: int) -> None:
        """The planner's part: the chunks below ``chunks`` were planned (filed for the cursor
        the grant gives) and reserved."""
        state = self.reqs[req_id]
        state.store_planned(state.cursor, chunks)
        self.calendar.planned(state, chunks, self.done[req_id])
        state.store_reserved(chunks)
        state.store_share_over()
        self.not_out.discard(req_id)

    def checked_now(self) -> int:
        return sum(st.checked == self.step_no for st in self.reqs.values())


def test_steady_decode_checks_only_the_requests_at_a_chunk_boundary() -> None:
    """16 requests decoding at 16 different offsets: each step 2 of them fill a chunk. The
    calendar finds exactly those, at the step that fills it, looking at only those 2 a step
    (those whose stores were reserved last step were filed when planned) and never
    scanning."""
    s = Steps()
    for i in range(16):
        s.add(f"r{i}", 8 + i)
    first = s.step({f"r{i}": 7 + i for i in range(16)})  # prefill but for the last token
    assert first == [(f"r{i}", 7 + i) for i in range(1, 16)]  # r0 computed 7 tokens
    for req_id, done in first:
        s.store(req_id, done // 8)
    checked = []
    for k in range(32):  # decode: one token each per step
        due = s.step({f"r{i}": 1 for i in range(16)})
        want = [(f"r{i}", 8 + i + k) for i in range(16) if (8 + i + k) % 8 == 0]
        assert due == want, k
        checked.append(s.checked_now())
        for req_id, done in due:
            s.store(req_id, done // 8)
    assert s.calendar.scans == 0
    assert max(checked[1:]) <= 2


def test_a_request_that_takes_several_tokens_falls_back_to_a_scan() -> None:
    """A decoding request given 4 tokens (speculative tokens, a rewind) is not skipped."""
    s = Steps()
    s.add("a", 20)
    s.add("b", 20)
    s.step({"a": 3, "b": 3})
    s.step({"a": 1, "b": 1})  # a and b were partial (3 tokens): checked, now decoding
    assert s.calendar.scans == 0
    assert s.step({"a": 1, "b": 4}) == [("b", 8)]  # b was not partial: the sum tells
    assert s.calendar.scans == 1


def test_a_partial_request_is_checked_every_step_without_a_scan() -> None:
    """A prompt prefilled 10 tokens a step while another request decodes: no scan."""
    s = Steps()
    s.add("long", 100)
    s.add("d", 12)
    s.step({"long": 5, "d": 11})  # d: chunk 0 full
    s.store("d", 1)
    s.step({"d": 1})  # long is not scheduled this step: still partial
    got = [s.step({"long": 10, "d": 1}), s.step({"long": 10, "d": 1})]
    assert got == [[("long", 15)], [("long", 25)]]
    assert s.calendar.scans == 0


def test_an_unscheduled_request_is_found_when_it_runs_again() -> None:
    """A running request left out of a step (budget) is due later than filed, not missed."""
    s = Steps()
    s.add("a", 8)
    s.add("b", 8)
    s.step({"a": 6, "b": 6})
    assert s.step({"b": 1}) == []  # a waits (budget): its check finds nothing yet
    assert s.step({"b": 1}) == [("b", 8)]
    s.store("b", 1)
    assert s.step({"a": 1, "b": 1}) == []
    assert s.step({"a": 1, "b": 1}) == [("a", 8)]


def test_a_cursor_moved_back_is_checked_at_the_next_step() -> None:
    """A failed load moves the cursor back: the request is checked again, and due."""
    s = Steps()
    st = s.add("a", 40)
    s.step({"a": 32})
    s.store("a", 4)
    assert s.step({"a": 1}) == []
    st.load_failed(1)  # a rank failed chunk 1: it is recomputed, then stored again
    assert s.step({"a": 1}) == [("a", 34)]


def test_a_refused_store_stays_due() -> None:
    """A reservation refused (cache full) leaves the cursor: due again at the next step."""
    s = Steps()
    st = s.add("a", 40)
    assert s.step({"a": 16}) == [("a", 16)]
    st.store_planned(0, 2)  # its stores went out...
    s.not_out.clear()
    st.store_refused(2, for_good=False)  # ...and were refused (cache full): due again
    assert s.step({"a": 1}) == [("a", 17)]


# ----------------------------------------------------------------------------- the connector


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path_factory.mktemp("due"), "--page-size", "4KiB", "--dram", "64MiB")
    yield d
    d.terminate()


def connector(daemon: DaemonProc, model: str, *, scan_every_step: bool) -> Any:
    spec = NamespaceSpec(
        model=model, dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8,
        block_size=BS, chunk_blocks=2,
    )  # fmt: skip
    # patient timeouts: both connectors must see every answer (the production 0.1 s lookup
    # bound skipped a daemon for 5 s on a loaded machine, and the two plans parted)
    conn = KVServerSchedulerConnector(patient_config(daemon.zmq_address, spec))
    if scan_every_step:
        conn._stores.calendar = StoreCalendar(spec.chunk_tokens, scan_every_step=True)
    return conn


def stores_of(h: Harness) -> list[list[tuple[str, list[bytes], list[list[int]]]]]:
    return [
        [(t.req_id, [c.key for c in t.stores], [c.block_ids for c in t.stores])
         for t in plan.connector_meta.stores]
        for plan in h.plans
    ]  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_the_calendar_plans_what_a_scan_every_step_plans(
    daemon: DaemonProc, seed: int, tmp_path: Path
) -> None:
    """Shared prefixes, prompts prefilled over several steps, decode, preemptions (a small
    pool), aborts, new arrivals: the stores shipped are the same, step by step, in the same
    order, and the calendar scanned in a minority of the steps."""
    compare_with_a_scan(
        seed,
        connector(daemon, f"due-{seed}-calendar", scan_every_step=False),
        connector(daemon, f"due-{seed}-scan", scan_every_step=True),
    )


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("dram", ["192KiB", "16KiB"])
def test_the_calendar_plans_what_a_scan_plans_in_a_small_cache(
    seed: int, dram: str, tmp_path: Path
) -> None:
    """The same in a small cache, each connector against a daemon of its own (so both see the
    same evictions and refusals): 48 pages evict, 4 pages refuse batches, which are halved
    to fit, so which due requests come first decides which get in. A request whose stores
    went out is checked when its next chunk fills (filed when planned, not again after the
    grant), a refused one at once, and requests admitted in one step keep the step order
    (new ones are listed before resumed ones but run in admission order), as a scan finds
    them."""
    daemons = [
        start_daemon(tmp_path / name, "--page-size", "4KiB", "--dram", dram)
        for name in ("calendar", "scan")
    ]
    try:
        conns = [
            connector(d, f"small-{seed}", scan_every_step=name == "scan")
            for d, name in zip(daemons, ("calendar", "scan"), strict=True)
        ]
        compare_with_a_scan(seed, *conns)
        assert conns[0].stats.granted_chunks == conns[1].stats.granted_chunks
        assert conns[0].stats.store_rejections == conns[1].stats.store_rejections
        for d in daemons:
            with KVClient(d.zmq_address, colocated=False) as kv:
                assert kv.stats()["totals"]["evicted_chunks"] > 0  # the case was exercised
        if dram == "16KiB":
            assert conns[0].stats.store_rejections > 0  # the case was exercised
    finally:
        for d in daemons:
            d.terminate()


def compare_with_a_scan(seed: int, *conns: Any) -> None:
    """Drive connectors ``conns`` (the calendar's, the scan's) with identical schedulers on a
    random workload; assert they shipped the same stores, step by step."""
    rng = random.Random(seed)
    hs = [
        harness(connector=c, num_gpu_blocks=96, max_num_batched_tokens=48,
                long_prefill_token_threshold=12, max_num_seqs=12)
        for c in conns
    ]  # fmt: skip
    prefixes = [list(range(1000 * p, 1000 * p + 4 * rng.randrange(1, 6))) for p in range(3)]
    arrivals = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]
        arrivals.append((rng.randrange(60), f"q{i}", prompt, rng.randrange(1, 40)))
    aborts = {rng.randrange(80): f"q{rng.randrange(40)}" for _ in range(6)}
    steps = 0
    while steps < 400 and (steps < 60 or any(h.scheduler.has_work() for h in hs)):
        for h in hs:
            for at, req_id, prompt, max_tokens in arrivals:
                if at == steps:
                    h.add(req_id, prompt, max_tokens=max_tokens)
            if steps in aborts and aborts[steps] in h.scheduler.requests:
                h.scheduler.finish_requests([aborts[steps]])
            h.step()
        steps += 1
    for c in conns:
        c.drain()
    assert not any(h.scheduler.has_work() for h in hs)
    calendar, scan = hs
    assert [p.num_scheduled_tokens for p in calendar.plans] == [
        p.num_scheduled_tokens for p in scan.plans
    ]
    assert stores_of(calendar) == stores_of(scan)
    assert sum(len(s) for s in stores_of(calendar)) > 20
    assert any(p.preempted_req_ids for p in calendar.plans)  # the case was exercised
    assert conns[0].stats.planned_chunks == conns[1].stats.planned_chunks
    assert conns[0]._stores.calendar.scans < steps // 2
    for c in conns:
        c.close()
