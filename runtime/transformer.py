"""A plain-torch Llama-family decoder (Llama, Qwen2, Mistral, SmolLM) with an explicit KV cache.

gpt-fast style: one module, no framework. ``forward(tokens, input_pos)`` runs any number of new
tokens at explicit positions against the cache, so prefill, decode, multi-token verification and
rollback (just overwrite from an earlier position) are the same call.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.hardware import EXACT_ROWS, Hardware, probe, probed_once
from runtime.packed_linear import PackedLinear, linears
from runtime.registry import Registry


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_seq_len: int = 2048
    qkv_bias: bool = False
    rope_scaling: dict | None = field(default=None)

    head_dim_override: int | None = None

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 5 / 4 spellings
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            qkv_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            rope_scaling=rope or None,
            head_dim_override=cfg.get("head_dim"),
        )


class KVCache(nn.Module):
    """Dense per-layer K/V storage [batch, kv_heads, max_len, head_dim]; rollback is free (positions overwrite)."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int):
        """Store new K/V at ``input_pos`` and return the first ``length`` positions for attention (an index copy,
        not a slice from ``int(input_pos)``, so a compiled step does not depend on the position's value)."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k[:, :, :length], self.v[:, :, :length]

    def bytes_per_token(self) -> int:
        return 2 * self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    FUSE = (("q_proj", "k_proj", "v_proj"),)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = PackedLinear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = PackedLinear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = PackedLinear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = PackedLinear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None
        self.fused: dict = {}  # runtime.packed_linear.prepare: FUSE's linears as one call in compiled steps

    def forward(self, x, cos, sin, input_pos, mask, length, attend):
        bsz, seqlen, _ = x.shape
        q, k, v = linears(self, self.FUSE[0], x)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = self.kv_cache.update(input_pos, k, v, length)
        y = attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seqlen, -1))


def attention_window(input_pos: torch.Tensor, last: int, max_len: int, align: int = 1, force_mask: bool = False
                     ) -> tuple[int, torch.Tensor | None]:
    """(cache positions the queries at ``input_pos`` (the last at ``last - 1``) read: up to the last, rounded up to
    ``align``; their mask [len, keys], causal within the new tokens and hiding the aligned tail, or None where
    neither applies)."""
    length = min(-(-last // align) * align, max_len)
    if len(input_pos) == 1 and length == last and not force_mask:
        return length, None
    return length, torch.arange(length, device=input_pos.device)[None, :] <= input_pos[:, None]


ATTENTION: Registry = Registry("attention")  # name -> fn(q, k, v, mask) on [batch, heads, len, head_dim];
# mask: None, [len, keys] or [batch, 1, len, keys] (True = attend)


@ATTENTION.register("sdpa")
def sdpa_attention(q, k, v, mask):
    """Torch's fused kernel: fastest for one query over a short history, but in bf16 its one-query and
    many-query paths round differently, so a verified token's logits differ from its decoded ones."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


KEY_BLOCK = 1024  # bf16 matmuls sum more than 1024 terms in another order: p @ v runs per fixed key block
# Keys an attention reads, rounded up to a multiple of this (the extra ones masked): on AMX the bf16 matmuls
# treat a ragged tail of keys differently, so a lone query over n keys and the same query among others over
# n + 1 summed in another order. With the key count aligned, every row sees the same reduction shape.
KEY_ALIGN: dict[str, int] = {"eager": 64}


