"""vLLM's own V1 Scheduler with KVServerConnector and a real kvserver daemon (CPU).

Every test drives vLLM's real ``Scheduler`` and ``KVOutputAggregator`` (tests/vllm_plugin/
harness.py) against ``kvserver start`` on loopback; the stand-in model runner checks every KV
byte a request reads, so a wrong load fails the step that reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.vllm_env import require_vllm

require_vllm()

from kvserver.client import KVClient  # noqa: E402
from kvserver.crypto import TlsClient, make_curve_keys, make_tls_cert  # noqa: E402
from kvserver.grpc_client import GrpcClient  # noqa: E402
from kvserver.wire import LOOKUP  # noqa: E402
from tests.support.connector import PATIENT  # noqa: E402
from tests.support.daemon import DaemonProc, port_kept, start_daemon  # noqa: E402
from tests.vllm_plugin.harness import (  # noqa: E402
    MiniEngine,
    StepRecord,
    make_vllm_config,
    write_tiny_model,
)

pytestmark = pytest.mark.multiprocess

CHUNK_BLOCKS = 2  # 32-token chunks over 16-token vLLM blocks
CHUNK_TOKENS = 32


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    proc = start_daemon(tmp_path / "daemon")
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model"))


def engine(
    model_dir: Path,
    address: str,
    num_blocks: int = 64,
    connector: bool = True,
    kv_role: str = "kv_both",
    blocks_first: bool = False,
    defer_finalize: bool = False,
    **extra: Any,
) -> MiniEngine:
    """vLLM's scheduler and a worker around the plug-in; ``extra``: more
    kv_connector_extra_config (the connector's bounds are ``PATIENT`` unless given)."""
    options = {"address": address, "chunk_blocks": CHUNK_BLOCKS, **PATIENT, **extra}
    config = make_vllm_config(model_dir, options, connector=connector, kv_role=kv_role)
    return MiniEngine(config, num_blocks, blocks_first=blocks_first, defer_finalize=defer_finalize)


def reference_outputs(
    model_dir: Path, prompts: list[tuple[str, list[int]]], max_tokens: int, num_blocks: int = 64
) -> dict[str, list[int]]:
    """The same requests with no connector at all."""
    eng = engine(model_dir, "tcp://127.0.0.1:1", num_blocks, connector=False)
    try:
        return dict(eng.run_requests(prompts, max_tokens))
    finally:
        eng.close()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)]


def ns_hits(eng: MiniEngine, daemon: DaemonProc, tokens: list[int]) -> int:
    """Chunks of ``tokens`` kvserver holds, asked over gRPC by token ids as a router would."""
    eng.connector.scheduler_half.drain()  # type: ignore[union-attr]
    with GrpcClient(daemon.grpc_address) as grpc:
        return grpc.lookup_tokens(eng.connector.config.spec.ns_id, tokens).hit_chunks


def daemon_holds_nothing(daemon: DaemonProc) -> bool:
    with GrpcClient(daemon.grpc_address) as grpc:
        stats = grpc.stats()
    held = sum(t.pinned_bytes + t.reserved_bytes for t in stats.tiers)
    return stats.num_leases == 0 and held == 0


def assert_scheduler_empty(eng: MiniEngine) -> None:
    sched = eng.scheduler
    assert not sched.requests and not sched.running and not sched.finished_recving_kv_req_ids
    pool = sched.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert not eng.connector.has_pending_block_frees()


def assert_recomputed(eng: MiniEngine, records: list[StepRecord], req_id: str) -> None:
    """``req_id``'s load failed: its unfilled blocks were reported with its completion, it ran
    from token 0, and nothing is left held."""
    failed = next(r for r in records if req_id in r.finished_recving)
    assert failed.invalid_block_ids  # the blocks it could not fill
    ran = next(r for r in records if req_id in r.scheduled)
    assert ran.computed_before[req_id] == 0  # recomputed from the start
    assert_scheduler_empty(eng)


# ---------------------------------------------------------------------------------- hits


