"""The scheduler driving a connector at its five touchpoints: external hits,
WAITING_FOR_REMOTE_KVS while loads land, failed loads recomputed, blocks kept until the
connector's stores are done. Uses the in-memory connector of scheduler/memory_connector.py."""

from __future__ import annotations

from scheduler.memory_connector import MemoryConnector
from scheduler.request import RequestStatus
from step_protocol import (
    ConnectorMetadata,
    ConnectorWorkerOutput,
    StepResult,
    TransferResult,
)
from tests.scheduler.builders import expected_output, harness, tokens

PROMPT = tokens(12, 500)


def stored_prompt(conn: MemoryConnector, prompt: list[int] = PROMPT) -> None:
    """Run ``prompt`` once so that its chunks end up in the connector's store."""
    h = harness(connector=conn)
    h.add("seed", prompt, max_tokens=1)
    h.run()
    assert conn.stored and not conn.has_pending_transfers


def test_touchpoints_in_order() -> None:
    conn = MemoryConnector(4)
    h = harness(connector=conn)
    h.add("A", tokens(8), max_tokens=2)
    h.run()
    assert conn.calls == [
        ("get_num_new_matched_tokens", "A"),
        ("update_state_after_alloc", "A"),
        ("request_finished", "A"),
    ]
    assert all(isinstance(p.connector_meta, ConnectorMetadata) for p in h.plans)
    # the two full prompt blocks were stored (deferred one step), then the blocks freed
    assert len(conn.stored) == 2
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1


def test_async_load_waits_for_remote_kvs() -> None:
    conn = MemoryConnector(4)
    stored_prompt(conn)
    h = harness(connector=conn)
    h.add("B", PROMPT, max_tokens=3)
    plan, outs = h.step()
    b = h.scheduler.requests["B"]
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not outs
    assert plan.num_scheduled_tokens == {} and len(plan.connector_meta.loads) == 1
    assert len(h.scheduler.kv.get_blocks("B")) == 2  # blocks for the 8 tokens it loads
    assert h.pool.num_cached_blocks == 0  # loaded blocks are published once they land
    plan, outs = h.step()  # the synthetic worker reported the load in the previous step
    assert plan.new_reqs[0].num_computed_tokens == 8 and plan.num_scheduled_tokens == {"B": 4}
    usage = outs[0].usage
    assert usage is not None
    assert (usage.gpu_cached_tokens, usage.kvserver_tokens, usage.computed_tokens) == (0, 8, 4)
    h.run()
    assert h.outputs["B"] == expected_output(PROMPT, 3)


def test_gpu_hits_then_kvserver_hits() -> None:
    """Local blocks first; the connector is asked only for what follows them."""
    conn = MemoryConnector(4)
    stored_prompt(conn, [*PROMPT, 1, 2, 3, 4])
    h = harness(connector=conn)
    h.add("A", [*PROMPT[:8], 9], max_tokens=1)
    h.run()
    h.add("B", [*PROMPT, 1, 2, 3, 4, 5], max_tokens=1)
    h.run()
    assert ("get_num_new_matched_tokens", "B") in conn.calls
    usage = h.finished["B"].usage
    assert usage is not None
    assert (usage.gpu_cached_tokens, usage.kvserver_tokens, usage.computed_tokens) == (8, 8, 1)


def test_failed_async_load_is_recomputed() -> None:
    conn = MemoryConnector(4)
    stored_prompt(conn)
    h = harness(connector=conn)
    b = h.scheduler.make_request("B", PROMPT, max_tokens=2)
    conn.failing_keys = {b.block_hashes[1]}  # the second chunk cannot be read
    h.scheduler.add_request(b)
    h.step()
    plan, outs = h.step()
    assert plan.new_reqs[0].num_computed_tokens == 4 and plan.num_scheduled_tokens == {"B": 8}
    usage = outs[0].usage
    assert usage is not None and (usage.kvserver_tokens, usage.computed_tokens) == (4, 8)
    h.run()
    assert h.outputs["B"] == expected_output(PROMPT, 2)