@ATTENTION.register("eager")
def batch_invariant_attention(q, k, v, mask):
    """HF-style eager attention (bf16 matmuls, fp32 softmax) whose output for a query does not depend on how
    many queries run with it, so in bf16 verifying K+1 tokens gives bitwise the rows that decoding them one by
    one gives, and greedy speculation is token-exact by construction. Query heads of one kv head share a
    matmul (no K/V copies). Slower than SDPA for one query over a short history, faster over a long one."""
    bsz, n_heads, seqlen, head_dim = q.shape
    n_kv, group = k.shape[1], n_heads // k.shape[1]
    scores = torch.matmul(q.reshape(bsz, n_kv, group * seqlen, head_dim), k.transpose(-1, -2))
    if mask is not None:  # [len, keys] or [batch, 1, len, keys]: insert the group axis
        scores = scores.view(bsz, n_kv, group, seqlen, -1).masked_fill(~mask[..., None, :, :], float("-inf"))
    probs = torch.softmax(scores.float() * head_dim ** -0.5, -1).to(q.dtype).view(bsz, n_kv, group * seqlen, -1)
    n_keys = k.shape[2]
    if n_keys <= KEY_BLOCK:
        out = torch.matmul(probs, v)
    else:
        out = sum(torch.matmul(probs[..., s : s + KEY_BLOCK], v[:, :, s : s + KEY_BLOCK]).float()
                  for s in range(0, n_keys, KEY_BLOCK)).to(q.dtype)
    return out.view(bsz, n_heads, seqlen, head_dim)


def upcast_attention(q, k, v, mask):
    """``eager`` attention with its matmuls in fp32 and its output cast back: what ``eager`` runs in bf16 on a CPU
    whose bf16 matmul is emulated and whose bf16 attention rows depend on how many queries run together (Intel Ice
    Lake: 5 probed queries, and a greedy speculative output that left plain decoding's at its 10th token)."""
    return batch_invariant_attention(q.float(), k.float(), v.float(), mask).to(q.dtype)


def attention_for(name: str, device: torch.device, dtype: torch.dtype) -> Callable:
    """The attention function a model loaded with ``name`` runs on ``device`` in ``dtype``: the registered one;
    ``eager`` in bf16 on a CPU that emulates bf16 matmul runs ``emulated_bf16_attention``'s pick."""
    if name == "eager" and dtype == torch.bfloat16 and device.type == "cpu" and not probe().bf16_native:
        return emulated_bf16_attention(probe())
    return ATTENTION.get(name)


@functools.cache
def emulated_bf16_attention(hardware: Hardware) -> Callable:
    """``eager``'s bf16 attention where its rows probe batch-invariant on the default model's attention shape (AMD
    EPYC, AVX2: 0 queries, where fp32 matmuls gave 45 other bits), else ``upcast_attention`` (Intel Ice Lake)."""
    variant = attention_rows_differing(batch_invariant_attention, n_kv=3, group=3, head_dim=64,
                                       align=KEY_ALIGN["eager"], max_len=KEY_BLOCK + 76)
    return upcast_attention if variant else batch_invariant_attention


