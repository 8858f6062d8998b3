"""Synthetic request traces for the eviction-policy benchmark: prefix chains of chunk keys.

Pure functions of a :class:`TraceConfig` (its seed included): the same config gives the same
trace. A trace is a list of requests, each the chain of chunk keys it reads (head first; an
integer per chunk, new keys numbered as they appear). Two arrival models:

- ``uniform`` (the generator of the first published table, kept so its seeds reproduce): a
  fixed number of conversations is live at once and each request picks one of them uniformly
  at random, so a conversation's return is memoryless (geometric, mean ``num_live``
  requests) and nothing but its end distinguishes the live ones;
- ``timed``: conversations start as a Poisson process and each turn comes a log-normal think
  time after the previous one (heavy-tailed, as users answer: most within a minute or two,
  some after hours, the shape reported for chat-service traces), with the start rate chosen
  so that about ``num_live`` conversations are in progress (Little's law); one-off documents
  arrive as their own Poisson process.

In both, turn t re-reads the conversation's whole context (its system prompt and every earlier
turn) and appends 1-16 new chunks; system prompts are shared, with Zipf popularity; documents
are a system prompt followed by hundreds of chunks nobody reads again.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

Trace = list[list[int]]  # requests, each a chain of chunk keys


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Parameters of one synthetic trace (all sizes in chunks)."""

    seed: int = 0
    num_conversations: int = 500
    num_live: int = 128  # conversations interleaved at any moment (sessions of one host)
    num_system_prompts: int = 12
    system_prompt_chunks: tuple[int, int] = (32, 128)
    zipf_s: float = 1.1  # popularity of system prompt i ~ 1 / (i + 1) ** s
    turns: tuple[int, int] = (2, 10)
    turn_chunks: tuple[int, int] = (1, 16)
    doc_probability: float = 0.01  # per request: a one-off document instead of a chat turn
    doc_chunks: tuple[int, int] = (200, 2000)
    #: "uniform": each request picks one of ``num_live`` live conversations uniformly (the
    #: generator of the first table, kept so its seeds reproduce); "timed": conversations
    #: start as a Poisson process and each next turn comes a log-normal think time later
    arrivals: str = "uniform"
    think_median_s: float = 60.0  # "timed": median think time between two turns
    think_sigma: float = 1.5  # "timed": log-normal shape (1.5: 10 % of waits > 6.8x median)


TRACES: dict[str, TraceConfig] = {
    "chat": TraceConfig(),
    "system": TraceConfig(
        num_conversations=2000,
        num_live=64,
        num_system_prompts=48,
        system_prompt_chunks=(16, 96),
        turns=(1, 3),
        doc_probability=0.0,
    ),
    "scan": TraceConfig(doc_probability=0.05),
}


def generate_trace(cfg: TraceConfig) -> Trace:
    """The requests: integer chunk keys, new keys numbered as they appear."""
    if cfg.arrivals == "timed":
        return _generate_timed(cfg)
    if cfg.arrivals != "uniform":
        raise ValueError(f"unknown arrivals {cfg.arrivals!r}: uniform or timed")
    rng = random.Random(cfg.seed)
    requests: Trace = []
    next_key = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_key
        next_key += n
        return list(range(next_key - n, next_key))

    prompts = [fresh(rng.randint(*cfg.system_prompt_chunks)) for _ in range(cfg.num_system_prompts)]
    weights = [1.0 / (i + 1) ** cfg.zipf_s for i in range(cfg.num_system_prompts)]

    def system_prompt() -> list[int]:
        return rng.choices(prompts, weights)[0]

    live: list[tuple[list[int], list[int]]] = []  # (prefix, [turns left])
    started = 0
    while live or started < cfg.num_conversations:
        while len(live) < cfg.num_live and started < cfg.num_conversations:
            live.append((list(system_prompt()), [rng.randint(*cfg.turns)]))
            started += 1
        if rng.random() < cfg.doc_probability:
            requests.append(system_prompt() + fresh(rng.randint(*cfg.doc_chunks)))
            continue
        i = rng.randrange(len(live))
        prefix, turns_left = live[i]
        prefix.extend(fresh(rng.randint(*cfg.turn_chunks)))
        requests.append(list(prefix))
        turns_left[0] -= 1
        if turns_left[0] == 0:
            live[i] = live[-1]
            live.pop()
    return requests


