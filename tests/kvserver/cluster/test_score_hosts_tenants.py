"""``ScoreHosts`` for tenants (docs/security.md, "Tenants"), on a real fleet daemon (real
Redis) with a config file: a tenant may score only prompts of its own models, hashed with
its own cache_salt, another model's namespace answered as one registered nowhere; the
read-only router token scores any model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver.client import KVClient
from kvserver.cluster.rpc import call_score_hosts
from kvserver.errors import PermissionDenied, UnknownNamespace
from kvserver.grpc_client import GrpcClient
from tests.kvserver.builders import make_keys, make_spec, pattern
from tests.support.daemon import start_daemon, wait_until
from tests.support.redis import RedisServer

pytestmark = pytest.mark.multiprocess

SPEC_A = make_spec(model="model-a")
TOKEN_A = "score-token-of-team-a-0123"
TOKEN_B = "score-token-of-team-b-0123"
TOKEN_ROUTER = "score-token-of-router-0123"
CONFIG = f"""
[[tenants]]
name = "team-a"
token = "{TOKEN_A}"
models = ["model-a"]
cache_salts = ["salt-a"]

[[tenants]]
name = "team-b"
token = "{TOKEN_B}"
models = ["model-b"]

[[tenants]]
name = "router"
token = "{TOKEN_ROUTER}"
models = ["*"]
read_only = true
"""


def test_score_hosts_is_limited_to_the_tenants_namespaces(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = tmp_path / "kvserver.toml"
    config.write_text(CONFIG)
    d = start_daemon(
        tmp_path / "d", "--config", str(config), "--dram", "4MiB", "--page-size", "4KiB",
        "--cluster", redis_server.url, "--host-id", "h1", "--cluster-timeout-s", "5",
    )  # fmt: skip
    try:
        keys = make_keys(3, tag="score-tenant")
        with KVClient(d.zmq_address, auth_token=TOKEN_A, colocated=False) as a:
            ns = a.register_namespace(SPEC_A).ns_id
            parts = [[pattern(k, 0, SPEC_A.part_bytes)] for k in keys]
            assert a.store(ns, keys, parts) == keys
        prompt = list(range(SPEC_A.chunk_tokens * 2))
        with GrpcClient(d.grpc_address, auth_token=TOKEN_ROUTER) as router:
            wait_until(
                lambda: [h.hit_chunks for h in call_score_hosts(router, ns, keys=keys)] == [3],
                timeout=10.0,
            )
            assert call_score_hosts(router, ns, token_ids=prompt, cache_salt="any")
        with GrpcClient(d.grpc_address, auth_token=TOKEN_B) as b:
            answers = []
            for ns_asked in (ns, make_spec(model="model-b", block_size=8).ns_id):
                with pytest.raises(UnknownNamespace) as hidden:
                    call_score_hosts(b, ns_asked, keys=keys)
                answers.append(str(hidden.value).replace(ns_asked, "<ns>"))
            assert answers[0] == answers[1]  # B cannot tell A's namespace exists
        with GrpcClient(d.grpc_address, auth_token=TOKEN_A) as ga:
            assert [h.hit_chunks for h in call_score_hosts(ga, ns, keys=keys)] == [3]
            assert call_score_hosts(ga, ns, token_ids=prompt, cache_salt="salt-a")
            with pytest.raises(PermissionDenied):
                call_score_hosts(ga, ns, token_ids=prompt, cache_salt="salt-b")
    finally:
        assert d.terminate() == 0
