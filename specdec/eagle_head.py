"""An EAGLE-1 style draft head: Llama decoder layers (one by default, ``num_hidden_layers`` in its config) over
``fc(concat(embed(next token), target hidden))``.

Layout is vLLM's ``EagleLlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle.py``): weights ``fc.weight``
[dim, 2*dim] (no bias) and ``layers.{i}.*`` with HF names, no ``layers.0.input_layernorm`` (vLLM disables it on the
first layer; later layers are plain pre-norm ones) and no final norm; the token embedding and the LM head are the
target's (frozen, not stored). The hidden state it reads and predicts is the target's final-norm hidden state
(what the target's LM head reads), so the head's output goes straight through the target's LM head.

EAGLE-3's feature fusion, optionally (``fuse_layers``): at real positions the head reads ``fuse(concat(outputs of
the target's layers fuse_layers..., final-norm state))`` [dim, (n+1)*dim] instead of the final-norm state alone;
its own predicted states (chain steps after the first) go in unfused, as in vLLM's ``llama_eagle3.py``. Such a
head is quantspec's layout (vLLM's EAGLE-1 loader does not read ``fuse.weight``).

A head file is data, never code: ``model.safetensors`` + ``config.json``, every shape checked against the target.
An optional reduced draft vocabulary follows EAGLE-3's ``d2t`` convention (target id = draft id + d2t[draft id]):
the draft then computes only those rows of the target's LM head.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from quant.methods import get_method
from quant.qlinear import QuantizedLinear
from quant.scheme import check_group_fits, parse_scheme
from runtime.errors import UserError
from runtime.transformer import ModelArgs, RMSNorm, apply_rope, rope_tables

WEIGHTS = "model.safetensors"


def head_config(target_config: dict, draft_vocab: int | None = None, extra: dict | None = None,
                fuse_layers: tuple[int, ...] = (), head_layers: int = 1) -> dict:
    """The head's config.json: the target's Llama config with the head's layer count (what vLLM's EAGLE loader
    reads)."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "head_dim", "bos_token_id",
            "eos_token_id", "attention_bias")
    cfg = {k: target_config[k] for k in keep if k in target_config}
    cfg.update(architectures=["EagleLlamaForCausalLM"], model_type="llama", num_hidden_layers=head_layers,
               tie_word_embeddings=False, torch_dtype="bfloat16")
    if draft_vocab:
        cfg["draft_vocab_size"] = draft_vocab
    cfg["quantspec_eagle"] = {"kind": "eagle1", "hidden": "final-norm", **(extra or {})}
    if fuse_layers:
        cfg["quantspec_eagle"].update(kind="eagle1+fused", fuse_layers=list(fuse_layers))
    return cfg


def _decoder_layer(args: ModelArgs, first: bool) -> nn.Module:
    """One Llama decoder layer with HF names; the first has no input_layernorm (vLLM's EAGLE layout)."""
    d, hd = args.dim, args.head_dim
    layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
    attn.q_proj = nn.Linear(d, args.n_heads * hd, bias=args.qkv_bias)
    attn.k_proj = nn.Linear(d, args.n_kv_heads * hd, bias=args.qkv_bias)
    attn.v_proj = nn.Linear(d, args.n_kv_heads * hd, bias=args.qkv_bias)
    attn.o_proj = nn.Linear(args.n_heads * hd, d, bias=False)
    mlp.gate_proj = nn.Linear(d, args.intermediate_size, bias=False)
    mlp.up_proj = nn.Linear(d, args.intermediate_size, bias=False)
    mlp.down_proj = nn.Linear(args.intermediate_size, d, bias=False)
    layer.self_attn, layer.mlp = attn, mlp
    if not first:
        layer.input_layernorm = RMSNorm(d, args.norm_eps)
    layer.post_attention_layernorm = RMSNorm(d, args.norm_eps)
    return layer


