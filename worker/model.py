"""A small decoder-only transformer over paged KV caches, tensor-parallel across TP ranks.

Runs in the worker process (worker/process.py), one instance per rank; also usable in one
process (``world_size == 1``) for tests and offline generation (:func:`generate`).

Architecture (Llama-like): token embedding → ``num_layers`` x (RMSNorm → attention with RoPE
and grouped KV heads over the paged cache → residual → RMSNorm → SwiGLU MLP → residual) →
RMSNorm → LM head → greedy sampling (argmax).

Tensor parallelism (Megatron style): rank ``r`` of ``W`` holds query heads
``[r·H/W, (r+1)·H/W)``, KV heads ``[r·K/W, (r+1)·K/W)`` (its KV cache holds only those) and MLP
columns ``[r·I/W, (r+1)·I/W)``; the attention output projection and the MLP down projection are
row-split, followed by an all-reduce (sum) over the default process group. Embedding, norms and
LM head are replicated, so every rank computes the same logits and samples the same tokens.

KV cache: one tensor per layer in the FlashAttention layout ``(2, num_blocks, block_size,
kv_heads_per_rank, head_dim)`` (worker/layout.py canonicalizes it; block bytes =
``layers · 2 · block_size · kv_heads_per_rank · head_dim · dtype size``, the kvserver
namespace's ``block_bytes``). Token at position ``p`` of a request lives in block
``block_ids[p // block_size]``, slot ``p % block_size``. A forward pass writes the K/V of the
scheduled tokens there, then attends over every earlier position *read back from the cache*,
so KV placed in the cache by someone else (a load from kvserver) is what the model uses.

Weights: one safetensors file holding the full (unsharded) weights plus the config as JSON
metadata (key ``config``); every rank loads it and slices its shard. :func:`write_random_model`
writes a deterministic random model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save

from kvserver.errors import InvalidArgument
from kvserver.files import write_atomic

#: torch dtype of every supported kvserver namespace dtype name
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the model. Validated on construction (InvalidArgument)."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgument(f"{name} must be a positive integer", value=value)
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise InvalidArgument("head_dim must be even (RoPE)", head_dim=self.head_dim)
        if self.dtype not in DTYPES:
            raise InvalidArgument("unsupported dtype", dtype=self.dtype, valid=list(DTYPES))

    def check_world_size(self, world_size: int) -> None:
        """Raise InvalidArgument unless heads, KV heads and MLP columns split evenly."""
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if world_size < 1 or getattr(self, name) % world_size:
                raise InvalidArgument(
                    f"{name} is not divisible by the TP world size",
                    value=getattr(self, name), world_size=world_size,
                )  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument("bad model config", detail=str(exc)) from exc


def write_random_model(path: str | Path, config: ModelConfig | None = None, seed: int = 0) -> None:
    """Write a random model with ``config`` to ``path`` (safetensors): same seed, same bytes.
    Atomic (:func:`kvserver.files.write_atomic`): ranks racing to write it leave one whole file."""
    config = config or ModelConfig()
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[config.dtype]
    c = config

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    weights: dict[str, torch.Tensor] = {"embed": rand(c.vocab_size, h, std=1.0)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        weights[p + "attn_norm"] = 1.0 + rand(h, std=0.1)
        weights[p + "wq"] = rand(q, h, std=h**-0.5)
        weights[p + "wk"] = rand(kv, h, std=h**-0.5)
        weights[p + "wv"] = rand(kv, h, std=h**-0.5)
        weights[p + "wo"] = rand(h, q, std=q**-0.5)
        weights[p + "mlp_norm"] = 1.0 + rand(h, std=0.1)
        weights[p + "w_gate"] = rand(c.intermediate_size, h, std=h**-0.5)
        weights[p + "w_up"] = rand(c.intermediate_size, h, std=h**-0.5)
        weights[p + "w_down"] = rand(h, c.intermediate_size, std=c.intermediate_size**-0.5)
    weights["norm"] = 1.0 + rand(h, std=0.1)
    weights["lm_head"] = rand(c.vocab_size, h, std=h**-0.5)
    write_atomic(str(path), save(weights, metadata={"config": config.to_json()}))


@dataclass(slots=True)
class SeqInput:
    """One request's share of a forward pass: ``token_ids`` at positions ``start, start+1, …``
    whose KV goes to the paged cache through ``block_ids`` (the request's whole block table)."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class TransformerModel:
    """One TP rank's shard of the model; see the module docstring. Not thread-safe."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        config.check_world_size(world_size)
        if not 0 <= rank < world_size:
            raise InvalidArgument("rank out of range", rank=rank, world_size=world_size)
        c = config
        self.config, self.rank, self.world_size = c, rank, world_size
        self.device = torch.device(device)
        self.dtype = DTYPES[c.dtype]
        self.num_heads = c.num_heads // world_size
        self.num_kv_heads = c.num_kv_heads // world_size
        inter = c.intermediate_size // world_size
        hd = c.head_dim

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise InvalidArgument("weight missing from the model file", name=name)
            return weights[name]

        def rows(t: torch.Tensor, per: int) -> torch.Tensor:
            return t[rank * per : (rank + 1) * per]

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=self.dtype).contiguous()

        self.embed = put(get("embed"))
        self.norm = put(get("norm"))
        self.lm_head = put(get("lm_head"))
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=put(get(p + "attn_norm")),
                    wq=put(rows(get(p + "wq"), self.num_heads * hd)),
                    wk=put(rows(get(p + "wk"), self.num_kv_heads * hd)),
                    wv=put(rows(get(p + "wv"), self.num_kv_heads * hd)),
                    wo=put(rows(get(p + "wo").t(), self.num_heads * hd).t()),
                    mlp_norm=put(get(p + "mlp_norm")),
                    w_gate=put(rows(get(p + "w_gate"), inter)),
                    w_up=put(rows(get(p + "w_up"), inter)),
                    w_down=put(rows(get(p + "w_down").t(), inter).t()),
                )
            )
        if tuple(self.embed.shape) != (c.vocab_size, c.hidden_size):
            raise InvalidArgument("embedding shape does not match the config")
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self._inv_freq = inv.to(self.device)

    # ------------------------------------------------------------------ KV cache

    def kv_layout(self) -> dict[str, int | str]:
        """The model's KV description for the kvserver namespace (all ranks together)."""
        c = self.config
        return {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "dtype": c.dtype}  # fmt: skip

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """Zeroed per-layer caches ``(2, num_blocks, block_size, kv_heads_per_rank, head_dim)``."""
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.config.head_dim)
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.config.num_layers)
        ]

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput], kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
        """Run the scheduled tokens of every request; returns the logits of each request's last
        scheduled token, ``(len(seqs), vocab_size)`` float32. Writes their K/V into the cache.

        Every rank must call this with the same ``seqs`` (collectives inside).
        REQUIRES: positions ``< start`` of each request are already in its cache blocks.
        """
        if not seqs:
            return torch.empty(0, self.config.vocab_size)
        block_size = int(kv_caches[0].shape[2])
        tokens: list[int] = []
        positions: list[int] = []
        for s in seqs:
            n = len(s.token_ids)
            if n < 1 or s.start < 0 or (s.start + n) > len(s.block_ids) * block_size:
                raise InvalidArgument("tokens do not fit the block table", start=s.start, n=n)
            tokens += s.token_ids
            positions += range(s.start, s.start + n)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        slots = [
            torch.tensor(
                [
                    s.block_ids[p // block_size] * block_size + p % block_size
                    for p in range(s.start + len(s.token_ids))
                ],
                dtype=torch.long,
                device=dev,
            )
            for s in seqs
        ]
        x = self.embed[torch.tensor(tokens, dtype=torch.long, device=dev)]
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            k_flat = cache[0].view(-1, self.num_kv_heads, self.config.head_dim)
            v_flat = cache[1].view(-1, self.num_kv_heads, self.config.head_dim)
            q, k, v = self._qkv(layer, x, pos)
            outs: list[torch.Tensor] = []
            off = 0
            for s, sl in zip(seqs, slots, strict=True):
                n = len(s.token_ids)
                new = sl[s.start :]
                k_flat[new] = k[off : off + n]
                v_flat[new] = v[off : off + n]
                outs.append(self._attend(q[off : off + n], k_flat[sl], v_flat[sl], s.start))
                off += n
            x = self._finish_layer(layer, x, torch.cat(outs))
        last = torch.tensor(
            [sum(len(s.token_ids) for s in seqs[: i + 1]) - 1 for i in range(len(seqs))],
            dtype=torch.long, device=dev,
        )  # fmt: skip
        return self._logits(x[last])

    @torch.inference_mode()
    def reference_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Full recompute without any cache: logits at every position, ``(T, vocab)`` float32.
        Collective like :meth:`forward`."""
        dev = self.device
        pos = torch.arange(len(token_ids), device=dev)
        x = self.embed[torch.tensor(list(token_ids), dtype=torch.long, device=dev)]
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, pos)
            x = self._finish_layer(layer, x, self._attend(q, k, v, 0))
        return self._logits(x)

    # ------------------------------------------------------------------ pieces

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.config.rms_eps)).to(self.dtype) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[:, None] * self._inv_freq[None, :]  # (n, hd/2)
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None, :]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return (x.float() * cos + rotated.float() * sin).to(self.dtype)

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hd = self.config.head_dim
        h = self._rms(x, layer.attn_norm)
        q = (h @ layer.wq.t()).view(-1, self.num_heads, hd)
        k = (h @ layer.wk.t()).view(-1, self.num_kv_heads, hd)
        v = (h @ layer.wv.t()).view(-1, self.num_kv_heads, hd)
        return self._rope(q, pos), self._rope(k, pos), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Causal attention of ``n`` queries at positions ``start…`` over keys at ``0…``."""
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(self.config.head_dim)
        n, t = q.shape[0], k.shape[0]
        qpos = torch.arange(start, start + n, device=q.device)[:, None]
        kpos = torch.arange(t, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out.reshape(n, -1).to(self.dtype)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t)
        return t

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self._all_reduce(attn @ layer.wo.t())
        h = self._rms(x, layer.mlp_norm)
        g = torch.nn.functional.silu(h @ layer.w_gate.t()) * (h @ layer.w_up.t())
        return x + self._all_reduce(g @ layer.w_down.t())

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._rms(x, self.norm) @ self.lm_head.t()).float()