@pytest.mark.parametrize(
    ("blocks_first", "colocated"), [(False, None), (True, None), (False, False)],
    ids=["flash-attn-layout", "flashinfer-layout", "payload-frames"],
)  # fmt: skip
def test_external_hit_waits_loads_and_runs_with_the_loaded_tokens(
    model_dir: Path, daemon: DaemonProc, blocks_first: bool, colocated: bool | None
) -> None:
    shared = prompt(1, 100)
    eng = engine(model_dir, daemon.zmq_address, blocks_first=blocks_first, colocated=colocated)
    assert eng.worker is not None and eng.worker.worker_half is not None
    assert eng.worker.worker_half.is_colocated == (colocated is None)  # same host: the arena
    try:
        eng.run_requests([("first", shared)], max_tokens=3)
        assert ns_hits(eng, daemon, shared) == 3  # 100 prompt tokens: 3 full chunks
        assert eng.scheduler.reset_prefix_cache()  # the GPU prefix cache forgets everything

        second = [*shared, 5, 6, 7]
        eng.add("second", second, max_tokens=3)
        first_step = eng.step()
        # an external hit: the request waits for its KV instead of being scheduled
        assert "second" not in first_step.scheduled
        assert "second" in first_step.waiting_for_kv or "second" in first_step.finished_recving
        records = [first_step, *eng.run()]
        loaded = next(r for r in records if "second" in r.finished_recving)
        assert not loaded.invalid_block_ids
        ran = next(r for r in records if "second" in r.scheduled)
        # it runs with the 96 loaded tokens computed: only the rest is prefilled
        assert ran.computed_before["second"] == 3 * CHUNK_TOKENS
        assert ran.scheduled["second"] == len(second) - 3 * CHUNK_TOKENS
        stats = eng.connector.scheduler_half.stats  # type: ignore[union-attr]
        assert stats.loads == 1 and stats.hit_tokens == 3 * CHUNK_TOKENS
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    ref = reference_outputs(model_dir, [("first", shared), ("second", second)], 3)
    assert outputs == ref
    assert daemon_holds_nothing(daemon)


def test_local_prefix_hit_is_extended_by_kvserver(model_dir: Path, daemon: DaemonProc) -> None:
    """A request whose first chunk is still on the GPU loads only the chunks after it."""
    shared = prompt(2, 130)
    eng = engine(model_dir, daemon.zmq_address, num_blocks=64)
    try:
        eng.run_requests([("a", shared)], max_tokens=2)
        assert ns_hits(eng, daemon, shared) == 4
        eng.scheduler.reset_prefix_cache()
        eng.run_requests([("warm", shared[:40])], max_tokens=1)  # 1 chunk hit, KV on GPU again
        eng.add("b", [*shared, 1, 2], max_tokens=2)
        records = eng.run()
        ran = next(r for r in records if "b" in r.scheduled)
        assert ran.computed_before["b"] == 4 * CHUNK_TOKENS
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    ref = reference_outputs(
        model_dir, [("a", shared), ("warm", shared[:40]), ("b", [*shared, 1, 2])], 2
    )
    assert outputs["b"] == ref["b"]


@pytest.mark.parametrize(("kv_role", "extra"), [
    ("kv_producer", {}),  # this instance only stores
    ("kv_both", {"min_hit_tokens": 128}),  # policy hint: a 96-token hit is not worth a load
])  # fmt: skip
def test_hits_not_taken(
    model_dir: Path, daemon: DaemonProc, kv_role: str, extra: dict[str, Any]
) -> None:
    shared = prompt(11, 100)
    eng = engine(model_dir, daemon.zmq_address, kv_role=kv_role, **extra)
    try:
        eng.run_requests([("first", shared)], max_tokens=2)
        assert ns_hits(eng, daemon, shared) == 3  # stored either way
        eng.scheduler.reset_prefix_cache()
        eng.add("second", [*shared, 1], max_tokens=2)
        records = eng.run()
        ran = next(r for r in records if "second" in r.scheduled)
        assert ran.computed_before["second"] == 0 and not any(r.waiting_for_kv for r in records)
        assert eng.connector.scheduler_half.stats.loads == 0  # type: ignore[union-attr]
        assert_scheduler_empty(eng)
    finally:
        eng.close()


# ---------------------------------------------------------------------------------- stores


def test_full_chunks_are_stored_as_prefill_proceeds(model_dir: Path, daemon: DaemonProc) -> None:
    long = prompt(3, 512)  # 16 chunks, prefilled 64 tokens per step
    eng = engine(model_dir, daemon.zmq_address)
    try:
        eng.add("long", long, max_tokens=2)
        seen: list[tuple[int, int]] = []
        assert eng.worker is not None and eng.worker.worker_half is not None
        while eng.scheduler.has_requests():
            record = eng.step()
            # a worker whose copies finish within its step: the lag below is the protocol's
            eng.worker.worker_half.wait_inflight()
            if "long" in record.scheduled:
                done = record.computed_before["long"] + record.scheduled["long"]
                seen.append((done, ns_hits(eng, daemon, long)))
        prefill = [(done, hits) for done, hits in seen if done <= len(long)]
        hits = [h for _, h in prefill]
        assert hits == sorted(hits)  # only ever grows
        # chunks are in kvserver while the prompt is still being computed
        assert any(h > 0 for done, h in prefill if done < len(long))
        for done, h in prefill:
            assert h <= done // CHUNK_TOKENS  # never a chunk that is not computed yet
        assert ns_hits(eng, daemon, long) == 16
    finally:
        eng.close()
    assert daemon_holds_nothing(daemon)


