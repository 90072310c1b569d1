"""The search space: backend x weight scheme (+ method) x activation scheme x KV scheme x proposer x K.

Declared in a small YAML file (``studies/spaces/*.yaml``) and overridable by CLI flags. Each Optuna trial
samples one ``TrialConfig``; points a backend cannot run are rejected by the registered validity checks,
which return a reason (the search prunes the trial and stores the reason) instead of crashing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import yaml

from runtime.errors import UserError
from quant.scheme import parse_scheme, check_group_fits
from quant.methods import METHODS
from runtime.loading import read_config
from runtime.model_store import resolve_model
from quant.kvcache import parse_kv_spec, vllm_kv_cache_dtype
from specdec.proposers import PROPOSERS
from evals.backends.vllm_engine import speculative_config
from quant.vllm_support import vllm_support
from evals.backends.base import ServingConfig

SPACES_DIR = Path(__file__).parent / "spaces"
BACKENDS = ("native", "vllm")
NONE = "none"


@dataclass(frozen=True)
class TrialConfig:
    """One point of the space: everything that decides speed and quality of a serving configuration."""

    model: str = "default"
    backend: str = "native"
    weights: str = NONE  # weight scheme label, e.g. w4g32-asym
    method: str | None = None  # weight method (rtn, gptq, ...) when weights are quantized
    activations: str = NONE  # activation part of the scheme, e.g. a8tok-dyn
    kv: str = NONE  # KV-cache spec, e.g. int8
    proposer: str = NONE  # proposer spec, e.g. ngram:min=2,max=4
    k: int | None = None  # speculated tokens per step when a proposer is set

    @property
    def scheme(self) -> str:
        """The combined quant.scheme label (``none``, ``w8ch-sym``, ``w8ch-sym_a8tok-dyn``)."""
        if self.weights == NONE:
            return NONE
        return self.weights if self.activations == NONE else f"{self.weights}_{self.activations}"

    @property
    def speculative(self) -> bool:
        return self.proposer != NONE

    @property
    def transformation(self) -> "TrialConfig":
        """The same model transformation without speculation: exact verification makes quality depend on this only."""
        return replace(self, proposer=NONE, k=None)

    @property
    def quality_key(self) -> str:
        """Cache key of quality: model, scheme, method and KV format (not the proposer, not the backend:
        quality is scored once on the native runtime and vLLM points of the same transformation reuse it)."""
        return f"{self.model}|{self.scheme}|{self.method or '-'}|kv={self.kv}"

    @property
    def label(self) -> str:
        parts = [self.scheme + (f"+{self.method}" if self.method else "")]
        if self.kv != NONE:
            parts.append(f"kv-{self.kv}")
        if self.speculative:
            parts.append(f"{self.proposer} K={self.k}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrialConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class SearchSpace:
    """Choices per dimension; ``k`` is an inclusive [low, high] range used only with a proposer."""

    model: str = "default"
    backends: list[str] = field(default_factory=lambda: ["native"])
    weights: list[str] = field(default_factory=lambda: [NONE])
    methods: list[str] = field(default_factory=lambda: ["rtn"])
    activations: list[str] = field(default_factory=lambda: [NONE])
    kv: list[str] = field(default_factory=lambda: [NONE])
    proposers: list[str] = field(default_factory=lambda: [NONE])
    k: tuple[int, int] = (1, 8)

    def __post_init__(self):
        for name in ("backends", "weights", "methods", "activations", "kv", "proposers"):
            values = getattr(self, name)
            if isinstance(values, str):
                values = [v.strip() for v in values.split(",") if v.strip()]
            if not values:
                raise UserError(f"empty search space: `{name}` has no choices; list at least one (e.g. none)")
            setattr(self, name, [str(v) for v in values])
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad:
            raise UserError(f"unknown backend(s) {bad}: use {', '.join(BACKENDS)}")
        k = list(self.k) if isinstance(self.k, (list, tuple)) else [self.k, self.k]
        if len(k) != 2 or not 1 <= int(k[0]) <= int(k[1]) <= 64:
            raise UserError(f"k must be a range [low, high] with 1 <= low <= high <= 64, got {self.k}")
        self.k = (int(k[0]), int(k[1]))

    @property
    def size(self) -> int:
        """Number of distinct points (K counted only for speculative points)."""
        n_weights = sum(len(self.methods) if w != NONE else 1 for w in self.weights)
        n_spec = sum((self.k[1] - self.k[0] + 1) if p != NONE else 1 for p in self.proposers)
        return len(self.backends) * n_weights * len(self.activations) * len(self.kv) * n_spec

    def reference(self) -> TrialConfig:
        """The unquantized, non-speculative point on the first backend: the speedup and accuracy baseline."""
        return TrialConfig(model=self.model, backend=self.backends[0])

    def suggest(self, trial) -> TrialConfig:
        """Sample a point with Optuna's define-by-run API (method and K are conditional parameters)."""
        weights = trial.suggest_categorical("weights", self.weights)
        proposer = trial.suggest_categorical("proposer", self.proposers)
        return TrialConfig(
            model=self.model,
            backend=trial.suggest_categorical("backend", self.backends),
            weights=weights,
            method=trial.suggest_categorical("method", self.methods) if weights != NONE else None,
            activations=trial.suggest_categorical("activations", self.activations),
            kv=trial.suggest_categorical("kv", self.kv),
            proposer=proposer,
            k=trial.suggest_int("k", *self.k) if proposer != NONE else None,
        )

    @staticmethod
    def params_of(config: TrialConfig) -> dict:
        """Optuna parameters that reproduce ``config`` (for ``study.enqueue_trial``)."""
        params = {"backend": config.backend, "weights": config.weights, "activations": config.activations,
                  "kv": config.kv, "proposer": config.proposer}
        if config.method is not None:
            params["method"] = config.method
        if config.k is not None:
            params["k"] = config.k
        return params

    def to_dict(self) -> dict:
        return {**asdict(self), "k": list(self.k)}