class EagleHead(nn.Module):
    """fc + ``head_layers`` decoder layers (EAGLE-1: one). ``forward(embeds, hidden, input_pos)`` -> predicted next
    hidden states; with a cache (``setup_cache``) it runs incrementally at explicit positions, without one it is
    causal over the sequence (training)."""

    def __init__(self, args: ModelArgs, fuse_layers: tuple[int, ...] = (), head_layers: int = 1):
        super().__init__()
        self.args = args
        self.fuse_layers = tuple(fuse_layers)
        d = args.dim
        if fuse_layers:
            self.fuse = nn.Linear((len(fuse_layers) + 1) * d, d, bias=False)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([_decoder_layer(args, i == 0) for i in range(head_layers)])
        cos, sin = rope_tables(args, args.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.k_cache = self.v_cache = None

    def setup_cache(self, max_len: int) -> None:
        a = self.args
        dtype = self.layers[0].post_attention_layernorm.weight.dtype  # the head's dtype (its linears may be quantized)
        shape = (len(self.layers), 1, a.n_kv_heads, max_len, a.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def _project(self, embeds, hidden):
        """x = fc(embed | hidden); target states wider than dim are fused first."""
        if hidden.shape[-1] != self.args.dim:
            hidden = self.fuse(hidden)
        return self.fc(torch.cat((embeds, hidden), dim=-1))

    def _qkv(self, i, x, input_pos):
        """Layer i's q, k, v of x (after its input norm, if it has one), with RoPE at input_pos."""
        a, layer = self.args, self.layers[i]
        if hasattr(layer, "input_layernorm"):
            x = layer.input_layernorm(x)
        B, T, _ = x.shape
        attn = layer.self_attn
        q = attn.q_proj(x).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        cos = self.rope_cos[input_pos].to(x.dtype)
        sin = self.rope_sin[input_pos].to(x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, i, x, q, keys, values, mask):
        """Layer i: attention (mask None: causal) + o_proj + MLP, residuals -> its output states."""
        layer = self.layers[i]
        gqa = self.args.n_heads != self.args.n_kv_heads
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        B, T, _ = x.shape
        h = x + layer.self_attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        m = layer.mlp
        z = layer.post_attention_layernorm(h)
        return h + m.down_proj(F.silu(m.gate_proj(z)) * m.up_proj(z))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """embeds [B, T, dim], hidden [B, T, dim or fused width] (the token at t+1 and the target state at t) ->
        predicted state at t+1 [B, T, dim]."""
        x = self._project(embeds, hidden)
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        mask = None if self.k_cache is None else torch.arange(end)[None, :] <= input_pos[:, None]
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, x, input_pos)
            if self.k_cache is not None:
                self.k_cache[i, :, :, start:end] = k
                self.v_cache[i, :, :, start:end] = v
                k, v = self.k_cache[i, :, :, :end], self.v_cache[i, :, :, :end]
            x = self._attend(i, x, q, k, v, mask)
        return x

    def unroll(self, embeds: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): the chain drafting does, at every position of a sequence at once.

        Step 1 is ``forward`` on the target's states. Step s reads, at position t, step s-1's prediction at t-1
        (the head's own state, as when drafting token s of a chain that began after position t-s+1) and attends,
        in every layer, to what the drafting head's cache would hold then: step-1 keys (real states) up to t-s+1
        and step j's key at t-s+j for j = 2..s (``chain_mask``). Returns the predictions of each step,
        [B, T, dim]; rows t < s-1 of step s have no real chain start and carry no loss.
        """
        T = embeds.shape[1]
        pos = torch.arange(T)
        keys, values = [[] for _ in self.layers], [[] for _ in self.layers]
        preds = []
        h = hidden
        for s in range(1, steps + 1):
            x = self._project(embeds, h)
            mask = None if s == 1 else chain_mask(T, s)
            for i in range(len(self.layers)):
                q, k, v = self._qkv(i, x, pos)
                keys[i].append(k)
                values[i].append(v)
                x = self._attend(i, x, q, torch.cat(keys[i], 2), torch.cat(values[i], 2), mask)
            preds.append(x)
            h = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), 1)
        return preds


def chain_mask(T: int, s: int) -> torch.Tensor:
    """[T, s*T] keys visible to step s at position t: step 1 (real) at u <= t-s+1, step j at u = t-s+j."""
    t, u = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return torch.cat([u <= t - s + 1] + [u == t - s + j for j in range(2, s + 1)], 1)


def first_bad_fuse_layer(fuse_layers, n_layers: int):
    """The first of ``fuse_layers`` that is not a layer before the target's last (None: all are)."""
    return next((i for i in fuse_layers if not isinstance(i, int) or not 0 <= i < n_layers - 1), None)


def new_head(target_config: dict, dtype: torch.dtype = torch.float32, seed: int = 0,
             fuse_layers: tuple[int, ...] = (), head_layers: int = 1) -> EagleHead:
    """A freshly initialised head for a target (fc starts as [0 | I] and fuse as [0 ... | I]: the target's own
    final state passes through)."""
    args = ModelArgs.from_hf_config(target_config)
    n_layers = target_config["num_hidden_layers"]
    bad = first_bad_fuse_layer(fuse_layers, n_layers)
    if bad is not None:
        raise UserError(f"--fuse-layers {bad}: the target has layers 0..{n_layers - 2} before its last")
    torch.manual_seed(seed)
    head = EagleHead(args, fuse_layers, head_layers)
    with torch.no_grad():
        d = args.dim
        for fc in ((head.fc, head.fuse) if fuse_layers else (head.fc,)):
            fc.weight.zero_()
            fc.weight[:, -d:] = torch.eye(d)
        for name, p in head.named_parameters():
            if p.dim() == 2 and not name.startswith(("fc", "fuse")):
                nn.init.normal_(p, std=0.02)
        for name in ("o_proj", "down_proj"):
            for n, p in head.named_parameters():
                if n.endswith(f"{name}.weight"):
                    p.mul_(0.1)
    return head.to(dtype)


def quantize_head(head: EagleHead, scheme: str) -> EagleHead:
    """Replace the head's linears (fc and the layer's) in place by weight-only RTN-quantized ones (quant/ kernels,
    e.g. ``w8ch-sym``: int8 per channel); returns the head."""
    parsed = parse_scheme(scheme)
    if parsed.weights is None or parsed.activations is not None:
        raise UserError(f"eagle head weights={scheme}: pick a weight-only scheme such as w8ch-sym")
    rtn = get_method("rtn")
    dtype = head.layers[0].post_attention_layernorm.weight.dtype
    for name, linear in [(n, m) for n, m in head.named_modules() if isinstance(m, nn.Linear)]:
        check_group_fits(parsed, f"eagle head {name}", linear.in_features)
        result = rtn.quantize_weight(linear.weight.detach().float(), parsed.weights, None)
        head.set_submodule(name, QuantizedLinear.from_result(result, parsed.weights, linear.in_features, linear.bias,
                                                             dtype=dtype))
    return head


def save_head(head: EagleHead, out: Path, config: dict, d2t: torch.Tensor | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    if d2t is not None:
        state["d2t"] = d2t.to(torch.int64).contiguous()
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def expected_shapes(args: ModelArgs, fuse_layers: tuple[int, ...] = (),
                    head_layers: int = 1) -> dict[str, tuple[int, ...]]:
    d, hd, inter = args.dim, args.head_dim, args.intermediate_size
    shapes = {"fc.weight": (d, 2 * d)}
    for i in range(head_layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (args.n_heads * hd, d),
                       p + "self_attn.k_proj.weight": (args.n_kv_heads * hd, d),
                       p + "self_attn.v_proj.weight": (args.n_kv_heads * hd, d),
                       p + "self_attn.o_proj.weight": (d, args.n_heads * hd),
                       p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                       p + "mlp.down_proj.weight": (d, inter), p + "post_attention_layernorm.weight": (d,)})
        if i:
            shapes[p + "input_layernorm.weight"] = (d,)
        if args.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (args.n_heads * hd,),
                           p + "self_attn.k_proj.bias": (args.n_kv_heads * hd,),
                           p + "self_attn.v_proj.bias": (args.n_kv_heads * hd,)})
    if fuse_layers:
        shapes["fuse.weight"] = (d, (len(fuse_layers) + 1) * d)
    return shapes


