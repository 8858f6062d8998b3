"""End to end: a real kvserver daemon, a real scheduler process and two real tensor-parallel
worker processes running the tiny transformer (worker/model.py) on CPU.

A multi-turn conversation workload (each turn's prompt = previous prompt + previous output +
new user tokens) over a GPU block pool too small to keep earlier turns: later turns load their
prefix from kvserver, and the generated tokens are those of a run with every cache off.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvserver.client import KVClient
from kvserver.hashing import BlockHasher
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler
from tests.support.cluster import start_tp_workers
from tests.support.connector import PATIENT_ARGS
from tests.support.daemon import start_daemon

pytestmark = pytest.mark.multiprocess
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 10  # 9 usable blocks (144 tokens): one conversation's turn evicts the other's
TURNS, FIRST, USER, MAX_TOKENS = 3, 48, 24, 8


def _conversations(n: int) -> list[list[int]]:
    """First prompts; the later user turns come from the same generator in the run."""
    rng = random.Random(1)
    return [[rng.randrange(512) for _ in range(FIRST)] for _ in range(n)]


def _run(port: int) -> tuple[list[list[int]], list[int]]:
    """Two conversations, turns interleaved; returns every turn's output and, per turn, the
    prompt tokens served from kvserver."""
    rng = random.Random(2)
    prompts = _conversations(2)
    outputs: list[list[int]] = []
    from_kvserver: list[int] = []
    with EngineClient(port) as c:
        for _turn in range(TURNS):
            for conv in range(2):
                msgs = c.generate(prompts[conv], MAX_TOKENS)
                out = output_tokens(msgs)
                usage = msgs[0].usage
                total = usage.gpu_cached_tokens + usage.kvserver_tokens + usage.computed_tokens
                assert total == len(prompts[conv]), usage
                outputs.append(out)
                from_kvserver.append(usage.kvserver_tokens)
                prompts[conv] = prompts[conv] + out + [rng.randrange(512) for _ in range(USER)]
    return outputs, from_kvserver


@pytest.mark.parametrize(
    ("device", "world"),
    [
        pytest.param("cpu", 2, id="cpu-tp2"),
        # one rank: the GPU machines we are lent have one GPU, and NCCL refuses two ranks on one
        pytest.param("cuda", 1, id="cuda-tp1", marks=[gpu, needs_cuda]),
    ],
)
def test_multi_turn_conversations_load_their_prefix_from_kvserver(
    tmp_path: Path, device: str, world: int
) -> None:
    """CUDA: the workers' KV caches are on the GPU, the daemon's arena is page-locked in the
    worker (cudaHostRegister) and stores/loads run on the transfer engine's CUDA streams; the
    tokens must still equal the cache-off run's."""
    daemon = start_daemon(tmp_path / "daemon", "--dram", "16MiB")
    workers: list[Proc] = []
    try:
        workers = start_tp_workers(tmp_path, daemon.zmq_address, world=world, device=device)
        addrs = ",".join(w.info["endpoint"] for w in workers)
        common = ["--workers", addrs, "--num-gpu-blocks", str(NUM_GPU_BLOCKS),
                  "--block-size", str(BLOCK_SIZE), "--model", "tiny-e2e"]  # fmt: skip
        off = start_scheduler(tmp_path, *common, "--no-prefix-caching")
        try:
            want, loaded_off = _run(off.info["grpc_port"])
            assert off.terminate() == 0, off.log()
        finally:
            off.kill()
        assert loaded_off == [0] * len(want)
        assert all(len(o) == MAX_TOKENS for o in want) and len({tuple(o) for o in want}) > 1

        on = start_scheduler(
            tmp_path, *common, "--kvserver", daemon.zmq_address, *PATIENT_ARGS,
            "--chunk-blocks", "1",
        )  # fmt: skip
        try:
            got, loaded = _run(on.info["grpc_port"])
            assert on.terminate() == 0, on.log()
        finally:
            on.kill()
        assert got == want
        assert loaded[:2] == [0, 0]  # first turns: nothing stored yet
        assert sum(loaded[2:]) > 0, loaded  # later turns: prefix KV from kvserver
        for w in workers:
            assert w.terminate() == 0, w.log()
    finally:
        for w in workers:
            w.kill()
        daemon.kill()


