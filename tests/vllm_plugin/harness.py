"""A vLLM engine core in miniature: vLLM's own V1 ``Scheduler`` and ``KVOutputAggregator``, our
``KVServerConnector`` in both roles, and a stand-in model runner over real paged KV tensors.

The model runner calls the worker connector exactly as vLLM's ``KVConnectorModelRunnerMixin``
does (handle_preemptions → bind → forward → start_load_kv → wait_for_save →
get_transfer_results → get_block_ids_with_load_errors → build_connector_worker_meta →
clear). Its "forward" is attention-shaped: before writing the KV of the scheduled positions
it reads the KV of every earlier position of the request from the paged cache and checks it
against the reference (a value per position that depends on the whole prefix), so KV loaded
from kvserver that is wrong in any byte fails the step. The sampled token is a function of the
prefix, so a run with kvserver produces exactly the tokens of a run without it.

Nothing here is imported from vLLM's test package.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvserver_vllm import CONNECTOR_MODULE, CONNECTOR_NAME
from kvserver_vllm.connector import KVServerConnector

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
VOCAB = 1000
DTYPE = torch.float16


def write_tiny_model(directory: Path) -> Path:
    """A model directory vLLM's ModelConfig accepts offline: a small Llama config."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS, "num_hidden_layers": NUM_LAYERS,
        "head_dim": HEAD_SIZE, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    }))  # fmt: skip
    return directory


def make_vllm_config(
    model_dir: Path,
    extra: dict[str, Any],
    *,
    block_size: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    failure_policy: str = "recompute",
    connector: bool = True,
    events_endpoint: str | None = None,
    kv_role: str = "kv_both",
) -> VllmConfig:
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", seed=0)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048, enable_chunked_prefill=True, is_encoder_decoder=False,
    )  # fmt: skip
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    transfer = KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
        kv_role=kv_role, kv_connector_extra_config=extra,
        kv_load_failure_policy=failure_policy,
    ) if connector else None  # fmt: skip
    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint, topic="kv"
    ) if events_endpoint else None  # fmt: skip
    return VllmConfig(
        model_config=model, scheduler_config=sched, cache_config=cache,
        kv_transfer_config=transfer, device_config=DeviceConfig("cpu"), kv_events_config=events,
    )  # fmt: skip


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size, num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE, dtype=DTYPE,
    )  # fmt: skip
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )  # fmt: skip


def prefix_values(tokens: list[int]) -> list[int]:
    """One value per position, a function of the whole prefix up to it."""
    out, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
        out.append(h)
    return out


def reference_kv(tokens: list[int]) -> torch.Tensor:
    """(positions, layers, 2, heads, head_size): the KV the model computes for ``tokens``;
    small integers, exact in float16."""
    h = torch.tensor(prefix_values(tokens), dtype=torch.int64)
    offs = torch.arange(NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE, dtype=torch.int64)
    kv = (h[:, None] + offs[None, :] * 7) % 1021
    return kv.reshape(len(tokens), NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_SIZE).to(DTYPE)


@dataclass
class StepRecord:
    """What one engine step did, for assertions."""

    scheduled: dict[str, int]
    computed_before: dict[str, int]
    waiting_for_kv: set[str]
    finished_recving: set[str]
    finished_sending: set[str]
    invalid_block_ids: set[int]
    preempted: set[str]
    #: requests the connector's metadata named for a store barrier (preempted, stores in flight)
    flushed: set[str] = field(default_factory=set)
    #: requests that finished holding their blocks for stores in flight
    delayed: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)


