"""A real synthetic worker process (``python -m scheduler.synthetic``) fed hostile step
messages by a raw DEALER holding its token: each gets one ``error`` reply and the worker
serves on (a hello, then a step of its scheduler, answered exactly); and a real scheduler's
front door refusing what would fail its workers' step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq

from kvserver.crypto import apply_token
from kvserver.token_file import token_path
from scheduler.synthetic import VOCAB_SIZE, next_token
from step_protocol import (
    KIND_ERROR,
    KIND_HELLO,
    KIND_RESULT,
    KIND_STEP,
    NewRequestData,
    StepPlan,
    WorkerHello,
    decode,
    encode_body,
)
from tests.scheduler.builders import expected_output, tokens
from tests.scheduler.procs import EngineClient, Proc, output_tokens, start_scheduler, start_worker

pytestmark = pytest.mark.multiprocess

HELLO = {**WorkerHello(0, 1, 16, 64, "synthetic").to_wire(), "seq": -1}


class Peer:
    """A raw DEALER to ``worker`` with the token it left for this user."""

    def __init__(self, worker: Proc) -> None:
        endpoint = worker.info["endpoint"]
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        apply_token(self.sock, Path(token_path(int(endpoint.rsplit(":", 1)[1]))).read_text())
        self.sock.connect(endpoint)

    def call(self, *frames: bytes) -> tuple[str, dict[str, Any]]:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(20_000), "the worker did not answer"
        return decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[Proc, Peer]]:
    worker = start_worker(tmp_path, "w")
    peer = Peer(worker)
    try:
        yield worker, peer
    finally:
        peer.close()
        worker.kill()


def plan(step: int, computed: int, scheduled: int = 3, blocks: Any = (1,)) -> dict[str, Any]:
    new = NewRequestData("A", [5, 6, 7], list(blocks), computed, 4)
    return StepPlan(step, new_reqs=[new], num_scheduled_tokens={"A": scheduled}).to_wire()


def assert_served(worker: Proc, peer: Peer) -> None:
    """The worker process lives and answers a hello and a valid step exactly."""
    assert worker.proc.poll() is None, worker.log()
    kind, body = peer.call(encode_body(KIND_HELLO, HELLO))
    assert kind == KIND_HELLO and body["seq"] == -1
    kind, body = peer.call(encode_body(KIND_STEP, plan(9, 0)))
    assert kind == KIND_RESULT and body["sampled"] == {"A": next_token(7, 3, 0, VOCAB_SIZE)}


def test_negative_and_out_of_range_fields_are_errors(peer: tuple[Proc, Peer]) -> None:
    """A new request at position -5 with 3 tokens scheduled made the synthetic worker index
    its empty token list at -1: an IndexError ended the worker process."""
    worker, p = peer
    assert p.call(encode_body(KIND_HELLO, HELLO))[0] == KIND_HELLO
    empty = StepPlan(
        2, new_reqs=[NewRequestData("A", [], [1], -3, 4)], num_scheduled_tokens={"A": 3}
    ).to_wire()
    for body, match in (
        (empty, "num_computed_tokens must be at least 0"),
        (plan(3, -5), "num_computed_tokens must be at least 0"),
        (plan(4, 0, scheduled=-1), "num_scheduled_tokens must be at least 1"),
        (plan(5, 0, blocks=[-1]), "block_ids must hold integers >= 0"),
    ):
        kind, reply = p.call(encode_body(KIND_STEP, body))
        assert kind == KIND_ERROR and match in reply["message"], reply
        assert reply["step"] == body["step"]
    for field, value in (("block_size", 0), ("num_gpu_blocks", -1), ("world_size", 0)):
        kind, reply = p.call(encode_body(KIND_HELLO, {**HELLO, field: value}))
        assert kind == KIND_ERROR and f"{field} must be at least" in reply["message"]
    assert_served(worker, p)


def test_malformed_messages_are_answered(peer: tuple[Proc, Peer]) -> None:
    """Undecodable bytes, a wrong version, extra frames (dropped unanswered before: the
    sender waited for its timeout), an unknown kind, a hello seq that is not an integer."""
    worker, p = peer
    seq_map = encode_body(KIND_HELLO, {**HELLO, "seq": {"x": 1}, "rank": "0"})
    for frames, match in (
        ((b"\xc1",), "undecodable step message"),
        ((b"\x82\xa1v\x02\xa4kind\xa4step",), "version mismatch"),
        ((encode_body(KIND_HELLO, HELLO), b"extra"), "one frame, not 2"),
        ((encode_body("nonsense", {}),), "unknown message kind"),
        ((seq_map,), "rank must be int"),
    ):
        kind, reply = p.call(*frames)
        assert kind == KIND_ERROR and match in reply["message"], reply
    assert_served(worker, p)


def peak_rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def test_a_message_of_a_million_frames_is_answered_without_keeping_its_frames(
    peer: tuple[Proc, Peer],
) -> None:
    """1.5M two-byte frames after a hello: ``recv_multipart`` made a ``bytes`` of each, and
    the worker's peak RSS grew by ~170 MB (ZMQ's own queue of the message, ~60 B a frame, is
    the ~90 MB left: only the handshake bounds that); now frames past the second are dropped
    as they are received."""
    worker, p = peer
    assert p.call(encode_body(KIND_HELLO, HELLO))[0] == KIND_HELLO
    before = peak_rss_mib(worker.proc.pid)
    kind, reply = p.call(encode_body(KIND_HELLO, HELLO), *([b"xy"] * 1_500_000))
    assert kind == KIND_ERROR and "one frame, not 1500001" in reply["message"], reply
    assert peak_rss_mib(worker.proc.pid) - before < 130
    assert_served(worker, p)


def test_a_prompt_token_outside_the_vocabulary_is_refused_at_the_front_door(
    tmp_path: Path,
) -> None:
    """A token id past the workers' vocabulary reached their model, whose embedding raised
    IndexError: the step failed, and with it every request in flight. Now INVALID_ARGUMENT
    at submit, while another client's generation runs on exactly."""
    worker = start_worker(tmp_path, "w")
    sched = start_scheduler(tmp_path, "--workers", worker.info["endpoint"], "--num-gpu-blocks",
                            "64")  # fmt: skip
    try:
        prompt = tokens(30, 11)
        with EngineClient(sched.info["grpc_port"]) as client:
            running = client.stream(prompt, 24)
            first = next(running)
            with pytest.raises(grpc.RpcError) as refused:
                client.generate([5, VOCAB_SIZE, 7], 4)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "outside the model's vocabulary" in str(refused.value.details())
            assert output_tokens([first, *running]) == expected_output(prompt, 24)
            assert output_tokens(client.generate([5, VOCAB_SIZE - 1], 4)) == expected_output(
                [5, VOCAB_SIZE - 1], 4
            )
    finally:
        assert sched.terminate() == 0, sched.log()
        worker.kill()