def _tp_kv(model_file: Path, tokens: list[int], world: int = 2) -> list[list[torch.Tensor]]:
    """Offline recompute of the KV a ``world``-rank TP group writes for ``tokens`` (no cache, one
    pass): the rank shards run in lockstep in this process and the all-reduce is the sum of
    their partial outputs. Returns per rank, per layer, ``(2, T, kv_heads_per_rank, head_dim)``."""
    from worker.model import load_model

    shards = [load_model(model_file, rank=r, world_size=world) for r in range(world)]
    m0 = shards[0]
    kv: list[list[torch.Tensor]] = [[] for _ in shards]
    with torch.inference_mode():
        pos = torch.arange(len(tokens))
        x = m0.embed[torch.tensor(tokens, dtype=torch.long)]
        for i in range(m0.config.num_layers):
            attn = []
            for r, m in enumerate(shards):
                layer = m.layers[i]
                q, k, v = m._qkv(layer, x, pos)
                kv[r].append(torch.stack([k, v]))
                attn.append(m._attend(q, k, v, 0) @ layer.wo.t())
            x = x + sum(attn[1:], attn[0])
            h = m0._rms(x, m0.layers[i].mlp_norm)
            mlp = []
            for m in shards:
                layer = m.layers[i]
                g = torch.nn.functional.silu(h @ layer.w_gate.t()) * (h @ layer.w_up.t())
                mlp.append(g @ layer.w_down.t())
            x = x + sum(mlp[1:], mlp[0])
    return kv


def _part(kv: list[torch.Tensor], block: int) -> torch.Tensor:
    """One rank's part of a one-block chunk in the documented byte layout (docs/worker.md):
    layers in order, K page then V page, each page ``(block_size, kv_heads, head_dim)``."""
    sl = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
    pages = [layer[kv_i, sl].contiguous().view(-1) for layer in kv for kv_i in (0, 1)]
    return torch.cat(pages)


def test_loaded_kv_bytes_equal_what_the_model_computes(tmp_path: Path) -> None:
    """After a kvserver run, every stored chunk of the conversations is read back from the
    daemon and compared, per TP rank, with the KV recomputed offline by the same model: byte
    for byte. K and V of a position depend only on that token's row through row-wise ops
    (embedding, RMSNorm, projections, RoPE) and on the attention output of earlier layers; on
    this CPU backend the run (prefill in chunks, prefix attended through the paged cache,
    batches of one or two requests) and the one-pass reference give identical float32 bits.
    A wrong key, rank, layer, block or K/V order would differ by O(1)."""
    daemon = start_daemon(tmp_path / "daemon", "--dram", "16MiB")
    workers: list[Proc] = []
    try:
        workers = start_tp_workers(tmp_path, daemon.zmq_address)
        addrs = ",".join(w.info["endpoint"] for w in workers)
        on = start_scheduler(
            tmp_path, "--workers", addrs, "--num-gpu-blocks", str(NUM_GPU_BLOCKS),
            "--block-size", str(BLOCK_SIZE), "--model", "tiny-e2e",
            "--kvserver", daemon.zmq_address, *PATIENT_ARGS, "--chunk-blocks", "1",
        )  # fmt: skip
        try:
            outputs, loaded = _run(on.info["grpc_port"])
            assert on.terminate() == 0, on.log()  # drains: every completion is applied
        finally:
            on.kill()
        assert sum(loaded) > 0
        # the conversations' final token sequences (the turns' prompts replayed as in _run)
        rng = random.Random(2)
        prompts = _conversations(2)
        finals: list[list[int]] = [[], []]
        for turn in range(TURNS):
            for conv in range(2):
                out = outputs[turn * 2 + conv]
                finals[conv] = prompts[conv] + out
                prompts[conv] = finals[conv] + [rng.randrange(512) for _ in range(USER)]

        with KVClient(daemon.zmq_address) as kv:
            specs = [s for s in kv.namespaces() if s.model == "tiny-e2e"]
            assert len(specs) == 1, specs
            spec = specs[0]
            hasher = BlockHasher(spec.hash_algo, spec.block_size, spec.hash_seed)
            compared = 0
            for tokens in finals:
                keys = hasher.chunk_keys(hasher.hash_blocks(tokens), spec.chunk_blocks)
                # the last output token's KV is never computed: its block is not stored
                computed_blocks = (len(tokens) - 1) // BLOCK_SIZE
                found = kv.lookup(spec.ns_id, keys[:computed_blocks]).hit_chunks
                # every chunk of the last prompt is stored (its last block may still be partial)
                assert found >= (len(tokens) - MAX_TOKENS) // BLOCK_SIZE, (found, len(keys))
                parts = kv.get(spec.ns_id, keys[:found], ranks=[0, 1])
                ref = _tp_kv(tmp_path / "model.safetensors", tokens)
                for block, per_rank in enumerate(parts):
                    for rank, part in enumerate(per_rank):
                        assert len(part) == spec.part_bytes
                        want = _part(ref[rank], block)
                        if bytes(part) != want.numpy().tobytes():
                            got = torch.frombuffer(bytearray(part), dtype=torch.float32)
                            diff = (got - want).abs().max().item()
                            raise AssertionError(f"block {block} rank {rank}: max |diff| {diff}")
                        compared += 1
            assert compared >= 2 * 2 * 6
        for w in workers:
            assert w.terminate() == 0, w.log()
    finally:
        for w in workers:
            w.kill()
        daemon.kill()