class MiniEngine:
    """vLLM's scheduler + our connector (scheduler role) + one worker (worker role).

    ``blocks_first``: per-layer KV tensors in FlashInfer's layout ``(num_blocks, 2, block_size,
    heads, head_size)`` instead of FlashAttention's ``(2, num_blocks, ...)``. With
    ``scheduler_config.async_scheduling`` the scheduler is vLLM's ``AsyncScheduler`` (steps
    still run one after the other here). ``defer_finalize``: the worker pass collects the
    transfer results before ``wait_for_save`` (vLLM's model runners with a speculator: the
    finalize waits for the drafter's forward)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        num_blocks: int,
        *,
        blocks_first: bool = False,
        defer_finalize: bool = False,
    ) -> None:
        self.blocks_first = blocks_first
        self.defer_finalize = defer_finalize
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.kv_cache_config = make_kv_cache_config(vllm_config, num_blocks)
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(self.block_size, hash_fn)
        cls = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=self.block_size,
        )  # fmt: skip
        self.worker: KVServerConnector | None = None
        layers = self.kv_cache_config.kv_cache_groups[0].layer_names
        shape = (2, num_blocks) if not blocks_first else (num_blocks, 2)
        self.kv_caches = {
            name: torch.zeros(*shape, self.block_size, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE)
            for name in layers
        }
        if vllm_config.kv_transfer_config is not None:
            self.worker = KVServerConnector(
                vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            self.worker.register_kv_caches(self.kv_caches)
        self.aggregator = KVOutputAggregator(expected_finished_count=1)
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.history: list[StepRecord] = []

    @property
    def connector(self) -> KVServerConnector:
        conn = self.scheduler.connector
        assert isinstance(conn, KVServerConnector)
        return conn

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
            pooling_params=None, block_hasher=self.block_hasher,
        )  # fmt: skip
        self.scheduler.add_request(request)
        self.outputs[req_id] = []
        return request

    # ------------------------------------------------------------------ one step

    def step(self, before_worker: Callable[[Any], None] | None = None) -> StepRecord:
        """One engine step; ``before_worker(scheduler_output)`` runs between scheduling and
        the worker pass."""
        out = self.scheduler.schedule()
        if before_worker is not None:
            before_worker(out)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            computed[req_id] = n
        kv_out = self._worker_pass(out, computed)
        sampled: list[list[int]] = []
        req_ids = list(out.num_scheduled_tokens)
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = computed[req_id] + out.num_scheduled_tokens[req_id]
            if done >= request.num_tokens:  # the prompt (and outputs so far) are computed
                sampled.append([prefix_values(list(request.all_token_ids))[-1] % VOCAB])
            else:
                sampled.append([])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_out,
        )  # fmt: skip
        merged = self.aggregator.aggregate([runner_out]) if kv_out is not None else runner_out
        assert merged is not None
        merged_kv = merged.kv_connector_output or KVConnectorOutput()
        record = StepRecord(
            scheduled=dict(out.num_scheduled_tokens), computed_before=computed,
            waiting_for_kv=set(), finished_recving=set(merged_kv.finished_recving or ()),
            finished_sending=set(merged_kv.finished_sending or ()),
            invalid_block_ids=set(merged_kv.invalid_block_ids),
            preempted=set(out.preempted_req_ids or ()),
        )  # fmt: skip
        meta = out.kv_connector_metadata
        if meta is not None:
            record.flushed = set(meta.inner.flush_req_ids)
            record.delayed = set(meta.delayed_req_ids)
        results = self.scheduler.update_from_output(out, merged)
        for client_out in results.values():
            for o in client_out.outputs:
                self.outputs[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    record.finished.add(o.request_id)
        record.waiting_for_kv = {
            r.request_id for r in self.scheduler.requests.values()
            if r.status.name == "WAITING_FOR_REMOTE_KVS"
        }  # fmt: skip
        self.history.append(record)
        return record

    def _worker_pass(self, out: Any, computed: dict[str, int]) -> KVConnectorOutput | None:
        worker = self.worker
        if worker is None:
            self._forward(out, computed)
            return None
        meta = out.kv_connector_metadata
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        self._forward(out, computed)
        worker.start_load_kv(None)  # async loads start after the forward launch, as vLLM does
        if not self.defer_finalize:
            worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )  # fmt: skip
        if self.defer_finalize:
            worker.wait_for_save()
        worker.clear_connector_metadata()
        half = worker.worker_half
        assert half is not None
        early = {r for r in results.finished_sending if half.stores_pending(r)}
        assert not early, f"{early} reported finished sending while their stores are queued"
        return kv_out

    def _forward(self, out: Any, computed: dict[str, int]) -> None:
        """Attention-shaped: check every earlier position's KV, then write the new ones."""
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tokens = list(request.all_token_ids)
            start = computed[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            ref = reference_kv(tokens[: start + n])
            if start:
                got = self.read_kv(blocks, start)
                bad = (got != ref[:start]).flatten(1).any(1).nonzero().flatten().tolist()
                assert not bad, f"{req_id}: wrong KV at positions {bad[:8]} (of {start})"
            self.write_kv(blocks, start, ref[start : start + n])

    def read_kv(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        pos = torch.arange(num_tokens)
        bids = torch.tensor(blocks, dtype=torch.int64)[pos // self.block_size]
        slots = pos % self.block_size
        if self.blocks_first:
            layers = [cache[bids, :, slots] for cache in self.kv_caches.values()]  # (n, 2, h, d)
            return torch.stack(layers, dim=1)  # (n, layers, 2, h, d)
        layers = [cache[:, bids, slots] for cache in self.kv_caches.values()]  # (2, n, h, d)
        return torch.stack(layers).permute(2, 0, 1, 3, 4)

    def write_kv(self, blocks: list[int], start: int, values: torch.Tensor) -> None:
        pos = torch.arange(start, start + values.shape[0])
        bids = torch.tensor(blocks, dtype=torch.int64)[pos // self.block_size]
        slots = pos % self.block_size
        for i, cache in enumerate(self.kv_caches.values()):
            if self.blocks_first:
                cache[bids, :, slots] = values[:, i]
            else:
                cache[:, bids, slots] = values[:, i].permute(1, 0, 2, 3)

    # ------------------------------------------------------------------ driving

    def run(self, max_steps: int = 2000) -> list[StepRecord]:
        """Step until vLLM has nothing left (finished requests holding blocks included). A
        step that scheduled nothing waits for the worker's transfers in flight before the next
        one, as an idle engine would block on them rather than spin."""
        records = []
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return records
            record = self.step()
            records.append(record)
            if not record.scheduled and self.worker is not None:
                assert self.worker.worker_half is not None
                self.worker.worker_half.wait_inflight()
        raise AssertionError(f"not done after {max_steps} steps")

    def run_requests(
        self, prompts: Iterable[tuple[str, list[int]]], max_tokens: int = 4
    ) -> dict[str, list[int]]:
        for req_id, prompt in prompts:
            self.add(req_id, prompt, max_tokens)
        self.run()
        return self.outputs

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
