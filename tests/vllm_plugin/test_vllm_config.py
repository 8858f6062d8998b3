"""The plug-in's configuration and its agreement with vLLM's hashing (no daemon needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.vllm_env import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

from kvserver.crypto import load_curve_keys, make_curve_keys  # noqa: E402
from kvserver.errors import InvalidArgument  # noqa: E402
from kvserver.hashing import BlockHasher  # noqa: E402
from kvserver.token_file import make_token_file, read_token_file  # noqa: E402
from kvserver_vllm.config import load_config  # noqa: E402
from kvserver_vllm.connector import KVServerConnector  # noqa: E402
from tests.vllm_plugin.harness import (  # noqa: E402
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    make_kv_cache_config,
    make_vllm_config,
    write_tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model"))


def load(model_dir: Path, **extra: Any) -> Any:
    config = make_vllm_config(model_dir, extra)
    return load_config(config, make_kv_cache_config(config, 32))


def test_namespace_follows_the_model_and_vllm_settings(model_dir: Path) -> None:
    cfg = load(model_dir, address="tcp://10.0.0.1:7070", chunk_blocks=4, lease_s=30)
    spec = cfg.spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (
        NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE,
    )  # fmt: skip
    assert (spec.dtype, spec.block_size, spec.chunk_blocks) == ("float16", 16, 4)
    assert (spec.hash_algo, spec.hash_seed, spec.tp_world_size) == ("sha256", "vllm-none-hash", 1)
    assert spec.model == str(model_dir)
    # a part is exactly this rank's pages of the chunk's blocks, every layer
    assert spec.part_bytes == 2 * NUM_KV_HEADS * HEAD_SIZE * 16 * 2 * NUM_LAYERS * 4
    assert cfg.scheduler.address == "tcp://10.0.0.1:7070" and cfg.scheduler.lease_s == 30.0
    assert load(model_dir, model_id="llama-tiny").spec.model == "llama-tiny"


def test_both_roles_agree_on_the_namespace(model_dir: Path) -> None:
    config = make_vllm_config(model_dir, {"address": "tcp://127.0.0.1:1"})
    kv_cache = make_kv_cache_config(config, 32)
    sched = KVServerConnector(config, KVConnectorRole.SCHEDULER, kv_cache)
    worker = KVServerConnector(config, KVConnectorRole.WORKER, kv_cache)
    try:
        assert sched.scheduler_half is not None and worker.worker_half is not None
        assert sched.scheduler_half.ns_id == worker.worker_half.spec.ns_id
    finally:
        sched.shutdown()
        worker.shutdown()


def test_each_instance_holds_the_bookkeeping_of_its_own_role_only(model_dir: Path) -> None:
    """As in vLLM's OffloadingConnector: the scheduler instance has a scheduler role and no
    worker role, a worker instance the reverse, and a method of the other role is refused."""
    config = make_vllm_config(model_dir, {"address": "tcp://127.0.0.1:1"})
    kv_cache = make_kv_cache_config(config, 32)
    sched = KVServerConnector(config, KVConnectorRole.SCHEDULER, kv_cache)
    worker = KVServerConnector(config, KVConnectorRole.WORKER, kv_cache)
    try:
        assert sched.connector_scheduler is not None and sched.connector_worker is None
        assert worker.connector_worker is not None and worker.connector_scheduler is None
        assert sched.worker_half is None and worker.scheduler_half is None
        with pytest.raises(AssertionError, match="worker-side method on the scheduler"):
            sched.get_block_ids_with_load_errors()
        with pytest.raises(AssertionError, match="scheduler-side method on a worker"):
            worker.has_pending_block_frees()
    finally:
        sched.shutdown()
        worker.shutdown()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"adress": "tcp://x:1"}, "unknown kv_connector_extra_config keys: adress"),
        ({"chunk_blocks": "16"}, "chunk_blocks has the wrong type"),
        ({"chunk_blocks": True}, "chunk_blocks has the wrong type"),
        ({"chunk_blocks": 0}, "chunk_blocks must be >= 1"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s must be > 0"),
        ({"op_timeout_s": "fast"}, "op_timeout_s has the wrong type"),
        ({"lease_s": "long"}, "lease_s must be a number or null"),
        ({"colocated": "yes"}, "colocated must be true, false or null"),
        ({"host_kernels": 1}, "host_kernels must be true or false"),
        ({"address": 7070}, "address has the wrong type"),
        ({"address": "tcp://10.0.0.1"}, r"address: bad daemon address 'tcp://10.0.0.1': no port"),
        ({"address": "tcp://h:99999"}, "address: bad daemon address 'tcp://h:99999': port"),
        ({"address": "inproc://kv"}, "address: bad daemon address 'inproc://kv': inproc://"),
        ({"curve_server_key_file": 5}, "curve_server_key_file has the wrong type"),
        ({"curve_secret_key_file": "/k"}, "curve_secret_key_file needs curve_server_key_file"),
        ({"curve_server_key_file": "/absent/server.key"}, "cannot read CURVE key file /absent"),
        ({"tls_ca_file": "/ca.crt"}, "unknown kv_connector_extra_config keys: tls_ca_file"),
        ({"auth_token_file": "/absent/auth.token"}, "auth_token_file: cannot read token file"),
    ],
)
def test_bad_extra_config_is_a_clear_error(model_dir: Path, extra: Any, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        load(model_dir, **extra)


def test_random_per_process_hash_seed_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = make_vllm_config(model_dir, {})
    config.cache_config.prefix_caching_hash_algo = "xxhash_cbor"
    with pytest.raises(InvalidArgument, match="PYTHONHASHSEED"):
        load_config(config, make_kv_cache_config(config, 32))
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    spec = load_config(config, make_kv_cache_config(config, 32)).spec
    assert (spec.hash_algo, spec.hash_seed) == ("xxhash_cbor", "1234")
    config.cache_config.prefix_caching_hash_algo = "xxhash"  # pickle + xxh3: not ours
    with pytest.raises(InvalidArgument, match="not supported"):
        load_config(config, make_kv_cache_config(config, 32))


def test_hybrid_kv_cache_groups_are_refused(model_dir: Path) -> None:
    config = make_vllm_config(model_dir, {})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    two = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["b"], spec)],
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match="one KV cache group"):
        load_config(config, two)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash_cbor"])
def test_block_hashes_agree_with_vllm_including_lora_and_cache_salt(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.33 tags its extra keys ("lora", name, path) and ("cache_salt", salt), as our
    vectors do: kvserver and a vLLM replica compute the same key for every block."""
    monkeypatch.setenv("PYTHONHASHSEED", "shared-seed")
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    tokens = [(i * 7919) % 50_000 for i in range(16 * 5 + 3)]
    cases: list[tuple[LoRARequest | None, str | None]] = [
        (None, None),
        (LoRARequest("adapter-a", 1, "/adapters/a"), None),
        (None, "tenant-7"),
        (LoRARequest("adapter-b", 2, "/adapters/b"), "tenant-7"),
    ]
    ours = BlockHasher(algo, 16, "shared-seed")
    for lora, salt in cases:
        request = Request(
            request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(),
            pooling_params=None, lora_request=lora, cache_salt=salt,
            block_hasher=get_request_block_hasher(16, hash_fn),
        )  # fmt: skip
        expected = [bytes(h) for h in request.block_hashes]
        got = ours.hash_blocks(
            tokens, cache_salt=salt,
            lora=None if lora is None else (lora.lora_name, lora.lora_path),
        )  # fmt: skip
        assert [bytes(h) for h in got] == expected, (lora, salt)
        assert len(expected) == 5


