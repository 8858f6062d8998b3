"""How large a step-channel message may be, each way: the bound each end sets on its socket.

ZMQ ``MAXMSGSIZE`` on a socket bounds each frame it receives: a peer that announces a longer
one (a buggy or compromised scheduler or worker the handshake admitted) has its connection
dropped at the frame's length prefix, before anything is allocated for it. A step message is
one frame either way, so this bounds every message.

- The scheduler's DEALERs take replies up to :func:`reply_limit` of its settings (a generous
  multiple of the largest reply they can legitimately carry, :func:`reply_bytes_bound`, and
  never below :data:`FLOOR_BYTES`), or ``--step-max-message-mib``.
- A worker's ROUTER takes plans up to :data:`DEFAULT_WORKER_LIMIT_BYTES`, or its
  ``--step-max-message-mib``: a worker does not know its scheduler's batch settings before
  the scheduler connects, so it cannot derive one. It tells its limit in its ``hello``
  (``WorkerInfo.max_message_bytes``); the scheduler warns at hello when the largest plan its
  settings allow (:func:`plan_bytes_bound`) is over it, and fails a step whose plan is over it
  without sending it (docs/scheduler.md, "Step channel limits").

The bounds count msgpack's widest encoding of every field (9 bytes an integer, a request id
of 256 characters as 1 KiB), so they are above any real message of those settings.
Stateless.
"""

from __future__ import annotations

import argparse

from kvserver.errors import InvalidArgument

MIB = 1 << 20
#: no derived limit is below this
FLOOR_BYTES = 64 * MIB
#: the derived limit is this many times the largest legitimate message
MARGIN = 4
#: a worker's limit on the plans it takes, unless ``--step-max-message-mib``
DEFAULT_WORKER_LIMIT_BYTES = 256 * MIB
#: the smallest limit either option takes (a hello and an empty step fit it many times)
LEAST_BYTES = 4096

_INT = 9  # msgpack's widest integer
_REQ_ID = 1024 + 16  # a request id (256 characters, UTF-8) and its framing
_CHUNK = 64 + 16  # a chunk key (a hash) and its framing
_EXTENT = 2 * _INT + 4  # one (offset, length) of one rank's part


def plan_bytes_bound(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    model_len: int,
    num_gpu_blocks: int,
    world_size: int = 1,
) -> int:
    """The largest StepPlan (encoded) a scheduler of these settings can send. Its requests
    (new, cached, finished, preempted: each list at most ``max_num_seqs``); a new request's
    whole prompt and output (at most ``model_len`` tokens; a resumed one's too); the cached
    requests' tokens (at most ``max_num_batched_tokens``); every GPU block id once in the
    block tables and once in failed loads; and per block a chunk load and a chunk store
    with its key and up to four extents per rank."""
    requests = 4 * max_num_seqs * (_REQ_ID + 8 * _INT)
    tokens = max_num_seqs * model_len * _INT + max_num_batched_tokens * _INT
    blocks = num_gpu_blocks * (2 * _INT + 2 * (_CHUNK + _INT + 4 * world_size * _EXTENT))
    return requests + tokens + blocks + 4096


def reply_bytes_bound(*, max_num_seqs: int, num_gpu_blocks: int) -> int:
    """The largest StepResult (encoded) a worker can send a scheduler of these settings: a
    sampled token per running request, and its connector's finished transfers (a load and a
    store result per request, a failed key per GPU block each)."""
    sampled = max_num_seqs * (_REQ_ID + _INT)
    transfers = 2 * max_num_seqs * (_REQ_ID + 2 * _INT) + 2 * num_gpu_blocks * _CHUNK
    return sampled + transfers + 4096


def derived_limit(bound: int) -> int:
    """``MARGIN`` times ``bound``, at least ``FLOOR_BYTES``."""
    return max(FLOOR_BYTES, MARGIN * bound)


def mib(n: int) -> str:
    """``n`` bytes in MiB, as the option takes it (under 1 MiB: in bytes)."""
    return f"{n / MIB:.6g} MiB" if n >= MIB else f"{n} bytes"


def limit_bytes(value_mib: float, name: str = "step_max_message_mib") -> int:
    """The option's MiB as bytes; InvalidArgument naming it when not a number of at least
    ``LEAST_BYTES`` bytes."""
    if not isinstance(value_mib, int | float) or isinstance(value_mib, bool):
        raise InvalidArgument(f"{name} must be a number of MiB", got=value_mib)
    if not value_mib * MIB >= LEAST_BYTES:  # NaN fails too
        raise InvalidArgument(f"{name} must be at least {LEAST_BYTES / MIB:g}", got=value_mib)
    if value_mib * MIB >= 1 << 62:
        raise InvalidArgument(f"{name} is too large", got=value_mib)
    return int(value_mib * MIB)


def add_limit_arg(parser: argparse.ArgumentParser, *, scheduler: bool) -> None:
    """``--step-max-message-mib`` on a scheduler's or a worker's command line (0: the
    default)."""
    default = (
        f"{MARGIN} times the largest reply these batch settings allow, at least {mib(FLOOR_BYTES)}"
        if scheduler
        else mib(DEFAULT_WORKER_LIMIT_BYTES)
    )
    what = "a worker's reply" if scheduler else "a step plan"
    parser.add_argument(
        "--step-max-message-mib", type=float, default=0.0, metavar="MIB",
        help=f"the largest {what} taken on the step channel; ZMQ drops the connection of a "
        f"longer one unread (default: {default})",
    )  # fmt: skip


def worker_limit(args: argparse.Namespace) -> int:
    """A worker's limit in bytes from its parsed ``--step-max-message-mib`` (0: the
    default); InvalidArgument naming the option."""
    value = getattr(args, "step_max_message_mib", 0.0) or 0.0
    if not value:
        return DEFAULT_WORKER_LIMIT_BYTES
    return limit_bytes(value, "--step-max-message-mib")
