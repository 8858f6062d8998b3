"""The tiny transformer (worker/model.py): TP=2 over gloo equals TP=1, paged-cache decode
equals a full recompute, weights files are deterministic and validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserver.errors import InvalidArgument
from tests.support.ports import free_port as _free_port
from worker.model import (
    ModelConfig,
    SeqInput,
    generate,
    load_model,
    sample_greedy,
    write_random_model,
)

PROMPT = [7, 300, 12, 45, 99, 1, 256, 17, 33, 480, 2, 5, 60, 61, 62, 200, 3, 9, 11, 4, 100]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    write_random_model(path, ModelConfig(), seed=3)
    return path


def _tp_rank(rank: int, world: int, port: int, model_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        model = load_model(model_file, rank=rank, world_size=world)
        tokens = generate(model, PROMPT, MAX_TOKENS, block_size=4, prefill_chunk=8)
        logits = model.reference_logits(PROMPT + tokens)
        result = {"tokens": tokens, "logits": logits[-1].tolist(), "kv_heads": model.num_kv_heads}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_tp2_generates_the_same_tokens_as_tp1(model_file: Path, tmp_path: Path) -> None:
    single = load_model(model_file)
    want = generate(single, PROMPT, MAX_TOKENS, block_size=4, prefill_chunk=8)
    want_logits = single.reference_logits(PROMPT + want)[-1]
    assert len(set(want)) > 1, want  # a degenerate model would make the comparison weak
    mp.spawn(_tp_rank, args=(2, _free_port(), str(model_file), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["kv_heads"] == 1  # each rank holds its own shard of the 2 KV heads
        assert got["tokens"] == want, rank
        torch.testing.assert_close(torch.tensor(got["logits"]), want_logits, atol=1e-4, rtol=0)


def test_paged_decode_equals_full_recompute(model_file: Path) -> None:
    model = load_model(model_file)
    tokens = generate(model, PROMPT, MAX_TOKENS, block_size=4, prefill_chunk=5)
    ref = model.reference_logits(PROMPT + tokens)
    # every generated token is the argmax of the no-cache logits at the position before it
    assert sample_greedy(ref[len(PROMPT) - 1 : -1]) == tokens
    assert generate(model, PROMPT, MAX_TOKENS, block_size=16) == tokens


def test_forward_reads_kv_from_the_paged_cache(model_file: Path) -> None:
    """Decoding over a cache filled by another "request" (KV copied block by block, as a
    kvserver load does) gives the logits of a full recompute; garbage KV does not."""
    model = load_model(model_file)
    bs, n = 4, len(PROMPT)
    caches = model.allocate_kv_caches(16, bs)
    src, dst = [1, 2, 3, 4, 5, 6], [11, 9, 14, 7, 8, 10]
    model.forward([SeqInput(PROMPT[:-1], 0, src)], caches)
    for c in caches:  # move whole blocks of the first n-1 positions to other block ids
        c[:, dst] = c[:, src]
        c[:, src] = 0
    logits = model.forward([SeqInput(PROMPT[-1:], n - 1, dst)], caches)
    ref = model.reference_logits(PROMPT)[-1]
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=0)
    for c in caches:
        c[:, dst[0]] = torch.randn_like(c[:, dst[0]])
    bad = model.forward([SeqInput(PROMPT[-1:], n - 1, dst)], caches)
    assert not torch.allclose(bad[0], ref, atol=1e-3)


def test_ragged_batch_equals_one_request_at_a_time(model_file: Path) -> None:
    model = load_model(model_file)
    caches = model.allocate_kv_caches(32, 4)
    a, b = PROMPT[:9], PROMPT[5:]
    both = model.forward([SeqInput(a, 0, [1, 2, 3]), SeqInput(b, 0, [4, 5, 6, 7])], caches)
    torch.testing.assert_close(both[0], model.reference_logits(a)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(both[1], model.reference_logits(b)[-1], atol=1e-4, rtol=0)


def test_random_model_files_are_deterministic(tmp_path: Path) -> None:
    cfg = ModelConfig(num_layers=1)
    write_random_model(tmp_path / "a", cfg, seed=5)
    write_random_model(tmp_path / "b", cfg, seed=5)
    write_random_model(tmp_path / "c", cfg, seed=6)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert (tmp_path / "a").read_bytes() != (tmp_path / "c").read_bytes()
    assert load_model(tmp_path / "a").config == cfg


def test_bad_configs_are_refused(model_file: Path) -> None:
    with pytest.raises(InvalidArgument):
        ModelConfig(num_heads=3, num_kv_heads=2)
    with pytest.raises(InvalidArgument, match="divisible"):
        load_model(model_file, rank=0, world_size=4)  # 2 KV heads over 4 ranks
    model = load_model(model_file)
    caches = model.allocate_kv_caches(4, 4)
    with pytest.raises(InvalidArgument, match="block table"):
        model.forward([SeqInput(PROMPT, 0, [1, 2])], caches)