def load_space(path: str | Path | None = None, **overrides) -> SearchSpace:
    """Read a space from YAML (a name in studies/spaces/ or a path), then apply non-None CLI overrides."""
    data: dict = {}
    if path is not None:
        file = Path(path)
        if not file.exists() and (SPACES_DIR / f"{path}.yaml").exists():
            file = SPACES_DIR / f"{path}.yaml"
        if not file.exists():
            names = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
            raise UserError(f"search space {path!r} not found: pass a YAML path or one of {names}")
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as exc:
            raise UserError(f"{file}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise UserError(f"{file}: a search space is a mapping of dimension -> choices")
    known = {f.name for f in fields(SearchSpace)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"unknown search-space key(s) {unknown}: use {', '.join(sorted(known))}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return SearchSpace(**data)


# ---- validity checks: each returns None (runnable) or the reason the point is skipped ----

Check = Callable[[TrialConfig], "str | None"]
CHECKS: dict[str, Check] = {}


def register_check(name: str):
    def wrap(fn: Check) -> Check:
        CHECKS[name] = fn
        return fn
    return wrap


def invalid_reason(config: TrialConfig) -> str | None:
    """The first reason any registered check gives for not running ``config``; None when it can run."""
    for name, check in CHECKS.items():
        try:
            reason = check(config)
        except UserError as exc:
            reason = str(exc)
        if reason:
            return f"{name}: {reason}"
    return None


@register_check("scheme")
def _scheme_parses(config: TrialConfig) -> str | None:
    if config.weights == NONE and config.activations != NONE:
        return f"activation quantization ({config.activations}) needs a weight scheme"
    parse_scheme(config.scheme)
    return None


@register_check("method")
def _method_known(config: TrialConfig) -> str | None:
    if config.method is not None and config.method not in METHODS:
        return f"unknown weight method {config.method!r} (registered: {', '.join(METHODS)})"
    return None


@register_check("group-size")
def _groups_fit_model(config: TrialConfig) -> str | None:
    """Every quantized Linear's input width must be a multiple of the group size (or the scheme pads)."""
    scheme = parse_scheme(config.scheme)
    if scheme.weights is None:
        return None
    cfg = read_config(resolve_model(config.model))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for name, width in (("q/k/v/gate/up_proj", cfg["hidden_size"]), ("down_proj", cfg["intermediate_size"]),
                        ("o_proj", cfg["num_attention_heads"] * head_dim)):
        check_group_fits(scheme, name, width)
    return None


@register_check("kv")
def _kv_runs(config: TrialConfig) -> str | None:
    parse_kv_spec(config.kv)
    if config.backend == "vllm":
        vllm_kv_cache_dtype(config.kv)
    return None


@register_check("proposer")
def _proposer_runs(config: TrialConfig) -> str | None:
    if not config.speculative:
        return None
    name = config.proposer.partition(":")[0]
    if name not in PROPOSERS:
        return f"unknown proposer {name!r} (registered: {', '.join(sorted(PROPOSERS))})"
    if config.backend == "vllm":
        speculative_config(serving_config(config))
    return None


@register_check("vllm-scheme")
def _vllm_runs_scheme(config: TrialConfig) -> str | None:
    if config.backend == "vllm":
        vllm_support(config.scheme)
    return None


def serving_config(config: TrialConfig, **extra):
    """The benchmark harness's ``ServingConfig`` for a trial point."""
    return ServingConfig(model=config.model, scheme=config.scheme, method=config.method or "rtn", kv=config.kv,
                         spec=config.proposer if config.speculative else None, backend=config.backend,
                         **({"k": config.k} if config.k else {}), **extra)
