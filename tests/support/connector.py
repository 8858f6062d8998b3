"""Test harness pieces around the scheduler connector, shared by tests/scheduler (no torch) and
tests/worker (real worker connectors): both harnesses keep a connector, the blocks of each
request and the requests already sent to the workers, and allocate blocks their own way."""

from __future__ import annotations

from typing import Any, Protocol

from scheduler.kv_connector import KVServerSchedulerConnector


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
