"""Quantization schemes: a registry of named presets plus a compact explicit label that parses back.

Label grammar (every table uses it):
``w[fp]<bits><gran>-<sym|asym>[_a[fp]<bits><tok|t|g<N>>-<dyn|static>][@ignore=a,b][+pad][@head=<weights>]``
with ``<gran>`` = ``t`` (per-tensor), ``ch`` (per-channel), ``g<N>`` (per-group of N input columns) or ``b<N>``
(per N x N block of the weight, fp8 only: compressed-tensors' ``block_structure [N, N]``), and the
number type as a prefix of the bits: none for integers, ``fp`` for floats (``fp8`` = E4M3, as in KV specs),
``mxfp`` / ``nvfp`` for the microscaling formats (``mxfp4`` = E2M1 and ``mxfp8`` = E4M3 codes in groups of 32
with E8M0 power-of-two scales; ``nvfp4`` = E2M1 in groups of 16 with E4M3 scales times one fp32 global scale
per tensor). Examples: ``w4g32-asym``, ``w8ch-sym_a8tok-dyn``, ``wfp8ch-sym_afp8tok-dyn``, ``wmxfp4g32-sym``,
``wmxfp4g32-sym_amxfp4g32-dyn``, ``wnvfp4g16-sym``, ``wnvfp4g16-sym_anvfp4g16-dyn`` (NVFP4 activations: E4M3 group
scales computed per input, under one per-tensor global scale calibrated per layer), ``w3g32-sym@ignore=lm_head``, ``w4g32-sym_a4tok-dyn`` and
``w4g32-sym_a4g32-dyn`` (int4 activations, dynamic per token / per group of 32 columns; simulated kernel).
``@ignore=`` lists the Linear layers kept dense (name, last components or glob), replacing the default
``lm_head``: ``w8ch-sym@ignore=`` quantizes the LM head too (a tied one as its own copy; the embedding stays dense),
which is what a decode step streams beside the body at batch 1. ``@head=`` gives the LM head its own weight-only
scheme instead (a tied head as its own copy): ``w4g32-sym@head=w8ch-sym`` is llama.cpp's Q4_1 layout, a 4-bit body
beside an 8-bit head; it needs ``lm_head`` in the ignore list (the default).
Presets follow llm-compressor / compressed-tensors names (``W8A16``, ``W4A16``, ``W4A16_ASYM``, ``W8A8``,
``FP8``, ``FP8_DYNAMIC``, ``FP8_BLOCK``, ``MXFP4A16``, ``NVFP4A16``, ``MXFP8A16``, ``MXFP4``, ``NVFP4``, ``MXFP8``,
...);
``FP8A16`` (FP8 weights only) is ours: compressed-tensors has no such preset.
"""
from __future__ import annotations

import re
from fnmatch import fnmatchcase
from dataclasses import dataclass, field, replace

import torch

from runtime.errors import UserError
from runtime.registry import Registry

SUPPORTED_WEIGHT_BITS = (8, 4, 3, 2)
DEFAULT_IGNORE = ("lm_head", "embed_tokens")
GRANULARITIES = ("tensor", "channel", "group", "block")
E2M1_MAX = 6.0  # the largest FP4 (E2M1) magnitude, as compressed-tensors' FP4_E2M1_DATA.max


