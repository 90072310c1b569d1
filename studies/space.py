"""The search space: backend x weight scheme (+ method, rotation) x activation scheme x KV scheme x proposer x K.

Declared in a small YAML file (``studies/spaces/*.yaml``) and overridable by CLI flags. Each Optuna trial
samples one ``evals.config.Config``; a combination Config itself refuses (activations without a weight scheme,
weights that already carry activations) and points a backend cannot run are pruned with the reason (Config's
UserError, or the first registered validity check's) instead of crashing. What a backend can run is the
backend's own ``check``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import yaml

from runtime.errors import UserError
from runtime.registry import Registry
from quant.scheme import check_group_fits
from quant.methods import METHODS, get_method
from runtime.loading import read_config
from runtime.model_store import resolve_model
from serving.backends import BACKENDS
from serving.backends.base import ServingConfig
from evals.config import NONE, Config, parse_activations
from quant.kvcache import parse_kv_spec
from quant.rotation import hadamard_matrices, parse_rotate
from runtime.transformer import ModelArgs
from quant.scheme import parse_scheme
from specdec.proposers.base import MAX_K, check_proposer_spec

SPACES_DIR = Path(__file__).parent / "spaces"


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
    smoothquant: list = field(default_factory=lambda: [NONE])  # SmoothQuant alphas (W8A8 activations only)
    rotate: list = field(default_factory=lambda: [NONE])  # rotations before quantizing (quant/rotation.py)

    def __post_init__(self):
        for name in ("backends", "weights", "methods", "activations", "kv", "proposers"):
            values = getattr(self, name)
            if isinstance(values, str):
                values = [v.strip() for v in values.split(",") if v.strip()]
            if not values:
                raise UserError(f"empty search space: `{name}` has no choices; list at least one (e.g. none)")
            setattr(self, name, [str(v) for v in values])
        for b in self.backends:
            BACKENDS.get(b)
        for w in self.weights:  # every string is parsed here, once: a bad one fails the space, not a trial
            parse_scheme(w)
        for a in self.activations:
            parse_activations(a)
        for kv in self.kv:
            parse_kv_spec(kv)
        for p in self.proposers:  # an eagle head is checked against the model here, before any trial
            check_proposer_spec(p, self.model)
        sq = self.smoothquant if isinstance(self.smoothquant, (list, tuple)) else [self.smoothquant]
        self.smoothquant = [NONE if v in (None, NONE) else float(v) for v in sq] or [NONE]
        rotations = [self.rotate] if isinstance(self.rotate, str) or self.rotate is None else self.rotate
        self.rotate = [parse_rotate(r) or NONE for r in rotations] or [NONE]
        k = list(self.k) if isinstance(self.k, (list, tuple)) else [self.k, self.k]
        if len(k) != 2 or not 1 <= int(k[0]) <= int(k[1]) <= MAX_K:
            raise UserError(f"k must be a range [low, high] with 1 <= low <= high <= {MAX_K} (K, draft tokens per "
                            f"step), got {self.k}")
        self.k = (int(k[0]), int(k[1]))

    @property
    def size(self) -> int:
        """Number of distinct points (K counted only for speculative points)."""
        n_weights = sum(len(self.methods) if w != NONE else 1 for w in self.weights)
        n_spec = sum((self.k[1] - self.k[0] + 1) if p != NONE else 1 for p in self.proposers)
        return (len(self.backends) * n_weights * len(self.activations) * len(self.kv) * n_spec * len(self.smoothquant)
                * len(self.rotate))

    def reference(self) -> Config:
        """The unquantized, non-speculative point on the first backend: the speedup and accuracy baseline."""
        return Config(model=self.model, backend=self.backends[0])

    def suggest(self, trial) -> Config:
        """Sample a point with Optuna's define-by-run API (method and K are conditional parameters)."""
        weights = trial.suggest_categorical("weights", self.weights)
        proposer = trial.suggest_categorical("proposer", self.proposers)
        extra = {}
        if self.smoothquant != [NONE]:  # a conditional parameter only in spaces that list alphas
            alpha = trial.suggest_categorical("smoothquant", self.smoothquant)
            extra["smoothquant"] = None if alpha == NONE else alpha
        if self.rotate != [NONE] and weights != NONE:  # likewise: only in spaces that list rotations
            rotation = trial.suggest_categorical("rotate", self.rotate)
            extra["rotate"] = None if rotation == NONE else rotation
        return Config(
            model=self.model,
            backend=trial.suggest_categorical("backend", self.backends),
            weights=weights,
            method=trial.suggest_categorical("method", self.methods) if weights != NONE else None,
            activations=trial.suggest_categorical("activations", self.activations),
            kv=trial.suggest_categorical("kv", self.kv),
            proposer=proposer,
            k=trial.suggest_int("k", *self.k) if proposer != NONE else None,
            **extra,
        )

    @staticmethod
    def params_of(config: Config) -> dict:
        """Optuna parameters that reproduce ``config`` (for ``study.enqueue_trial``)."""
        params = {"backend": config.backend, "weights": config.weights, "activations": config.activations,
                  "kv": config.kv, "proposer": config.proposer}
        if config.method is not None:
            params["method"] = config.method
        if config.k is not None:
            params["k"] = config.k
        if config.smoothquant is not None:
            params["smoothquant"] = config.smoothquant
        if config.rotate is not None:
            params["rotate"] = config.rotate
        return params

    def to_dict(self) -> dict:
        out = {**asdict(self), "k": list(self.k)}
        for name in ("smoothquant", "rotate"):
            if out[name] == [NONE]:
                out.pop(name)  # stored spaces of older studies stay comparable
        return out


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