def attention_rows_differing(attend, n_kv: int, group: int, head_dim: int, align: int, max_len: int,
                             dtype: torch.dtype = torch.bfloat16) -> int:
    """Queries whose output from ``attend`` differs bitwise between running among others (a verification of up to
    ``EXACT_ROWS`` tokens) and alone (the decode step at its position, over its own aligned keys), at positions
    on both sides of an alignment boundary and past ``KEY_BLOCK``; unit-normal q and k, heavy-tailed v, in ``dtype``.
    0: the attention is batch-invariant here. Measured once per machine and shape (``probed_once``)."""
    name = "attention-rows-v2/" + "/".join(map(str, (attend.__name__, n_kv, group, head_dim, align, max_len, dtype)))

    def measure() -> dict:
        g = torch.Generator().manual_seed(0)

        def heavy(*shape):
            return (torch.randn(*shape, generator=g) * torch.randn(*shape, generator=g).exp()).to(dtype)

        # q and k unit normal (softmax spread over many keys, as a model's: peaked probabilities sum exactly in
        # any order and hid the difference), v heavy-tailed
        keys = torch.randn(1, n_kv, max_len, head_dim, generator=g).to(dtype), heavy(1, n_kv, max_len, head_dim)
        differing = 0
        for n in (*range(2, 10), 17, EXACT_ROWS):
            for start in (1, align - 3, 4 * align - n // 2, KEY_BLOCK + 5):
                if start + n > max_len:
                    continue
                q = torch.randn(1, n_kv * group, n, head_dim, generator=g).to(dtype)
                pos = torch.arange(start, start + n)
                length, mask = attention_window(pos, start + n, max_len, align)
                together = attend(q, keys[0][:, :, :length], keys[1][:, :, :length], mask)
                for i in range(n):
                    length, mask = attention_window(pos[i:i + 1], start + i + 1, max_len, align)
                    alone = attend(q[:, :, i:i + 1], keys[0][:, :, :length], keys[1][:, :, :length], mask)
                    differing += not torch.equal(alone, together[:, :, i:i + 1])
        return {"differing": differing}

    return probed_once(name, measure)["differing"]


class OnlineRotation(nn.Module):
    """``x -> x @ matrix`` in fp32: an orthogonal transform a rotated model applies at run time (quant/rotation.py;
    one dense matmul, no fast-transform kernel)."""

    def __init__(self, matrix: torch.Tensor):
        super().__init__()
        self.register_buffer("matrix", matrix.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.matrix).to(x.dtype)


class MLP(nn.Module):
    FUSE = (("gate_proj", "up_proj"),)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.fused: dict = {}  # as Attention's
        self.gate_proj = PackedLinear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = PackedLinear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = PackedLinear(args.intermediate_size, args.dim, bias=False)
        self.down_input: OnlineRotation | None = None  # rotated models: the online transform of down_proj's input

    def forward(self, x):
        gate, up = linears(self, self.FUSE[0], x)
        h = F.silu(gate) * up
        return self.down_proj(h if self.down_input is None else self.down_input(h))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, input_pos, mask, length, attend):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, mask, length, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(frozen=True)
class CacheState:
    """What ``Transformer.setup_cache`` installs: the per-layer KV caches, their length and batch, and the RoPE
    tables. A ``Decoder`` keeps its own and puts it back when another user of the model installed one (a compiled
    step's graph is guarded on these very tensors, and the caches hold the decoder's positions)."""

    caches: tuple
    max_len: int
    batch: int
    rope: tuple  # (cos, sin), or () before any setup_cache

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of this state: the caches' buffers and the RoPE tables."""
        return [*(t for cache in self.caches for t in cache.buffers()), *self.rope]


