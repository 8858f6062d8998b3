"""Scheduler scenarios (those of vLLM V1's scheduler), driven with synthetic worker outputs:
the shared token budget, chunked prefill, prefix-cache hits and eviction, preemption from the
tail and resumption by recomputation, FCFS and priority order, stop conditions."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserver.errors import CapacityError, InvalidArgument
from scheduler.memory_connector import MemoryConnector
from scheduler.request import RequestStatus
from step_protocol import StepPlan
from tests.scheduler.builders import expected_output, harness, tokens


def scheduled(plan: StepPlan) -> dict[str, int]:
    return dict(plan.num_scheduled_tokens)


# ------------------------------------------------------------------------------ the budget


def test_one_budget_for_prefill_and_decode() -> None:
    """Prefills and decodes draw from one max_num_batched_tokens per step; the last prompt
    admitted gets what is left (chunked prefill), the next waits."""
    h = harness(max_num_batched_tokens=16)
    for name in "ABC":
        h.add(name, tokens(10, start=ord(name) * 100), max_tokens=3)
    plan, outs = h.step()
    assert scheduled(plan) == {"A": 10, "B": 6}
    assert [o.request_id for o in outs] == ["A"]  # B's partial prefill samples nothing
    plan, outs = h.step()
    assert scheduled(plan) == {"A": 1, "B": 4, "C": 10}
    assert plan.total_num_scheduled_tokens == 15
    assert [c.req_id for c in plan.cached_reqs] == ["A", "B"]
    assert [n.req_id for n in plan.new_reqs] == ["C"]
    plan, _ = h.step()
    assert scheduled(plan) == {"A": 1, "B": 1, "C": 1}


def test_long_prefill_threshold_chunks_a_prompt() -> None:
    h = harness(long_prefill_token_threshold=4)
    prompt = tokens(10)
    h.add("A", prompt, max_tokens=2)
    sizes = []
    while h.scheduler.has_work():
        plan, _ = h.step()
        sizes.append(plan.num_scheduled_tokens.get("A"))
    assert sizes == [4, 4, 2, 1, None]  # the last step only tells the workers A ended
    assert h.plans[-1].finished_req_ids == ["A"]
    second = h.plans[1].cached_reqs[0]
    assert second.num_computed_tokens == 4 and second.token_ids == prompt[4:8]
    assert h.outputs["A"] == expected_output(prompt, 2)


def test_without_chunked_prefill_a_prompt_waits_for_room() -> None:
    h = harness(max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False)
    h.add("A", tokens(10), max_tokens=2)
    h.add("B", tokens(10, 200), max_tokens=2)
    plan, _ = h.step()
    assert scheduled(plan) == {"A": 10}
    plan, _ = h.step()
    assert scheduled(plan) == {"A": 1, "B": 10}


def test_max_num_seqs_caps_the_running_list() -> None:
    h = harness(max_num_seqs=2)
    for name in "ABC":
        h.add(name, tokens(4, ord(name)), max_tokens=2)
    plan, _ = h.step()
    assert set(scheduled(plan)) == {"A", "B"}
    assert len(h.scheduler.running) == 2


# ------------------------------------------------------------------------------ prefix cache


def test_identical_prompt_hits_the_gpu_prefix_cache() -> None:
    h = harness()
    prompt = tokens(12)
    h.add("A", prompt, max_tokens=1)
    h.run()
    h.add("B", prompt, max_tokens=3)
    plan, outs = h.step()
    (new,) = plan.new_reqs
    # 3 full blocks are cached but one token must be computed: 2 blocks hit
    assert new.num_computed_tokens == 8 and scheduled(plan) == {"B": 4}
    assert new.block_ids[:2] == h.plans[0].new_reqs[0].block_ids[:2]
    usage = outs[0].usage
    assert usage is not None
    assert (usage.gpu_cached_tokens, usage.kvserver_tokens, usage.computed_tokens) == (8, 0, 4)
    h.run()
    assert h.outputs["B"] == expected_output(prompt, 3)


def test_running_requests_share_prefix_blocks() -> None:
    h = harness()
    prompt = tokens(12)
    h.add("A", prompt, max_tokens=5)
    h.step()
    h.add("B", [*prompt, 7, 7, 7, 7], max_tokens=5)
    plan, _ = h.step()
    b = next(n for n in plan.new_reqs if n.req_id == "B")
    a_blocks = h.scheduler.kv.get_blocks("A")
    assert b.num_computed_tokens == 12 and b.block_ids[:3] == [x.block_id for x in a_blocks[:3]]
    assert [x.ref_cnt for x in a_blocks[:3]] == [2, 2, 2]
    h.run()
    assert h.outputs["A"] == expected_output(prompt, 5)


def test_lru_eviction_of_cached_blocks() -> None:
    """A finished request's blocks stay cached until a new allocation reclaims them, least
    recently freed first; the evicted prefix then misses."""
    h = harness(num_gpu_blocks=7)  # 6 usable blocks
    a, b, c = tokens(8, 100), tokens(8, 200), tokens(16, 300)
    h.add("A", a, max_tokens=1)
    h.run()
    h.add("B", b, max_tokens=1)
    h.run()
    pool = h.pool
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 6
    h.add("C", c, max_tokens=1)
    h.step()
    assert pool.num_evicted == 2
    a_req = h.scheduler.make_request("a2", a, max_tokens=1)
    b_req = h.scheduler.make_request("b2", b, max_tokens=1)
    assert h.scheduler.kv.get_computed_blocks(a_req)[1] == 0  # A (freed first) was evicted
    assert h.scheduler.kv.get_computed_blocks(b_req)[1] == 4  # B survived (7 tokens max: 1 block)


# ------------------------------------------------------------------------------ preemption


def test_preemption_from_the_tail_and_resumption() -> None:
    """Out of blocks, FCFS preempts the youngest running request: its KV is freed, it goes to
    the head of the waiting queue and later resumes by recomputation (its full blocks come
    back from the prefix cache); the tokens are those of an unpreempted run."""
    h = harness(num_gpu_blocks=5)  # 4 usable blocks = 16 tokens for two 12-token requests
    pa, pb = tokens(4, 100), tokens(4, 200)
    h.add("A", pa, max_tokens=8)
    h.add("B", pb, max_tokens=8)
    preempting = None
    while preempting is None:
        plan, _ = h.step()
        if plan.preempted_req_ids:
            preempting = plan
    assert preempting.preempted_req_ids == ["B"]
    assert "A" in preempting.num_scheduled_tokens and "B" not in preempting.num_scheduled_tokens
    assert not preempting.new_reqs  # no admission in a step that preempted
    b = h.scheduler.requests["B"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and h.scheduler.waiting.peek() is b
    assert not h.scheduler.kv.has_blocks("B")
    h.run()
    resumed = [n for p in h.plans for n in p.new_reqs if n.req_id == "B" and n.output_token_ids]
    assert resumed, "B came back as a new request carrying its earlier outputs"
    assert resumed[0].num_computed_tokens > 0  # its full blocks were prefix-cache hits
    assert h.outputs["A"] == expected_output(pa, 8)
    assert h.outputs["B"] == expected_output(pb, 8)
    assert h.finished["B"].usage is not None and h.finished["B"].usage.num_preemptions == 1
    assert h.pool.num_free_blocks == 4


def test_priority_admission_order() -> None:
    h = harness(policy="priority", max_num_seqs=1)
    h.add("low", tokens(4, 100), max_tokens=1, priority=5)
    h.add("high", tokens(4, 200), max_tokens=1, priority=0)
    h.add("mid", tokens(4, 300), max_tokens=1, priority=1)
    order = []
    while h.scheduler.has_work():
        plan, _ = h.step()
        order += [n.req_id for n in plan.new_reqs]
    assert order == ["high", "mid", "low"]


def test_fcfs_admission_order_ignores_priority() -> None:
    h = harness(policy="fcfs", max_num_seqs=1)
    h.add("first", tokens(4, 100), max_tokens=1, priority=5)
    h.add("second", tokens(4, 200), max_tokens=1, priority=0)
    plan, _ = h.step()
    assert [n.req_id for n in plan.new_reqs] == ["first"]


@pytest.mark.parametrize(("policy", "victim"), [("priority", "A"), ("fcfs", "B")])
def test_preemption_victim_by_policy(policy: str, victim: str) -> None:
    """Priority preempts the lowest-priority request even when it is not the tail (here the
    request being scheduled, which preempts itself); FCFS preempts the tail."""
    h = harness(policy=policy, num_gpu_blocks=5)
    h.add("A", tokens(4, 100), max_tokens=8, priority=1)
    h.step()
    h.add("B", tokens(4, 200), max_tokens=8, priority=0)
    while True:
        plan, _ = h.step()
        if plan.preempted_req_ids:
            break
    assert plan.preempted_req_ids == [victim]
    other = "B" if victim == "A" else "A"
    assert other in plan.num_scheduled_tokens and victim not in plan.num_scheduled_tokens
    h.run()
    assert h.outputs["A"] == expected_output(tokens(4, 100), 8)
    assert h.outputs["B"] == expected_output(tokens(4, 200), 8)


# ------------------------------------------------------------------------------ lifecycle


def test_stop_conditions() -> None:
    h = harness(max_model_len=8)
    prompt = tokens(6)
    first = expected_output(prompt, 1)[0]
    h.add("stop", prompt, max_tokens=5, stop_token_ids=[first])
    h.add("cap", tokens(6, 300), max_tokens=10)
    h.add("len", tokens(4, 500), max_tokens=2)
    h.run()
    assert h.finished["stop"].finish_reason == "stop" and h.outputs["stop"] == [first]
    assert h.finished["cap"].finish_reason == "length" and len(h.outputs["cap"]) == 2
    assert h.finished["len"].finish_reason == "length" and len(h.outputs["len"]) == 2


def test_abort_frees_blocks_and_tells_the_workers() -> None:
    h = harness()
    h.add("A", tokens(8), max_tokens=50)
    h.add("W", tokens(8, 300), max_tokens=5)
    h.step()
    free_before = h.pool.num_free_blocks
    ended = h.scheduler.finish_requests(["A", "nope"])
    assert [r.request_id for r in ended] == ["A"]
    assert ended[0].status == RequestStatus.FINISHED_ABORTED
    assert h.pool.num_free_blocks > free_before
    plan, _ = h.step()
    assert plan.finished_req_ids == ["A"] and "A" not in plan.num_scheduled_tokens
    h.scheduler.finish_requests(["W"])
    assert not h.scheduler.requests
    with pytest.raises(InvalidArgument):
        h.scheduler.finish_requests(["W"], RequestStatus.RUNNING)


def test_bad_requests_are_refused() -> None:
    h = harness(max_model_len=8)
    h.add("A", tokens(4), max_tokens=1)
    with pytest.raises(InvalidArgument):
        h.add("A", tokens(4), max_tokens=1)
    with pytest.raises(CapacityError):
        h.add("long", tokens(8), max_tokens=1)
    with pytest.raises(InvalidArgument):
        h.add("none", [], max_tokens=1)
    with pytest.raises(InvalidArgument):
        h.add("zero", tokens(2), max_tokens=0)


def test_fail_all_ends_requests_holding_kv() -> None:
    h = harness()
    h.add("A", tokens(8), max_tokens=50)
    h.step()
    h.add("W", tokens(8, 300), max_tokens=5)
    outs = h.scheduler.fail_all("worker 1 died")
    assert [(o.request_id, o.error, o.finish_reason) for o in outs] == [
        ("A", "worker 1 died", "error")
    ]
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1 and h.pool.num_cached_blocks == 0
    assert list(h.scheduler.requests) == ["W"]
    h.run()
    assert h.outputs["W"] == expected_output(tokens(8, 300), 5)


def test_missing_sample_fails_the_request() -> None:
    h = harness()
    h.add("A", tokens(4), max_tokens=3)
    plan = h.scheduler.schedule()
    results = h.run_workers(plan)
    results[0].sampled_token_ids.clear()
    outs = h.scheduler.update_from_output(plan, results)
    assert outs[0].finished and outs[0].finish_reason == "error" and outs[0].error
    assert h.pool.num_free_blocks == h.pool.num_blocks - 1


# ------------------------------------------------------------------------------ any workload

prompt_st = st.tuples(st.integers(0, 2), st.integers(1, 14), st.integers(1, 10))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(prompt_st, min_size=1, max_size=8),
    policy=st.sampled_from(["fcfs", "priority"]),
    blocks=st.integers(7, 14),
    threshold=st.sampled_from([0, 3, 8]),
    budget=st.sampled_from([8, 16, 64]),
    connector_mode=st.sampled_from(["off", "async", "sync"]),
    world_size=st.sampled_from([1, 2]),
)
def test_any_workload_finishes_with_the_reference_tokens(
    reqs: list[tuple[int, int, int]],
    policy: str,
    blocks: int,
    threshold: int,
    budget: int,
    connector_mode: str,
    world_size: int,
) -> None:
    """Whatever the pressure (preemption, eviction, chunking, kvserver hits), every request
    finishes with the tokens of an undisturbed run and every block comes back."""
    connector = None
    if connector_mode != "off":
        connector = MemoryConnector(
            4, chunk_blocks=2, world_size=world_size, load_async=connector_mode == "async"
        )
    h = harness(
        num_gpu_blocks=blocks,
        policy=policy,
        long_prefill_token_threshold=threshold,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        connector=connector,
        world_size=world_size,
    )
    prefixes = [tokens(12, 1000), tokens(12, 2000), tokens(12, 3000)]
    model_len = (blocks - 1) * 4
    expected = {}
    for i, (family, length, max_tokens) in enumerate(reqs):
        prompt = [*prefixes[family][:length], i]
        max_tokens = max(1, min(max_tokens, model_len - len(prompt)))
        h.add(f"r{i}", prompt, max_tokens=max_tokens, priority=i % 3)
        expected[f"r{i}"] = expected_output(prompt, max_tokens)
        if i % 3 == 2:
            h.step()
    h.run()
    assert h.outputs == expected
    assert h.pool.num_free_blocks == blocks - 1