@pytest.mark.parametrize("defer_finalize", [False, True], ids=["finalized", "deferred"])
def test_request_finishing_with_stores_in_flight_holds_its_blocks(
    model_dir: Path, daemon: DaemonProc, defer_finalize: bool
) -> None:
    """``deferred``: the worker's results are collected before its ``wait_for_save`` (vLLM
    with a speculator); the request must still not be reported finished sending before its
    stores have read its blocks (was: reported in the step its stores were shipped, before
    they were even queued, so vLLM freed blocks they were about to read)."""
    tokens = prompt(4, 64)  # exactly 2 chunks
    eng = engine(model_dir, daemon.zmq_address, defer_finalize=defer_finalize)
    try:
        eng.add("short", tokens, max_tokens=1)  # finishes in the step that computes the prompt
        records = eng.run()
        finished_at = next(i for i, r in enumerate(records) if "short" in r.finished)
        released_at = next(i for i, r in enumerate(records) if "short" in r.finished_sending)
        # the stores were still in flight when it finished: vLLM kept its blocks until the
        # workers reported them, then freed them
        assert released_at > finished_at
        assert any("short" in r.delayed for r in records)
        assert ns_hits(eng, daemon, tokens) == 2
        assert_scheduler_empty(eng)
    finally:
        eng.close()
    assert daemon_holds_nothing(daemon)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_preemption_with_stores_in_flight(
    model_dir: Path, daemon: DaemonProc, async_scheduling: bool
) -> None:
    """A pool too small for every request's decode: vLLM preempts requests whose stores are
    held in flight (a gate on the worker's store direction, opened only by the step that names
    them for the barrier); the barrier keeps the stored bytes right (later loads are checked
    byte by byte) and every output equals the cache-off run."""
    from tests.support.gate import Gate
    from worker.transfer import Direction

    prompts = [(f"r{i}", prompt(10 + i, 40)) for i in range(4)]
    # PATIENT: this test is about the barrier, not timeouts; at the 0.1 s default a lookup
    # that a loaded machine answers late opens the connector's breaker, and the stores it then
    # skips make ns_hits below fail (seen at load average 12-14)
    config = make_vllm_config(model_dir, {"address": daemon.zmq_address,
                                          "chunk_blocks": CHUNK_BLOCKS, **PATIENT})  # fmt: skip
    config.scheduler_config.async_scheduling = async_scheduling  # vLLM's default on GPUs
    eng = MiniEngine(config, 20)
    assert eng.worker is not None and eng.worker.worker_half is not None
    worker_half = eng.worker.worker_half
    gate = Gate(worker_half, Direction.STORE)
    flush_opened: list[set[str]] = []

    def open_on_flush(out: Any) -> None:
        flushed = set(out.kv_connector_metadata.inner.flush_req_ids)
        if flushed and not gate.is_open:
            flush_opened.append(flushed)
            gate.open()  # the barrier in handle_preemptions can now complete

    try:
        for req_id, tokens in prompts:
            eng.add(req_id, tokens, max_tokens=70)
        while eng.scheduler.has_requests():
            record = eng.step(before_worker=open_on_flush)
            if not record.scheduled:
                gate.open()
                worker_half.wait_inflight()
        outputs = dict(eng.outputs)
        # a request was preempted while its stores were held in flight: the step that freed
        # its blocks named it for the barrier
        assert flush_opened and flush_opened[0] <= set().union(*(r.preempted for r in eng.history))
        assert_scheduler_empty(eng)
        sequences = [[*tokens, *outputs[req_id]] for req_id, tokens in prompts]
        for seq in sequences:  # 109 of 110 tokens computed: 3 chunks each
            assert ns_hits(eng, daemon, seq) == 3
        eng.scheduler.reset_prefix_cache()
        again = [(f"again{i}", [*seq, 9]) for i, seq in enumerate(sequences)]
        eng.run_requests(again, max_tokens=2)  # the forward pass checks every loaded byte
        stats = eng.connector.scheduler_half.stats  # type: ignore[union-attr]
        assert stats.loads >= len(again) and stats.load_errors == 0
        assert_scheduler_empty(eng)
    finally:
        gate.open()
        eng.close()
    ref = reference_outputs(model_dir, prompts, 70, num_blocks=20)
    assert outputs == ref
    assert daemon_holds_nothing(daemon)