def test_failed_sync_load_rewinds_a_running_request() -> None:
    """A load in the step's forward pass fails: the step's sample is void, the invalid
    blocks leave the prefix cache and the tokens after the valid prefix are recomputed."""
    conn = MemoryConnector(4, load_async=False)
    stored_prompt(conn)
    h = harness(connector=conn)
    b = h.scheduler.make_request("B", PROMPT, max_tokens=2)
    conn.failing_keys = {b.block_hashes[1]}
    h.scheduler.add_request(b)
    plan, outs = h.step()
    assert plan.num_scheduled_tokens == {"B": 4} and not outs
    assert b.num_computed_tokens == 4 and b.status == RequestStatus.RUNNING
    bad_block = h.scheduler.kv.get_blocks("B")[1]
    assert bad_block.block_hash is None
    plan, outs = h.step()
    assert plan.num_scheduled_tokens == {"B": 8} and len(outs) == 1
    h.run()
    assert h.outputs["B"] == expected_output(PROMPT, 2)


def test_blocks_kept_until_stores_finish() -> None:
    conn = MemoryConnector(4)
    h = harness(connector=conn)
    h.add("A", tokens(8), max_tokens=1)
    _, outs = h.step()
    assert outs[0].finished
    # its two full blocks are still to be stored (deferred one step): blocks held
    assert "A" in h.scheduler.transfers.delayed_free
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1 - 2
    plan, _ = h.step()
    assert len(plan.connector_meta.stores) == 1 and plan.finished_req_ids == ["A"]
    assert not h.scheduler.transfers.delayed_free
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1
    assert not h.scheduler.has_work()


def test_undecided_connector_retries_next_step() -> None:
    conn = MemoryConnector(4)
    h = harness(connector=conn)
    conn.undecided.add("A")
    h.add("A", tokens(8), max_tokens=1)
    h.add("B", tokens(8, 900), max_tokens=1)
    plan, _ = h.step()
    assert list(plan.num_scheduled_tokens) == ["B"]
    assert h.scheduler.requests["A"].status == RequestStatus.WAITING
    conn.undecided.clear()
    plan, _ = h.step()
    assert list(plan.num_scheduled_tokens) == ["A"]


def test_abort_while_loading_frees_blocks_after_the_load() -> None:
    conn = MemoryConnector(4)
    stored_prompt(conn)
    h = harness(connector=conn)
    h.add("B", PROMPT, max_tokens=1)
    plan = h.scheduler.schedule()
    h.scheduler.update_from_output(plan, [StepResult(plan.step, 0)])  # load still in flight
    held = h.pool.num_blocks - 1 - h.pool.num_free_blocks
    assert held == 2
    h.scheduler.finish_requests(["B"])
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1 - held  # a load writes them
    (transfers,) = plan.connector_meta.loads
    report = ConnectorWorkerOutput(0, loads=[TransferResult("B", transfers.lease_id)])
    plan = h.scheduler.schedule()
    h.scheduler.update_from_output(plan, [StepResult(plan.step, 0, connector_output=report)])
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1
    h.pool.check_invariants()


def test_two_ranks_must_both_report() -> None:
    conn = MemoryConnector(4, world_size=2)
    stored_prompt(MemoryConnector(4))  # warm-up only
    h = harness(connector=conn, world_size=2)
    h.add("A", tokens(8), max_tokens=1)
    h.run()
    assert len(conn.stored) == 2 and h.pool.num_free_blocks == h.pool.num_blocks - 1
    h2 = harness(connector=conn, world_size=2)
    h2.add("B", [*tokens(8), 1], max_tokens=1)
    plan = h2.scheduler.schedule()
    one_rank = h2.run_workers(plan)[:1]
    h2.scheduler.update_from_output(plan, one_rank)
    assert h2.scheduler.requests["B"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    plan = h2.scheduler.schedule()
    assert plan.num_scheduled_tokens == {}  # rank 1 has not reported the load yet