def test_curve_keys_reach_both_halves(model_dir: Path, tmp_path: Path) -> None:
    """The CURVE options of docs/security.md: the daemon's public key and the engine's pair,
    read from files once, used by the scheduler half and every worker rank."""
    server_key, _ = make_curve_keys(str(tmp_path), "server")
    engine_key, engine_secret = make_curve_keys(str(tmp_path), "engine")
    cfg = load(model_dir, curve_server_key_file=server_key, curve_secret_key_file=engine_secret)
    curve = cfg.scheduler.curve
    assert curve is not None and cfg.worker(0).curve == curve == cfg.curve
    assert curve.server_key == load_curve_keys(server_key)[0]
    assert curve.public_key == load_curve_keys(engine_key)[0]
    assert load(model_dir).scheduler.curve is None and load(model_dir).worker(0).curve is None


def test_a_token_file_reaches_both_halves(model_dir: Path, tmp_path: Path) -> None:
    """``auth_token_file`` (docs/security.md, "Client options"): read once, wins over
    ``auth_token``."""
    path = make_token_file(str(tmp_path))
    cfg = load(model_dir, auth_token="ignored-token-0123456789", auth_token_file=path)
    assert cfg.scheduler.auth_token == cfg.worker(0).auth_token == read_token_file(path)


def test_host_kernels_reach_every_worker_rank(model_dir: Path) -> None:
    """``host_kernels`` (docs/worker.md, "Copies") is on unless turned off, for every rank."""
    assert load(model_dir).worker(0).host_kernels is True
    cfg = load(model_dir, host_kernels=False)
    assert cfg.worker(0).host_kernels is False and cfg.host_kernels is False