Check = Callable[[Config], "str | None"]
CHECKS: Registry[Check] = Registry("validity check")
register_check = CHECKS.register


def invalid_reason(config: Config) -> str | None:
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
def _scheme_parses(config: Config) -> str | None:
    if config.smoothquant is not None and config.scheme.activations is None:
        return f"SmoothQuant (alpha {config.smoothquant:g}) needs activation quantization (a W8A8 scheme)"
    return None


@register_check("method")
def _method_known(config: Config) -> str | None:
    if config.method is not None and config.method not in METHODS:
        return f"unknown weight method {config.method!r} (registered: {', '.join(METHODS)})"
    if config.method is not None and config.scheme.weights is not None:
        try:
            get_method(config.method, config.scheme.weights)
        except UserError as exc:
            return str(exc)
    return None


@register_check("group-size")
def _groups_fit_model(config: Config) -> str | None:
    """Every quantized Linear's input width must be a multiple of the group size (or the scheme pads)."""
    scheme = config.scheme
    if scheme.weights is None:
        return None
    cfg = read_config(resolve_model(config.model))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for name, width in (("q/k/v/gate/up_proj", cfg["hidden_size"]), ("down_proj", cfg["intermediate_size"]),
                        ("o_proj", cfg["num_attention_heads"] * head_dim)):
        check_group_fits(scheme, name, width)
    return None


@register_check("rotation")
def _rotation_fits_model(config: Config) -> str | None:
    """A rotation needs Hadamard matrices of the model's hidden, head and intermediate sizes."""
    if config.rotate is not None:
        hadamard_matrices(ModelArgs.from_hf_config(read_config(resolve_model(config.model))))
    return None


@register_check("backend")
def _backend_runs(config: Config) -> str | None:
    """The backend's own ``check``: what it can run (schemes, KV formats, proposers) lives with it."""
    return BACKENDS.get(config.backend).check(config)


def serving_config(config: Config, **extra) -> ServingConfig:
    """The benchmark harness's ``ServingConfig`` for a trial point."""
    return ServingConfig(config, **extra)