@dataclass(frozen=True)
class NumberType:
    """How codes and scales are stored: the label prefix, compressed-tensors' ``QuantizationArgs.type`` of the
    codes, the code dtype per bit width, and what the format allows. Microscaling formats fix the group size
    and store their scales in ``scale_dtype`` (compressed-tensors' name for it); their scales and rounding are
    compressed-tensors' own (``quant.microscale``)."""

    prefix: str  # between ``w``/``a`` and the bits in labels
    ct_type: str  # compressed-tensors QuantizationArgs.type: int | float
    dtypes: dict[int, torch.dtype]  # bits -> code storage (FP4 codes are exact in float8_e4m3fn)
    granularities: tuple[str, ...] = ("tensor", "channel", "group")  # of weight scales
    asymmetric: bool = True  # zero points allowed
    static_activations: bool = True  # per-tensor calibrated activation scales built
    group_size: int | None = None  # the one group size a microscaling format has
    scale_dtype: torch.dtype | None = None  # microscaling: uint8 (E8M0 exponents) or float8_e4m3fn
    global_scale: bool = False  # one fp32 scale per tensor above the group scales (NVFP4)
    act_granularities: dict[int, tuple[str, ...]] = field(default_factory=dict)  # activation bits -> scale
    # granularities (microscaling formats: their block, checked apart); 4-bit ones are dynamic only

    @property
    def microscaled(self) -> bool:
        return self.group_size is not None

    def qrange(self, bits: int) -> tuple[float, float]:
        """The code range of weights (symmetric scales are ``absmax / ((qmax - qmin) / 2)``)."""
        dtype = self.dtypes[bits]
        if dtype.is_floating_point:
            top = E2M1_MAX if bits == 4 else torch.finfo(dtype).max
            return -top, top
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def round(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """Round to the integer grid; float codes round when cast to their dtype."""
        return x if self.dtypes[bits].is_floating_point else torch.round(x)


NUMBER_TYPES: Registry[NumberType] = Registry("number type")
NUMBER_TYPES.add("int", NumberType("", "int", {b: torch.int8 for b in SUPPORTED_WEIGHT_BITS},
                                   act_granularities={8: ("token", "tensor"), 4: ("token", "group")}))
NUMBER_TYPES.add("float", NumberType("fp", "float", {8: torch.float8_e4m3fn}, ("tensor", "channel", "block"),
                                     asymmetric=False, act_granularities={8: ("token", "tensor", "group")}))
NUMBER_TYPES.add("mxfp", NumberType("mxfp", "float", {4: torch.float8_e4m3fn, 8: torch.float8_e4m3fn}, ("group",),
                                    asymmetric=False, static_activations=False, group_size=32,
                                    scale_dtype=torch.uint8))
NUMBER_TYPES.add("nvfp", NumberType("nvfp", "float", {4: torch.float8_e4m3fn}, ("group",), asymmetric=False,
                                    static_activations=False, group_size=16, scale_dtype=torch.float8_e4m3fn,
                                    global_scale=True))
_TYPE_OF_PREFIX = {t.prefix: name for name, t in NUMBER_TYPES.items()}


def _check_number(what: str, type_name: str, bits: int, symmetric: bool) -> NumberType:
    number = NUMBER_TYPES.get(type_name)
    if bits not in number.dtypes:
        raise UserError(f"unsupported {what} bits {bits} for {type_name} codes: use one of {tuple(number.dtypes)}")
    if not symmetric and not number.asymmetric:
        raise UserError(f"{type_name} {what}s are symmetric only (no zero point): use -sym")
    return number


class _Coded:
    """What a spec's ``type`` and ``bits`` say about its codes."""

    @property
    def number(self) -> NumberType:
        return NUMBER_TYPES[self.type]

    @property
    def code_dtype(self) -> torch.dtype:
        return self.number.dtypes[self.bits]


@dataclass(frozen=True)
class WeightSpec(_Coded):
    bits: int
    symmetric: bool = True
    granularity: str = "group"  # tensor | channel | group | block
    group_size: int | None = 128  # the group width, or the block edge (per-block: square blocks)
    type: str = "int"  # number type (NUMBER_TYPES): int | float (8 bits: E4M3) | mxfp | nvfp

    def __post_init__(self):
        number = _check_number("weight", self.type, self.bits, self.symmetric)
        if self.granularity not in GRANULARITIES:
            raise UserError(f"unknown granularity {self.granularity!r}: use one of {GRANULARITIES}")
        if self.granularity not in number.granularities:
            raise UserError(f"{self.type} weights take per-{' or per-'.join(number.granularities)} scales, "
                            f"not per-{self.granularity}")
        if self.granularity in ("group", "block") and (not self.group_size or self.group_size < 1):
            raise UserError(f"per-{self.granularity} quantization needs a positive {self.granularity} size, got "
                            f"{self.group_size}")
        if number.microscaled and self.group_size != number.group_size:
            raise UserError(f"{self.type}{self.bits} groups are {number.group_size} wide (the format's block), not "
                            f"{self.group_size}: use w{number.prefix}{self.bits}g{number.group_size}-sym")
        if self.granularity not in ("group", "block") and self.group_size is not None:
            object.__setattr__(self, "group_size", None)

    @property
    def qmin(self) -> int | float:
        return self.number.qrange(self.bits)[0]

    @property
    def qmax(self) -> int | float:
        return self.number.qrange(self.bits)[1]

    @property
    def label(self) -> str:
        gran = {"tensor": "t", "channel": "ch", "group": f"g{self.group_size}", "block": f"b{self.group_size}"}
        return f"w{self.number.prefix}{self.bits}{gran[self.granularity]}-{'sym' if self.symmetric else 'asym'}"


@dataclass(frozen=True)
class ActSpec(_Coded):
    """Input-activation quantization of Linear layers: 8-bit int or fp8, per-token dynamic or per-tensor static;
    4-bit int, dynamic per token or per group of ``group_size`` columns (simulated kernel); or a microscaling format
    (MXFP4, NVFP4, MXFP8), dynamic per group of its block (NVFP4's group scales sit under a per-tensor global scale
    calibrated per layer: ``calibrated_global``)."""

    bits: int = 8
    granularity: str = "token"  # token | tensor | group (microscaling formats)
    dynamic: bool = True
    symmetric: bool = True
    type: str = "int"  # number type, as WeightSpec.type
    group_size: int | None = None  # microscaling: the format's block

    def __post_init__(self):
        number = _check_number("activation", self.type, self.bits, self.symmetric)
        if number.microscaled:
            if (self.granularity, self.group_size, self.dynamic) != ("group", number.group_size, True):
                raise UserError(f"{self.type} activations are quantized dynamically per group of "
                                f"{number.group_size}: use a{number.prefix}{self.bits}g{number.group_size}-dyn")
            return
        granularities = number.act_granularities.get(self.bits)
        if granularities is None:
            raise UserError(f"{self.type} activation bits {self.bits} not supported: use one of "
                            f"{tuple(number.act_granularities)}")
        if self.granularity not in granularities:
            raise UserError(f"activation granularity {self.granularity!r}: use {' or '.join(granularities)}")
        if self.granularity == "group" and (not self.group_size or self.group_size < 1):
            raise UserError(f"per-group activations need a positive group size, got {self.group_size}")
        if self.granularity == "group" and not self.dynamic:
            raise UserError(f"per-group activation scales are dynamic only: use a{number.prefix}{self.bits}"
                            f"g{self.group_size}-dyn")
        if not self.dynamic and self.bits != 8:
            raise UserError(f"{self.label}: static activation scales are 8-bit only; use "
                            f"{self.label.removesuffix('-static')}-dyn")
        if not self.dynamic and not number.static_activations:
            raise UserError(f"static {self.type} activation scales are not built: use dynamic per-token "
                            f"(a{number.prefix}{self.bits}tok-dyn)")

    @property
    def calibrated_global(self) -> bool:
        """Whether its dynamic group scales sit under a per-tensor global scale calibrated per layer (NVFP4)."""
        return self.number.global_scale

    @property
    def qmax(self) -> int | float:
        """Symmetric activation codes lie in [-qmax, qmax] (int8: 127, fp8: 448)."""
        return self.number.qrange(self.bits)[1]

    @property
    def label(self) -> str:
        gran = {"token": "tok", "tensor": "t", "group": f"g{self.group_size}"}[self.granularity]
        return f"a{self.number.prefix}{self.bits}{gran}-{'dyn' if self.dynamic else 'static'}"


@dataclass(frozen=True)
class QuantScheme:
    weights: WeightSpec | None
    activations: ActSpec | None = None
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    pad: bool = False  # pad input widths a group size does not divide, instead of refusing
    head: WeightSpec | None = None  # the LM head's own weight-only scheme (``@head=``), None: as ``ignore`` says

    @property
    def head_scheme(self) -> QuantScheme | None:
        """The scheme that quantizes the LM head alone once the body is quantized (what else ``ignore`` keeps dense
        stays so), or None without ``@head=``."""
        return QuantScheme(self.head, ignore=tuple(p for p in self.ignore if p != "lm_head")) if self.head else None

    @property
    def static_activations(self) -> bool:
        """Whether its activations use calibrated per-tensor input scales."""
        return self.activations is not None and not self.activations.dynamic

    @property
    def calibrated_global(self) -> bool:
        """Whether its activations' per-tensor global scales are calibrated when it is quantized (NVFP4)."""
        return self.activations is not None and self.activations.calibrated_global

    @property
    def label(self) -> str:
        if self.weights is None:
            return "none"
        parts = [self.weights.label]
        if self.activations:
            parts.append(self.activations.label)
        text = "_".join(parts)
        if tuple(self.ignore) != DEFAULT_IGNORE:
            text += "@ignore=" + ",".join(self.ignore)
        return text + ("+pad" if self.pad else "") + (f"@head={self.head.label}" if self.head else "")

    def __str__(self) -> str:
        return self.label


PRESETS: Registry[QuantScheme] = Registry("scheme preset")


def register_preset(name: str, scheme: QuantScheme) -> QuantScheme:
    """Make ``scheme`` available as ``--scheme NAME`` (case-insensitive)."""
    return PRESETS.add(name.upper(), scheme)


register_preset("W8A16", QuantScheme(WeightSpec(8, True, "channel")))
register_preset("W4A16", QuantScheme(WeightSpec(4, True, "group", 128)))
register_preset("W4A16_ASYM", QuantScheme(WeightSpec(4, False, "group", 128)))
register_preset("W8A8", QuantScheme(WeightSpec(8, True, "channel"), ActSpec(8, "token", True)))
register_preset("INT8", PRESETS["W8A8"])
register_preset("W4A8", QuantScheme(WeightSpec(4, True, "group", 128), ActSpec(8, "token", True)))
register_preset("FP8", QuantScheme(WeightSpec(8, True, "tensor", type="float"),
                                   ActSpec(8, "tensor", False, type="float")))
register_preset("FP8_DYNAMIC", QuantScheme(WeightSpec(8, True, "channel", type="float"),
                                           ActSpec(8, "token", True, type="float")))
register_preset("FP8_BLOCK", QuantScheme(WeightSpec(8, True, "block", 128, type="float"),
                                         ActSpec(8, "group", True, type="float", group_size=128)))
register_preset("FP8A16", QuantScheme(WeightSpec(8, True, "channel", type="float")))
register_preset("MXFP4A16", QuantScheme(WeightSpec(4, True, "group", 32, type="mxfp")))
register_preset("NVFP4A16", QuantScheme(WeightSpec(4, True, "group", 16, type="nvfp")))
register_preset("MXFP8A16", QuantScheme(WeightSpec(8, True, "group", 32, type="mxfp")))
register_preset("MXFP4", QuantScheme(PRESETS["MXFP4A16"].weights,
                                     ActSpec(4, "group", True, type="mxfp", group_size=32)))
register_preset("NVFP4", QuantScheme(PRESETS["NVFP4A16"].weights,
                                     ActSpec(4, "group", True, type="nvfp", group_size=16)))
register_preset("MXFP8", QuantScheme(PRESETS["MXFP8A16"].weights,
                                     ActSpec(8, "group", True, type="mxfp", group_size=32)))

_LABEL = re.compile(
    r"^w(?P<wtype>[a-z]*)(?P<wbits>\d+)(?P<gran>t|ch|g(?P<group>\d+)|b(?P<block>\d+))-(?P<wsym>sym|asym)"
    r"(?:_a(?P<atype>[a-z]*)(?P<abits>\d+)(?P<agran>tok|t|g(?P<agroup>\d+))-(?P<adyn>dyn|static))?"
    r"(?:@ignore=(?P<ignore>[\w.,*-]*))?(?P<pad>\+pad)?$"
)


def parse_scheme(text: str) -> QuantScheme:
    """A preset name (case-insensitive), ``none``, or a compact label, each optionally followed by ``@head=`` and a
    weight-only label; anything else is a UserError."""
    body, sep, head_text = text.partition("@head=")
    scheme = _parse_body(body)
    if not sep:
        return scheme
    head = _parse_body(head_text) if head_text else QuantScheme(None)
    if head.weights is None or head.activations or head.pad or head.head or head.ignore != DEFAULT_IGNORE:
        raise UserError(f"{text!r}: @head= takes a weight-only label such as w8ch-sym or w4g32-asym, "
                        f"not {head_text!r}")
    if scheme.weights is None:
        raise UserError(f"{text!r}: @head= follows a weight scheme for the body, e.g. w4g32-sym@head=w8ch-sym")
    if not is_ignored(scheme, "lm_head"):
        raise UserError(f"{text!r}: the body's scheme already quantizes lm_head (its @ignore= leaves it out); "
                        "keep lm_head in @ignore= to give it its own scheme with @head=")
    return replace(scheme, head=head.weights)


def _parse_body(text: str) -> QuantScheme:
    if text.lower() == "none":
        return QuantScheme(None)
    preset, suffix, ignore = text.partition("@ignore=")
    if preset.upper() in PRESETS:  # a preset, with its own ignore list if one follows
        scheme = PRESETS[preset.upper()]
        return replace(scheme, ignore=tuple(x for x in ignore.split(",") if x)) if suffix else scheme
    m = _LABEL.match(text.strip().lower())
    if not m:
        raise UserError(f"unknown scheme {text!r}: use a preset ({', '.join(PRESETS)}) or a label like "
                        "w4g32-asym, w8ch-sym_a8tok-dyn, wfp8ch-sym_afp8tok-dyn, wfp8b128-sym, wmxfp4g32-sym")
    gran = {"t": "tensor", "ch": "channel"}.get(m["gran"], "block" if m["block"] else "group")
    size = m["group"] or m["block"]
    weights = WeightSpec(int(m["wbits"]), m["wsym"] == "sym", gran, int(size) if size else None,
                         _number_type(m["wtype"], text))
    acts = None
    if m["abits"]:
        acts = ActSpec(int(m["abits"]), {"tok": "token", "t": "tensor"}.get(m["agran"], "group"), m["adyn"] == "dyn",
                       type=_number_type(m["atype"], text), group_size=int(m["agroup"]) if m["agroup"] else None)
    ignore = tuple(x for x in m["ignore"].split(",") if x) if m["ignore"] is not None else DEFAULT_IGNORE
    return QuantScheme(weights, acts, ignore, bool(m["pad"]))


def _number_type(prefix: str, text: str) -> str:
    if prefix not in _TYPE_OF_PREFIX:
        floats = ", ".join(p for p in _TYPE_OF_PREFIX if p)
        raise UserError(f"unknown number type {prefix!r} in scheme {text!r}: integer bits take no prefix "
                        f"(w4g32-sym), float bits one of: {floats} (wfp8ch-sym, wmxfp4g32-sym)")
    return _TYPE_OF_PREFIX[prefix]


def with_group_size(scheme: QuantScheme, group_size: int) -> QuantScheme:
    return replace(scheme, weights=replace(scheme.weights, granularity="group", group_size=group_size))


def check_group_fits(scheme: QuantScheme, name: str, in_features: int) -> None:
    """Refuse a group size that does not divide a layer's input width (unless padding was asked for); an
    activation group size must divide the (padded) width either way."""
    act, width = scheme.activations, padded_width(scheme, in_features)
    if act is not None and act.granularity == "group" and width % act.group_size:
        fits = [g for g in (16, 32, 64, 128, 256) if width % g == 0]
        raise UserError(f"activation group size {act.group_size} does not divide {name}'s input width {width}; use "
                        f"one that does (a{act.number.prefix}{act.bits}g<N>-dyn, N in {fits})")
    w = scheme.weights
    if w is None or w.granularity != "group" or in_features % w.group_size == 0 or scheme.pad:
        return
    fits = [g for g in (16, 32, 64, 128, 256) if in_features % g == 0]
    raise UserError(f"group size {w.group_size} does not divide {name}'s input width {in_features}; "
                    f"use one of {fits} or add +pad to the scheme")


def is_ignored(scheme: QuantScheme, name: str) -> bool:
    """A module stays dense when an ignore entry equals its name, its last components, or glob-matches it."""
    return any(name == p or name.endswith("." + p) or fnmatchcase(name, p) for p in scheme.ignore)


def padded_width(scheme: QuantScheme, in_features: int) -> int:
    """The input width codes are stored at: rounded up to the group size for ``+pad`` schemes."""
    w = scheme.weights
    if not scheme.pad or w is None or w.granularity != "group":
        return in_features
    return -(-in_features // w.group_size) * w.group_size