def load_head(path: str | Path, target_config: dict, dtype: torch.dtype) -> tuple[EagleHead, torch.Tensor | None, dict]:
    """(head, draft-to-target ids or None, its config) from a head dir; every mismatch with the target is a
    one-line UserError (safetensors only: a head file is data, never code)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"eagle head {path} is not a directory (expected config.json + {WEIGHTS})")
    if not (path / "config.json").exists():
        raise UserError(f"eagle head {path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        what = f" (found {', '.join(pickles)}: pickled weights are code and are not loaded)" if pickles else ""
        raise UserError(f"eagle head {path} has no *.safetensors weights{what}")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"eagle head {path}/config.json is not JSON: {exc}") from None
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    args = ModelArgs.from_hf_config(target_config)
    t_hidden, t_vocab = target_config["hidden_size"], target_config["vocab_size"]
    fc = state.get("fc.weight")
    got = cfg.get("hidden_size", t_hidden) if fc is None else fc.shape[0]
    if got != t_hidden or cfg.get("hidden_size", t_hidden) != t_hidden:
        got = cfg.get("hidden_size") if cfg.get("hidden_size", t_hidden) != t_hidden else got
        raise UserError(f"eagle head {path} has hidden size {got}, the target has {t_hidden}: train a head for this target")
    if cfg.get("vocab_size", t_vocab) != t_vocab:
        raise UserError(f"eagle head {path} is for a vocabulary of {cfg['vocab_size']} tokens, the target has {t_vocab}")
    draft_vocab = cfg.get("draft_vocab_size") or t_vocab
    d2t = None
    if draft_vocab != t_vocab:
        if "d2t" not in state:
            raise UserError(f"eagle head {path} declares draft_vocab_size {draft_vocab} but has no d2t map")
        offsets = state.pop("d2t").to(torch.long)
        if offsets.shape != (draft_vocab,):
            raise UserError(f"eagle head {path}: d2t has shape {tuple(offsets.shape)}, expected ({draft_vocab},)")
        d2t = torch.arange(draft_vocab) + offsets
        if int(d2t.min()) < 0 or int(d2t.max()) >= t_vocab:
            raise UserError(f"eagle head {path}: d2t maps outside the target's {t_vocab}-token vocabulary")
    state.pop("d2t", None)
    state.pop("t2d", None)
    state = {k: v for k, v in state.items() if not k.startswith(("embed_tokens", "lm_head"))}  # the target's are used
    fuse_layers = tuple(cfg.get("quantspec_eagle", {}).get("fuse_layers", ()))
    n_layers = target_config["num_hidden_layers"]
    bad = first_bad_fuse_layer(fuse_layers, n_layers)
    if bad is not None:
        raise UserError(f"eagle head {path} fuses layer {bad}; the target has layers 0..{n_layers - 2} before "
                        "its last: train a head for this target")
    head_layers = cfg.get("num_hidden_layers", 1)
    if not isinstance(head_layers, int) or head_layers < 1:
        raise UserError(f"eagle head {path}: num_hidden_layers {head_layers!r} in config.json; expected 1 or more")
    shapes = expected_shapes(args, fuse_layers, head_layers)
    missing = sorted(set(shapes) - set(state))
    extra = sorted(set(state) - set(shapes))
    if missing or extra:
        raise UserError(f"eagle head {path} is not a {head_layers}-layer EAGLE head (num_hidden_layers in its "
                        f"config.json): missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise UserError(f"eagle head {path}: {name} has shape {tuple(state[name].shape)}, expected {shape} for "
                            "this target")
    head = EagleHead(args, fuse_layers, head_layers)
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return head.to(dtype).eval(), d2t, cfg
