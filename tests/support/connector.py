"""Test harness pieces around the scheduler connector, shared by tests/scheduler (no torch) and
tests/worker (real worker connectors): both harnesses keep a connector, the blocks of each
request and the requests already sent to the workers, and allocate blocks their own way."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from kvserver.namespace import NamespaceSpec
from scheduler.kv_connector import KVServerSchedulerConnector
from scheduler.kv_connector_types import KVConnectorConfig

#: the connector's bounds in tests whose daemon calls must succeed. The defaults (a lookup
#: answered within 0.1 s, other calls within 1 s) are a scheduler step's budget on a quiet
#: host; a loaded CI machine (load 4-14 on 2 cores) answers a lookup late now and then, which
#: is no hit and marks the daemon down for ``down_backoff_s``, so the hits and stores a test
#: counts go missing (seen at load 12-14, e95698e). Tests of timeouts pass their own bounds,
#: after a patient set-up where they can (:func:`bound`).
PATIENT: dict[str, float] = {"lookup_timeout_s": 10.0, "op_timeout_s": 10.0}
#: :data:`PATIENT` for ``kvserver scheduler --kvserver`` (its connector's bounds)
PATIENT_ARGS = ("--kvserver-lookup-timeout-s", "10", "--kvserver-op-timeout-s", "10")


def patient_config(address: str, spec: NamespaceSpec, **config: Any) -> KVConnectorConfig:
    """``KVConnectorConfig`` with :data:`PATIENT` bounds unless ``config`` names others."""
    return KVConnectorConfig(address, spec, **{**PATIENT, **config})


def bound(conn: KVServerSchedulerConnector, **config: Any) -> None:
    """From now on ``conn``'s daemon calls run under ``config`` (e.g. short timeouts before
    the daemon is stopped), the rest of its configuration unchanged. The bounds live in the
    connector's daemon link, which reads them at every call."""
    conn.config = dataclasses.replace(conn.config, **config)
    conn._link.config = conn.config


class AdmitHarness(Protocol):
    conn: KVServerSchedulerConnector
    blocks: dict[str, list[int]]
    sent: set[str]

    def alloc(self, n: int) -> list[int]: ...


def admit(
    h: AdmitHarness, req: Any, block_size: int, num_local: int = 0, blocks: list[int] | None = None
) -> tuple[int | None, bool]:
    """What a scheduler does to admit ``req`` (``num_local`` tokens already cached on the GPU in
    ``blocks``): get_num_new_matched_tokens, allocation of the whole prompt, then
    update_state_after_alloc; the request is sent to the workers as new at its next step."""
    ext, is_async = h.conn.get_num_new_matched_tokens(req, num_local)
    if ext is None:
        return ext, is_async
    blocks = list(blocks or [])
    blocks += h.alloc(-(-len(req.all_token_ids) // block_size) - len(blocks))
    h.conn.update_state_after_alloc(req, blocks, ext)
    h.blocks[req.request_id] = blocks
    h.sent.discard(req.request_id)
    req.num_computed_tokens = num_local + ext
    return ext, is_async