def load_model(
    path: str | Path, *, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"
) -> TransformerModel:
    """Load the full weights from a safetensors file written by :func:`write_random_model` (or
    anything with the same names and ``config`` metadata) and keep this rank's shard."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if "config" not in meta:
            raise InvalidArgument("model file has no config metadata", path=str(path))
        config = ModelConfig.from_json(meta["config"])
        weights = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return TransformerModel(config, weights, rank=rank, world_size=world_size, device=device)


def sample_greedy(logits: torch.Tensor) -> list[int]:
    """Argmax per row (ties: the lowest token id, the same on every rank)."""
    return [int(t) for t in logits.argmax(-1).tolist()]


def generate(
    model: TransformerModel,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    block_size: int = 16,
    prefill_chunk: int = 0,
) -> list[int]:
    """Offline greedy generation over a private paged cache (tests, reference runs): the prompt
    in chunks of ``prefill_chunk`` tokens (0 = whole), then one token per step. Collective."""
    total = len(prompt) + max_tokens
    num_blocks = -(-total // block_size) + 1
    caches = model.allocate_kv_caches(num_blocks, block_size)
    blocks = list(range(num_blocks - 1, 0, -1))  # scrambled order, block 0 unused (null)
    tokens = list(prompt)
    out: list[int] = []
    start, chunk = 0, prefill_chunk or len(prompt)
    while len(out) < max_tokens:
        end = min(len(tokens), start + chunk)
        logits = model.forward([SeqInput(tokens[start:end], start, blocks)], caches)
        start = end
        if end == len(tokens):
            token = sample_greedy(logits)[0]
            out.append(token)
            tokens.append(token)
    return out