# ---------------------------------------------------------------------------------- failures


def test_a_hit_offered_while_the_request_waits_for_blocks_is_counted_once(
    model_dir: Path, daemon: DaemonProc
) -> None:
    """vLLM asks again every step while the blocks of an offered hit cannot be allocated (a
    long request holds them); hit_tokens counts the hit vLLM took, once, not every offer."""
    shared, long = prompt(6, 100), prompt(7, 150)
    eng = engine(model_dir, daemon.zmq_address, num_blocks=12)
    try:
        eng.run_requests([("first", shared)], max_tokens=3)
        assert eng.scheduler.reset_prefix_cache()
        stats = eng.connector.scheduler_half.stats  # type: ignore[union-attr]
        eng.add("long", long, max_tokens=20)
        eng.step()
        eng.add("second", [*shared, 5], max_tokens=3)
        asks = stats.lookups + stats.lookups_reused
        records = eng.run()
        # offered on several steps before it was admitted (looked up or the last answer reused)
        assert stats.lookups + stats.lookups_reused - asks > 1
        loaded = next(r for r in records if "second" in r.finished_recving)
        assert not loaded.invalid_block_ids
        assert stats.loads == 1 and stats.hit_tokens == 3 * CHUNK_TOKENS
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    prompts = [("first", shared), ("long", long), ("second", [*shared, 5])]
    ref = reference_outputs(model_dir, prompts, 3, num_blocks=12)
    assert outputs["second"] == ref["second"]


def blocked_behind_a_long_request(
    eng: MiniEngine, shared: list[int], num_waiting: int
) -> list[str]:
    """``shared`` stored in kvserver (and forgotten by the GPU), then a long request that
    holds the blocks, then ``num_waiting`` requests extending ``shared``, which wait."""
    eng.run_requests([("first", shared)], max_tokens=3)
    assert eng.scheduler.reset_prefix_cache()
    eng.add("long", prompt(7, 150), max_tokens=20)
    eng.step()
    waiting = [f"w{i}" for i in range(num_waiting)]
    for i, req_id in enumerate(waiting):
        eng.add(req_id, [*shared, 5 + i], max_tokens=3)
    return waiting


@pytest.mark.parametrize("lookup_reuse_s", [0.0, 60.0], ids=["no-reuse", "reuse"])
def test_requests_waiting_for_blocks_reuse_their_lookup(
    model_dir: Path, daemon: DaemonProc, lookup_reuse_s: float
) -> None:
    """Six requests with a kvserver hit wait while a long request holds the blocks; vLLM asks
    for the hit of the first at every step. lookup_reuse_s=0: a daemon lookup per step (as
    before the reuse); else one lookup in all, the later asks answered from it. Outputs as
    without kvserver either way."""
    shared = prompt(6, 100)
    eng = engine(model_dir, daemon.zmq_address, num_blocks=12, lookup_reuse_s=lookup_reuse_s)
    try:
        waiting = blocked_behind_a_long_request(eng, shared, 6)
        conn = eng.connector.scheduler_half
        assert conn is not None
        sent, stats = conn.client.sent_by_op, conn.stats
        lookups, reused = sent[LOOKUP], stats.lookups_reused
        for _ in range(12):
            record = eng.step()
            assert not set(waiting) & set(record.scheduled)  # still waiting for blocks
        asks = sent[LOOKUP] - lookups + stats.lookups_reused - reused
        assert asks >= 6  # asked on most of the 12 steps
        if lookup_reuse_s:
            assert sent[LOOKUP] - lookups == 1
        else:
            assert stats.lookups_reused == reused == 0
        eng.run()
        assert stats.hit_tokens >= 3 * CHUNK_TOKENS and stats.load_errors == 0
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    prompts = [("first", shared), ("long", prompt(7, 150))]
    prompts += [(r, [*shared, 5 + i]) for i, r in enumerate(waiting)]
    ref = reference_outputs(model_dir, prompts, 3, num_blocks=12)
    assert {r: outputs[r] for r in waiting} == {r: ref[r] for r in waiting}


