"""One configuration point, parsed once: model, dtype, weight scheme (+ method, calibration, rotation), activation
scheme, KV format, proposer + K, backend, attention, device, SmoothQuant alpha, static observer (a static KV spec
such as k8ts-v8ts means calibrated KV scales).

``Config`` holds the round-trip-able string forms (stored in Optuna user_attrs, records, cache keys) and, parsed
once in ``__post_init__``, the typed parts: ``scheme`` (quant.scheme.QuantScheme), ``kv_spec``
(quant.kvcache.KVQuantSpec or None) and ``proposer_spec`` (specdec.proposers.base.ProposerSpec or None). A bad
string fails here, in one line, before anything loads. ``"none"`` is the one spelling of "not set" for the
weights, activations, KV format and proposer (None, "" and "none" are all read as "none"; ``method`` is None
when the weights are not quantized, else the method, rtn unless given). ``Config.parse`` is the one entry point
from user strings; the rules every point obeys (activations need a weight scheme, K in 1..MAX_K, dtype bf16 by
default as for every command) are checked here, once.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import specdec.proposers  # noqa: F401  (registers the proposers parse_proposer_spec checks names against)
from quant.calibration import CalibConfig
from quant.kvcache import KVQuantSpec, parse_kv_spec
from quant.rotation import check_rotation, parse_rotate
from quant.scheme import QuantScheme, parse_scheme
from runtime.errors import UserError
from runtime.hardware import device_kind
from runtime.loading import DEFAULT_DTYPE
from specdec.proposers.base import ProposerSpec, check_k, parse_proposer_spec

NONE = "none"
DEFAULT_K = 4
# the backend a point runs on unless it names one: the reference runtime, where an EvalConfig's reference is scored
DEFAULT_BACKEND = "native"
DTYPES = ("bf16", "fp32")
OBSERVERS = ("mse", "minmax", "percentile")
# fields stored only when they differ from their default (keeps stored dicts of older studies comparable)
_OPTIONAL = {"dtype": DEFAULT_DTYPE, "attention": None, "device": "cpu", "smoothquant": None, "observer": "mse",
             "calib": None, "rotate": None}


def _none(text) -> str:
    if text is None:
        return NONE
    text = str(text).strip()
    return NONE if text.lower() in ("", NONE) else text


@dataclass(frozen=True)
class Config:
    """One point of the configuration space (see the module docstring)."""

    model: str = "default"
    backend: str = DEFAULT_BACKEND
    weights: str = NONE  # weight scheme label, e.g. w4g32-asym (a preset such as W8A8 is split by ``parse``)
    method: str | None = None  # weight method (rtn, gptq, ...) when weights are quantized
    activations: str = NONE  # activation part of the scheme, e.g. a8tok-dyn, a8t-static
    kv: str = NONE  # KV-cache spec, e.g. int8, fp8, kivi4, k8ts-v8ts (static: calibrated scales)
    proposer: str = NONE  # proposer spec without K, e.g. ngram:min=2,max=4
    k: int | None = None  # draft tokens per step when a proposer is set
    dtype: str = DEFAULT_DTYPE  # bf16, the default of every entry point
    attention: str | None = None  # None = the loader's default
    device: str = "cpu"
    smoothquant: float | None = None  # SmoothQuant alpha (W8A8 schemes)
    observer: str = "mse"  # static activation-scale observer
    calib: CalibConfig | None = None  # calibration set of calibrated methods / static scales (None: default)
    rotate: str | None = None  # rotation before quantizing the weights (quant/rotation.py: hadamard), None = none

    # parsed once, from the strings above
    scheme: QuantScheme = field(init=False, repr=False, compare=False)
    kv_spec: KVQuantSpec | None = field(init=False, repr=False, compare=False)
    proposer_spec: ProposerSpec | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        weights, activations, kv = _none(self.weights), _none(self.activations), _none(self.kv)
        spec = parse_proposer_spec(_none(self.proposer))
        k = self.k if self.k is not None else (spec.k if spec else None)
        if spec is not None and k is None:
            k = DEFAULT_K
        if spec is None:
            k = None
        else:
            check_k(int(k))
        acts = parse_activations(activations)
        scheme = parse_scheme(weights)
        if scheme.weights is None and acts is not None:
            raise UserError(f"activation quantization ({activations}) needs a weight scheme, e.g. w8ch-sym")
        if acts is not None:
            if scheme.activations is not None:
                raise UserError(f"weights {weights!r} already carry activation quantization; give the weight part only")
            scheme = replace(scheme, activations=acts)
        kv_spec = parse_kv_spec(kv)
        if self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        device_kind(self.device)
        if self.observer not in OBSERVERS:
            raise UserError(f"unknown observer {self.observer!r}: use one of {', '.join(OBSERVERS)}")
        if self.smoothquant is not None and not 0 < float(self.smoothquant) < 1:
            raise UserError(f"SmoothQuant alpha must be in (0, 1), got {self.smoothquant}")
        rotate = parse_rotate(self.rotate)
        check_rotation(rotate, self.method or "rtn", scheme, self.smoothquant)
        for name, value in (("weights", weights), ("activations", activations), ("kv", kv),
                            ("proposer", spec.label if spec else NONE), ("k", None if k is None else int(k)),
                            ("method", (self.method or "rtn") if weights != NONE else None), ("rotate", rotate),
                            ("scheme", scheme), ("kv_spec", kv_spec), ("proposer_spec", spec)):
            object.__setattr__(self, name, value)

    # -- construction from user strings ---------------------------------------------------------------------

    @classmethod
    def parse(cls, scheme: str | None = None, spec: str | None = None, **kw) -> "Config":
        """From command-line style strings (the one string entry point): ``scheme`` (a preset or combined label
        such as W8A8, w8ch-sym_a8t-static) is split into weights + activations (an ``activations`` given beside a
        weight-only scheme is kept); ``spec`` is the proposer (a ``k=`` inside it wins over ``k``). Every string is
        parsed here, once; the rules of a point (activations need weights, K in 1..MAX_K) are checked here too."""
        if scheme is not None:
            weights, acts = split_scheme(parse_scheme(_none(scheme)))
            given = _none(kw.get("activations"))
            if acts != NONE and given not in (NONE, acts):
                raise UserError(f"scheme {scheme!r} already carries activations {acts}; drop activations={given!r}")
            kw["weights"], kw["activations"] = weights, acts if acts != NONE else given
        if spec is not None:
            parsed_spec = parse_proposer_spec(_none(spec))
            kw["proposer"] = parsed_spec.label if parsed_spec else NONE
            if parsed_spec is not None and parsed_spec.k is not None:
                kw["k"] = parsed_spec.k
        return cls(**kw)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        names = {f.name for f in fields(cls) if f.init} - {"calib"}
        out = {k: v for k, v in d.items() if k in names}
        if d.get("calib"):
            out["calib"] = CalibConfig(**d["calib"]) if isinstance(d["calib"], dict) else d["calib"]
        return cls(**out)

    def to_dict(self) -> dict:
        """The string form (round-trips through ``from_dict``); optional fields only when set."""
        out = {}
        for f in fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            if f.name in _OPTIONAL and value == _OPTIONAL[f.name]:
                continue
            out[f.name] = {k: str(v) if v is not None and k == "data_dir" else v for k, v in vars(value).items()} \
                if f.name == "calib" else value
        return out

    # -- derived --------------------------------------------------------------------------------------------

    @property
    def scheme_label(self) -> str:
        """The combined quant.scheme label (``none``, ``w8ch-sym``, ``w8ch-sym_a8tok-dyn``)."""
        return self.scheme.label

    @property
    def quantized_weights(self) -> bool:
        return self.scheme.weights is not None

    @property
    def speculative(self) -> bool:
        return self.proposer_spec is not None

    @property
    def static_activations(self) -> bool:
        return self.scheme.static_activations

    @property
    def needs_w8a8_path(self) -> bool:
        """Static activation scales or SmoothQuant: built by ``quant.quantize.quantize_w8a8``."""
        return self.static_activations or self.smoothquant is not None

    @property
    def needs_kv_calibration(self) -> bool:
        """A static KV spec (e.g. k8ts-v8ts): its scales are calibrated by the builder."""
        return self.kv_spec is not None and self.kv_spec.needs_calibration

    @property
    def transformation(self) -> "Config":
        """The same model transformation without speculation: exact verification makes quality depend on this only."""
        return self.without_spec()

    def without_spec(self) -> "Config":
        return replace(self, proposer=NONE, k=None)

    @property
    def method_key(self) -> str:
        """The method with everything else that changes the weights (calibration set, rotation, SmoothQuant,
        observer)."""
        if not self.quantized_weights:
            return "-"
        key = self.method if self.calib is None else f"{self.method}[{self.calib.label}]"
        if self.rotate is not None:
            key += f"+rot-{self.rotate}"
        if self.smoothquant is not None:
            key += f"+sq{self.smoothquant:g}"
        if self.static_activations:
            key += f"+{self.observer}"
        return key

    @property
    def quality_key(self) -> str:
        """Cache key of quality: model, scheme, method and KV format (not the proposer, not the backend:
        quality is scored once on the native runtime and vLLM points of the same transformation reuse it)."""
        method = "-" if not self.quantized_weights else self.method_key
        return f"{self.model}|{self.scheme_label}|{method}|kv={self.kv}"

    @property
    def spec_label(self) -> str:
        return f"{self.proposer} K={self.k}" if self.speculative else "no spec"

    @property
    def label(self) -> str:
        parts = [self.scheme_label + (f"+{self.method}" if self.method else "")]
        if self.rotate is not None:
            parts.append(f"rot-{self.rotate}")
        if self.smoothquant is not None:
            parts.append(f"sq{self.smoothquant:g}")
        if self.kv != NONE:
            parts.append(f"kv-{self.kv}")
        if self.speculative:
            parts.append(f"{self.proposer} K={self.k}")
        return " ".join(parts)


def split_scheme(scheme: QuantScheme) -> tuple[str, str]:
    """A parsed scheme -> (weights string, activations string); ``combine_scheme`` is the inverse."""
    if scheme.weights is None:
        return NONE, NONE
    acts = scheme.activations.label if scheme.activations else NONE
    label = scheme.label
    weights = label.replace(f"_{acts}", "", 1) if acts != NONE else label
    return weights, acts


def parse_activations(text: str):
    """An activation label (``a8tok-dyn``, ``a8t-static``) -> quant.scheme.ActSpec; ``none`` -> None."""
    if text == NONE:
        return None
    try:
        return parse_scheme(f"w8ch-sym_{text}").activations
    except UserError:
        raise UserError(f"unknown activation scheme {text!r}: use none, a8tok-dyn, a8t-static, afp8tok-dyn or afp8t-static") from None