class Transformer(nn.Module):
    """Parameter names mirror HF's ``model.*`` / ``lm_head`` so HF state dicts load directly."""

    def __init__(self, args: ModelArgs, attention: str = "sdpa"):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = PackedLinear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_len = 0
        self.batch = 0
        self.exit_layer: int | None = None  # layer-skip self-drafting: run only the first N layers
        self.attn_implementation = attention  # a name in ATTENTION; "eager" is batch-invariant (exact speculation)
        self.rotation: dict | None = None  # what quant/rotation.py applied (exports record it)

    def untie_lm_head(self) -> None:
        """Give a tied LM head its own copy of the embedding (for a change to one of them alone: a rotation, or
        quantizing the head while the embedding lookup stays dense)."""
        if self.lm_head.weight is self.embed_tokens.weight:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().clone(), requires_grad=False)
        self.args.tie_word_embeddings = False

    def setup_cache(self, batch: int, max_len: int, cache_factory=None) -> None:
        """Allocate a fresh KV cache per layer. ``cache_factory(batch, max_len, kv_heads, head_dim, dtype)``
        lets quant/ plug in quantized caches."""
        factory = cache_factory or KVCache
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        with device:  # every cache (a quantized one included) allocates on the model's device
            for layer in self.layers:
                layer.self_attn.kv_cache = factory(batch, max_len, self.args.n_kv_heads, self.args.head_dim, dtype)
        self.max_len, self.batch = max_len, batch
        cos, sin = rope_tables(self.args, max_len)
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)

    def cache_state(self) -> CacheState:
        """The KV caches and RoPE tables installed now (``restore_cache`` puts them back)."""
        rope = (self.rope_cos, self.rope_sin) if hasattr(self, "rope_cos") else ()
        return CacheState(tuple(layer.self_attn.kv_cache for layer in self.layers), self.max_len, self.batch, rope)

    def holds(self, state: CacheState) -> bool:
        """Whether ``state`` is what is installed (by identity: cheap enough for every forward)."""
        return self.layers[0].self_attn.kv_cache is state.caches[0] and (
            not state.rope or getattr(self, "rope_cos", None) is state.rope[0])

    def restore_cache(self, state: CacheState) -> None:
        for layer, cache in zip(self.layers, state.caches):
            layer.self_attn.kv_cache = cache
        self.max_len, self.batch = state.max_len, state.batch
        for name, table in zip(("rope_cos", "rope_sin"), state.rope):
            self.register_buffer(name, table, persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, n_layers: int | None = None,
                return_hidden: bool = False, pad: torch.Tensor | None = None, aux_layers: tuple[int, ...] = ()):
        """Logits [batch, len(input_pos), vocab] for ``tokens`` at positions ``input_pos`` (contiguous, ascending).
        ``return_hidden``: (logits, the final-norm hidden states the LM head reads) — what EAGLE heads draft from;
        the logits are the same either way. ``pad`` [batch]: left padding, row b's first pad[b] cache slots hold
        no tokens; they are hidden from the row's queries and its RoPE positions start after them. ``aux_layers``:
        the hidden states returned are those layers' outputs and the final-norm state, concatenated (what a fused
        EAGLE-3 style head reads)."""
        last = int(input_pos[-1]) + 1  # keys up to the last new token (one read of the position, on any device)
        if last > self.max_len:
            raise ValueError(f"position {last - 1} exceeds the KV cache length {self.max_len}")
        length, mask = attention_window(input_pos, last, self.max_len, KEY_ALIGN.get(self.attn_implementation, 1),
                                        force_mask=pad is not None)
        if pad is not None:  # a padding slot's query sees only itself (a row with no key would give NaN)
            key_pos = torch.arange(length, device=tokens.device)
            mask = mask & ((key_pos >= pad[:, None])[:, None, None, :] | (key_pos == input_pos[:, None]))
        rope_pos = None if pad is None else (input_pos - pad[:, None]).clamp(min=0)[:, None]  # [b, 1, len]
        logits, hidden = self.run(tokens, input_pos, mask, length, n_layers, rope_pos, aux_layers)
        return (logits, hidden) if return_hidden else logits

    def run(self, tokens: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor | None, length: int,
            n_layers: int | None = None, rope_pos: torch.Tensor | None = None,
            aux_layers: tuple[int, ...] = (), attend=None, block=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final-norm hidden states, after the outputs of ``aux_layers`` if any) reading the first
        ``length`` cache positions under ``mask``; no branch on tensor values, so ``runtime.compiled`` compiles it
        with ``length`` its span (a static number of positions). ``rope_pos``: RoPE positions where they differ from
        the cache positions (left padding). ``attend``: an attention function in place of the model's (a compiled
        step's), handed to each layer, or to ``block`` as it is. ``block``: ``block(layer, x, ..., attend)`` runs each layer in place of
        ``layer(x, ..., attend)`` (a compiled step's region)."""
        rope_pos = input_pos if rope_pos is None else rope_pos
        cos, sin = self.rope_cos[rope_pos], self.rope_sin[rope_pos]
        x = self.embed_tokens(tokens)
        depth = n_layers or self.exit_layer or len(self.layers)
        attend = attend or attention_for(self.attn_implementation, x.device, x.dtype)
        aux = []
        for i, layer in enumerate(self.layers[:depth]):
            x = block(layer, x, cos, sin, input_pos, mask, length, attend) if block else layer(
                x, cos, sin, input_pos, mask, length, attend)
            if i in aux_layers:
                aux.append(x)
        hidden = self.norm(x)
        return self.lm_head(hidden), torch.cat((*aux, hidden), -1) if aux else hidden


def rope_tables(args: ModelArgs, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim] in HF's rotate-half layout, with llama3 rope scaling if configured."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high, orig = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