@pytest.mark.parametrize("admitted", ["past-the-bound", "within-the-bound"])
def test_a_chunk_evicted_while_its_request_waits(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, admitted: str
) -> None:
    """Another client's chunks evict the hit of a request waiting for blocks, unseen by the
    connector. Within lookup_reuse_s the request is still offered the hit (its last answer);
    past it the next ask looks up again and offers nothing. Admitted within the bound, the
    stale hit fails at the pin and is recomputed: the output is unchanged either way."""
    from tests.kvserver.builders import make_keys, pattern

    small = start_daemon(tmp_path / "small", "--dram", "1MiB")
    shared = prompt(6, 100)
    eng = engine(model_dir, small.zmq_address, num_blocks=12, lookup_reuse_s=1.0)
    now = [0.0]
    conn = eng.connector.scheduler_half
    assert conn is not None
    monkeypatch.setattr(conn._loads, "_clock", lambda: now[0])  # the bound, deterministically
    offers: list[int | None] = []
    connector = eng.scheduler.connector
    assert connector is not None
    offer = connector.get_num_new_matched_tokens

    def recorded(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        hit, is_async = offer(request, num_computed_tokens)
        if request.request_id == "w0":
            offers.append(hit)
        return hit, is_async

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", recorded)
    try:
        blocked_behind_a_long_request(eng, shared, 1)
        while not offers:
            eng.step()
        assert offers == [3 * CHUNK_TOKENS]
        spec = eng.connector.config.spec
        with KVClient(small.zmq_address, colocated=False) as kv:  # fills the 1 MiB DRAM
            ns_id = kv.register_namespace(spec).ns_id
            for key in make_keys(2 * (1 << 20) // spec.part_bytes + 2, tag="filler"):
                kv.put(ns_id, [key], [pattern(key, 0, spec.part_bytes)])
        stats = conn.stats
        if admitted == "past-the-bound":
            eng.step()
            assert offers[-1] == 3 * CHUNK_TOKENS  # within the bound: its last answer
            now[0] += 1.0
            lookups = stats.lookups
            eng.step()
            assert stats.lookups == lookups + 1 and offers[-1] == 0  # looked up: gone
            records = eng.run()
            assert stats.loads == 0 and stats.load_errors == 0
        else:
            records = eng.run()  # the stale offer is taken: the pin finds the chunks gone
            assert stats.loads == 1 and stats.load_errors == 1
            assert_recomputed(eng, records, "w0")
        ran = next(r for r in records if "w0" in r.scheduled)
        assert ran.computed_before["w0"] == 0
        outputs = dict(eng.outputs)
    finally:
        eng.close()
        small.terminate()
    prompts = [("first", shared), ("long", prompt(7, 150)), ("w0", [*shared, 5])]
    assert outputs["w0"] == reference_outputs(model_dir, prompts, 3, num_blocks=12)["w0"]


def test_failed_load_is_recomputed(model_dir: Path, daemon: DaemonProc) -> None:
    """The daemon dies after the hit was pinned and before the worker reads it (remote path):
    the worker reports the blocks, vLLM recomputes them, the output is unchanged."""
    shared = prompt(5, 100)
    eng = engine(model_dir, daemon.zmq_address, colocated=False, transfer_timeout_s=2.0,
                 op_timeout_s=0.5)  # fmt: skip
    try:
        eng.run_requests([("first", shared)], max_tokens=2)
        assert ns_hits(eng, daemon, shared) == 3
        eng.scheduler.reset_prefix_cache()
        eng.add("second", [*shared, 4], max_tokens=2)
        record = eng.step(before_worker=lambda _: daemon.kill())  # pinned, then killed
        assert_recomputed(eng, [record, *eng.run()], "second")
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    ref = reference_outputs(model_dir, [("first", shared), ("second", [*shared, 4])], 2)
    assert outputs == ref


def test_a_load_whose_lease_ran_out_before_the_worker_copies_it_is_recomputed(
    model_dir: Path, daemon: DaemonProc
) -> None:
    """The hit is pinned and shipped, but the co-located worker gets to it only when its
    lease has no time left (as after a stall: the daemon may reuse the pages after the
    quarantine): it copies nothing and reports the blocks through
    get_block_ids_with_load_errors; vLLM reschedules the request (here it finds the chunks
    in kvserver again and loads them, every position's KV checked by the forward pass), the
    output is unchanged. Was: loads carried no deadline, the worker copied them and
    reported them loaded."""
    shared = prompt(6, 100)
    eng = engine(model_dir, daemon.zmq_address)
    try:
        eng.run_requests([("first", shared)], max_tokens=2)
        assert ns_hits(eng, daemon, shared) == 3
        eng.scheduler.reset_prefix_cache()
        eng.add("second", [*shared, 4], max_tokens=2)
        shipped: list[float | None] = []

        def no_time_left(out: Any) -> None:
            meta = out.kv_connector_metadata
            for t in meta.inner.loads:
                shipped.append(t.expires_in_s)
                t.expires_in_s = 0.0

        records = [eng.step(before_worker=no_time_left), *eng.run()]
        assert shipped and all(s is not None and s > 0 for s in shipped)
        failed = next(r for r in records if "second" in r.finished_recving)
        assert failed.invalid_block_ids  # the blocks it did not fill
        assert_scheduler_empty(eng)
        assert eng.worker is not None
        assert eng.worker.worker_half.deadlines.expired_loads == 1  # type: ignore[union-attr]
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    ref = reference_outputs(model_dir, [("first", shared), ("second", [*shared, 4])], 2)
    assert outputs == ref


def test_hit_that_cannot_be_pinned_is_recomputed(
    model_dir: Path, daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon dies between the lookup and the pin (both inside one schedule()): the
    scheduler connector tells the workers, who report the blocks, and vLLM recomputes."""
    shared = prompt(6, 100)
    eng = engine(model_dir, daemon.zmq_address, op_timeout_s=0.5)
    try:
        eng.run_requests([("first", shared)], max_tokens=2)
        assert ns_hits(eng, daemon, shared) == 3
        eng.scheduler.reset_prefix_cache()
        client = eng.connector.scheduler_half.client  # type: ignore[union-attr]
        real_prepare_load = client.prepare_load

        def die_then_pin(*args: Any, **kwargs: Any) -> Any:
            daemon.kill()  # a real fault at the one moment a test cannot otherwise reach
            return real_prepare_load(*args, **kwargs)

        monkeypatch.setattr(client, "prepare_load", die_then_pin)
        eng.add("second", [*shared, 4], max_tokens=2)
        assert_recomputed(eng, eng.run(), "second")
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    ref = reference_outputs(model_dir, [("first", shared), ("second", [*shared, 4])], 2)
    assert outputs == ref


def test_a_hit_vllm_changed_recomputes_only_the_blocks_after_the_local_hit(
    model_dir: Path, daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM takes one block less of the offered hit than offered (as its caps may): the plug-in
    loads nothing and flags the blocks after the GPU's own hit (was: from block 0, read off
    ``request.num_computed_tokens`` that vLLM sets only after the call, so vLLM recomputed
    from token 0 and the tail block went unflagged: each retry looked up, was cut and failed
    again, 2000 steps without finishing here)."""
    shared = prompt(2, 130)
    eng = engine(model_dir, daemon.zmq_address, num_blocks=64)
    try:
        eng.run_requests([("a", shared)], max_tokens=2)
        assert ns_hits(eng, daemon, shared) == 4
        eng.scheduler.reset_prefix_cache()
        eng.run_requests([("warm", shared[:40])], max_tokens=1)  # chunk 0 on the GPU again
        connector = eng.scheduler.connector
        assert connector is not None
        offer = connector.get_num_new_matched_tokens

        def one_block_less(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            hit, is_async = offer(request, num_computed_tokens)
            assert request.request_id != "b" or (num_computed_tokens, hit) == (32, 96)
            return (hit - 16 if hit else hit), is_async  # a real fault of vLLM's choosing

        monkeypatch.setattr(connector, "get_num_new_matched_tokens", one_block_less)
        stats = eng.connector.scheduler_half.stats  # type: ignore[union-attr]
        loads = stats.loads  # warm's
        eng.add("b", [*shared, 1, 2], max_tokens=2)
        records = eng.run()
        failed = next(r for r in records if "b" in r.finished_recving)
        ran = next(r for r in records if "b" in r.scheduled)
        assert ran.computed_before["b"] == CHUNK_TOKENS  # from the local hit, not from 0
        assert len(failed.invalid_block_ids) == 5  # blocks 2-6: the 80 tokens vLLM took
        assert stats.loads == loads  # b's hit was not loaded
        assert_scheduler_empty(eng)
        outputs = dict(eng.outputs)
    finally:
        eng.close()
    ref = reference_outputs(
        model_dir, [("a", shared), ("warm", shared[:40]), ("b", [*shared, 1, 2])], 2
    )
    assert outputs["b"] == ref["b"]
    assert daemon_holds_nothing(daemon)


def test_daemon_down_means_no_hits_and_scheduling_goes_on(model_dir: Path, tmp_path: Path) -> None:
    dead = start_daemon(tmp_path / "dead")
    address = dead.zmq_address
    dead.kill()  # nothing listens there any more
    prompts = [(f"r{i}", prompt(20 + i, 70)) for i in range(3)]
    eng = engine(model_dir, address, lookup_timeout_s=0.05, op_timeout_s=0.2)
    try:
        outputs = dict(eng.run_requests(prompts, max_tokens=3))
        stats = eng.connector.scheduler_half.stats  # type: ignore[union-attr]
        assert stats.hit_tokens == 0 and stats.loads == 0
        assert stats.timeouts >= 1  # it found the daemon down ...
        assert stats.lookups_failed >= 1  # ... and answered "no hit" meanwhile
        assert_scheduler_empty(eng)
    finally:
        eng.close()
    assert outputs == reference_outputs(model_dir, prompts, 3)


def test_worker_starts_while_the_daemon_is_down_and_stores_once_it_is_up(
    model_dir: Path, tmp_path: Path
) -> None:
    """Worker start-up does not need the daemon; it connects before its first transfer."""
    first = start_daemon(tmp_path / "d1", *port_kept())
    address = first.zmq_address
    first.kill()
    eng = engine(model_dir, address, lookup_timeout_s=0.05, op_timeout_s=0.5,
                 down_backoff_s=0.01)  # fmt: skip
    worker = eng.worker
    assert worker is not None and not worker.worker_half.session.connected  # type: ignore[union-attr]
    port = address.rsplit(":", 1)[1]
    second = start_daemon(tmp_path / "d2", "--zmq-port", port)
    try:
        tokens = prompt(7, 64)
        eng.run_requests([("a", tokens)], max_tokens=2)
        assert ns_hits(eng, second, tokens) == 2
        eng.close()
    finally:
        second.terminate()


# ---------------------------------------------------------------------------------- events


def test_take_events_describes_stored_chunks_as_vllm_does(
    model_dir: Path, daemon: DaemonProc
) -> None:
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    published: list[Any] = []
    eng = engine(model_dir, daemon.zmq_address)

    class Sink:  # vLLM's event publisher, recording instead of sending
        def publish(self, batch: Any) -> None:
            published.extend(batch.events)

        def shutdown(self) -> None:
            return None

    eng.scheduler.kv_event_publisher = Sink()
    try:
        tokens = prompt(8, 70)
        request = eng.add("a", tokens, max_tokens=1)
        hashes = list(request.block_hashes)
        eng.run()
        eng.connector.scheduler_half.drain()  # type: ignore[union-attr]
        published.extend(eng.connector.take_events())
    finally:
        eng.close()
    ours = [e for e in published if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(ours) == 2
    by_first = sorted(ours, key=lambda e: len(e.token_ids) and e.token_ids[0] != tokens[0])
    first, second = by_first
    ext = maybe_convert_block_hash
    assert first.block_hashes == [ext(hashes[0]), ext(hashes[1])]
    assert first.parent_block_hash is None and first.token_ids == tokens[:32]
    assert second.block_hashes == [ext(hashes[2]), ext(hashes[3])]
    assert second.parent_block_hash == ext(hashes[1]) and second.token_ids == tokens[32:64]
    assert first.block_size == 16


def test_a_chunk_found_gone_is_removed_under_the_block_hashes_it_was_stored_under(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BlockStored named a chunk's CHUNK_BLOCKS block hashes; the BlockRemoved of that chunk,
    found evicted when a later hit is pinned, names the same hashes (as vLLM's own
    OffloadingConnector fans its removals out), so a subscriber indexing vLLM blocks forgets
    every block of it, not only the last one."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    from tests.kvserver.builders import make_keys, pattern

    published: list[Any] = []

    class Sink:  # vLLM's event publisher, recording instead of sending
        def publish(self, batch: Any) -> None:
            published.extend(batch.events)

        def shutdown(self) -> None:
            return None

    small = start_daemon(tmp_path / "small", "--dram", "1MiB")
    eng = engine(model_dir, small.zmq_address)
    eng.scheduler.kv_event_publisher = Sink()
    try:
        tokens = prompt(12, 100)
        hashes = list(eng.add("a", tokens, max_tokens=1).block_hashes)
        eng.run()
        eng.connector.scheduler_half.drain()  # type: ignore[union-attr]
        published.extend(eng.connector.take_events())
        stored = [e for e in published if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert stored[0].block_hashes == [ext(h) for h in hashes[:CHUNK_BLOCKS]]
        assert eng.scheduler.reset_prefix_cache()
        spec = eng.connector.config.spec
        client = eng.connector.scheduler_half.client  # type: ignore[union-attr]
        real_prepare_load = client.prepare_load

        def evict_then_pin(*args: Any, **kwargs: Any) -> Any:
            # another engine's chunks fill the daemon's DRAM between the lookup and the pin
            with KVClient(small.zmq_address, colocated=False) as kv:
                ns_id = kv.register_namespace(spec).ns_id
                filler = make_keys(2 * (1 << 20) // spec.part_bytes + 2, tag="filler")
                for key in filler:
                    kv.put(ns_id, [key], [pattern(key, 0, spec.part_bytes)])
            monkeypatch.setattr(client, "prepare_load", real_prepare_load)
            return real_prepare_load(*args, **kwargs)

        monkeypatch.setattr(client, "prepare_load", evict_then_pin)
        eng.add("b", [*tokens, 4], max_tokens=1)
        eng.run()
        published.extend(eng.connector.take_events())
        removed = [e for e in published if isinstance(e, BlockRemoved) and e.medium == "CPU"]
        assert [e.block_hashes for e in removed] == [[ext(h) for h in hashes[:CHUNK_BLOCKS]]]
        outputs = dict(eng.outputs)
    finally:
        eng.close()
        small.terminate()
    assert outputs == reference_outputs(model_dir, [("a", tokens), ("b", [*tokens, 4])], 1)


def test_router_lookup_by_tokens_agrees_with_vllm_block_hashes(
    model_dir: Path, daemon: DaemonProc
) -> None:
    """A router asking kvserver by token ids (kvserver hashes) finds what vLLM stored under
    vLLM's own block hashes: both hash the same way."""
    tokens = prompt(9, 96)
    eng = engine(model_dir, daemon.zmq_address)
    try:
        eng.run_requests([("a", tokens)], max_tokens=1)
        spec = eng.connector.config.spec
        eng.connector.scheduler_half.drain()  # type: ignore[union-attr]
    finally:
        eng.close()
    with KVClient(daemon.zmq_address, colocated=False) as kv:
        assert kv.lookup_tokens(spec.ns_id, tokens).hit_chunks == 3
    with GrpcClient(daemon.grpc_address) as grpc:
        reply = grpc.lookup_tokens(spec.ns_id, tokens)
    assert reply.hit_tokens == 96 and reply.tiers.get("dram") == 3


def test_the_connector_over_curve_with_a_token_and_a_wrong_key(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon beyond loopback (CURVE + TLS + a token): the connector given the daemon's
    public key (kv_connector_extra_config, docs/vllm.md) stores and loads over the remote path
    (payload frames on CURVE); one given a wrong key says why, finds no hits and schedules on,
    while the daemon serves the first."""
    token = "vllm-curve-token-0123456789"
    server_key, server_secret = make_curve_keys(str(tmp_path / "keys"), "server")
    wrong_key, _ = make_curve_keys(str(tmp_path / "other"), "server")
    cert, key = make_tls_cert(str(tmp_path / "tls"), "server", ["127.0.0.1"])
    daemon = start_daemon(
        tmp_path / "daemon", "--host", "0.0.0.0", "--auth-token", token,
        "--curve-secret-key-file", server_secret, "--tls-cert-file", cert, "--tls-key-file", key,
    )  # fmt: skip
    shared = prompt(40, 100)
    good = engine(model_dir, daemon.zmq_address, colocated=False, auth_token=token,
                  curve_server_key_file=server_key)  # fmt: skip
    bad = engine(model_dir, daemon.zmq_address, colocated=False, auth_token=token,
                 curve_server_key_file=wrong_key, lookup_timeout_s=0.5,
                 op_timeout_s=1.0)  # fmt: skip
    try:
        good.run_requests([("first", shared)], max_tokens=3)
        good.connector.scheduler_half.drain()  # type: ignore[union-attr]
        ns_id = good.connector.config.spec.ns_id
        with GrpcClient(daemon.grpc_address, tls=TlsClient(cert), auth_token=token) as g:
            assert g.lookup_tokens(ns_id, shared).hit_chunks == 3
        with caplog.at_level("WARNING"):
            bad_out = dict(bad.run_requests([("other", shared)], max_tokens=3))
        bad_stats = bad.connector.scheduler_half.stats  # type: ignore[union-attr]
        assert bad_stats.loads == 0 and bad_stats.hit_tokens == 0
        assert "curve_server_key_file is not the daemon's public key" in caplog.text
        assert good.scheduler.reset_prefix_cache()
        outputs = dict(good.run_requests([("second", [*shared, 5, 6])], max_tokens=3))
        stats = good.connector.scheduler_half.stats  # type: ignore[union-attr]
        assert stats.loads == 1 and stats.hit_tokens == 3 * CHUNK_TOKENS
    finally:
        good.close()
        bad.close()
        assert daemon.terminate() == 0
    ref = reference_outputs(model_dir, [("second", [*shared, 5, 6]), ("other", shared)], 3)
    assert (outputs["second"], bad_out["other"]) == (ref["second"], ref["other"])