def _generate_timed(cfg: TraceConfig) -> Trace:
    """Requests in time order: conversations start as a Poisson process whose rate keeps
    about ``num_live`` of them in progress; turn t+1 comes a log-normal think time after turn
    t (heavy-tailed: most users answer within a minute or two, some after hours) and re-reads
    the whole conversation; one-off documents arrive as their own Poisson process at
    ``doc_probability`` of the request rate."""
    rng = random.Random(cfg.seed)
    next_key = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_key
        next_key += n
        return list(range(next_key - n, next_key))

    prompts = [fresh(rng.randint(*cfg.system_prompt_chunks)) for _ in range(cfg.num_system_prompts)]
    weights = [1.0 / (i + 1) ** cfg.zipf_s for i in range(cfg.num_system_prompts)]
    mu = math.log(cfg.think_median_s)
    mean_think = cfg.think_median_s * math.exp(cfg.think_sigma**2 / 2)
    mean_turns = (cfg.turns[0] + cfg.turns[1]) / 2
    start_rate = cfg.num_live / max(mean_think * (mean_turns - 1), 1e-9)  # Little's law
    # (time, order, conversation, turn): turn -1 marks a document
    events: list[tuple[float, int, int, int]] = []
    prompt_of: list[list[int]] = []
    now = 0.0
    for conv in range(cfg.num_conversations):
        now += rng.expovariate(start_rate)
        prompt_of.append(rng.choices(prompts, weights)[0])
        t = now
        for turn in range(rng.randint(*cfg.turns)):
            events.append((t, len(events), conv, turn))
            t += rng.lognormvariate(mu, cfg.think_sigma)
    if cfg.doc_probability > 0:
        doc_rate = cfg.doc_probability / (1 - cfg.doc_probability) * len(events) / now
        t = rng.expovariate(doc_rate)
        while t < now:
            events.append((t, len(events), -1, -1))
            t += rng.expovariate(doc_rate)
    events.sort()
    requests: Trace = []
    context: dict[int, list[int]] = {}
    for _, _, conv, _ in events:
        if conv < 0:
            prompt = rng.choices(prompts, weights)[0]
            requests.append(prompt + fresh(rng.randint(*cfg.doc_chunks)))
            continue
        prefix = context.setdefault(conv, list(prompt_of[conv]))
        prefix.extend(fresh(rng.randint(*cfg.turn_chunks)))
        requests.append(list(prefix))
    return requests


#: held-out variants, never used to tune a policy: other sizes, skew and mix (flatter prompt
#: popularity on chat, steeper on system, longer conversations, more and shorter documents);
#: ``bench_policies`` runs them on seeds of their own (``ALT_SEED_OFFSET`` + the seed)
TRACES_ALT: dict[str, TraceConfig] = {
    "chat-alt": replace(
        TRACES["chat"],
        num_conversations=400,
        num_live=96,
        num_system_prompts=20,
        zipf_s=0.8,
        turns=(1, 14),
        turn_chunks=(2, 24),
        doc_probability=0.02,
        doc_chunks=(100, 1500),
    ),
    "system-alt": replace(
        TRACES["system"],
        num_conversations=2500,
        num_live=96,
        num_system_prompts=64,
        system_prompt_chunks=(8, 128),
        zipf_s=1.4,
        turns=(1, 4),
        doc_probability=0.005,
    ),
    "scan-alt-timed": replace(
        TRACES["scan"],
        num_live=160,
        zipf_s=0.9,
        doc_probability=0.08,
        doc_chunks=(50, 800),
        arrivals="timed",
        think_median_s=30.0,
        think_sigma=2.0,
    ),
}
#: added to the seed of an ``*-alt*`` trace
ALT_SEED_OFFSET = 100

#: the traces of the first table (uniform arrivals), their timed twins and the held-out ones
TRACES_ALL: dict[str, TraceConfig] = {
    **TRACES,
    **{f"{name}-timed": replace(cfg, arrivals="timed") for name, cfg in TRACES.items()},
    **TRACES_ALT,
}
