"""The weight-method registry and the data a method receives and returns.

Note for quant.quantize (Q1): ``QuantResult.input_scale`` was removed. AWQ folds its per-channel scales into
the preceding RMSNorm / Linear in ``WeightMethod.transform`` (quant/folding.py), so no layer needs a runtime
input scale.

Contract of ``quantize_model`` with a method (one pass, statistics from the full-precision model):

1. ``names`` = the Linear layers to quantize (scheme.ignore applied), as ``model.named_modules()`` names;
2. if ``method.needs``: ``stats = collect_layer_stats(lm, calibration_batches(calib, lm), names,
   need=method.needs)`` (quant/calibration.py), else ``stats = {}``;
3. ``info = method.transform(lm, stats, spec)`` once, before any layer is quantized. It may rewrite the
   full-precision model as long as the model stays mathematically equivalent (AWQ folds scales into norms and
   preceding Linears) and it keeps ``stats`` describing the rewritten layers' inputs;
4. for each name: ``method.quantize_weight(module.weight, spec, stats.get(name))`` -> ``QuantResult``
   (read the weight *after* step 3).

Layers that share an input (q/k/v, gate/up) may share one ``LayerStats`` object.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.errors import UserError
from runtime.registry import Registry
from quant.scheme import WeightSpec

STAT_KINDS = ("hessian", "abs_mean", "abs_max", "samples")


@dataclass
class LayerStats:
    """Calibration statistics of one Linear layer's input, gathered by forward hooks.

    hessian: sum of x xᵀ over calibration tokens [in, in] (float64), for GPTQ.
    abs_mean: mean |x| per input channel [in], for AWQ/SmoothQuant.
    abs_max: max |x| per input channel [in].
    samples: a random subsample of input rows [n, in] (float32), for output-error searches.
    n_tokens: how many tokens were seen.
    """

    hessian: torch.Tensor | None = None
    abs_mean: torch.Tensor | None = None
    abs_max: torch.Tensor | None = None
    samples: torch.Tensor | None = None
    n_tokens: int = 0

    def scale_inputs(self, s: torch.Tensor) -> None:
        """Describe inputs divided channel-wise by ``s`` (what a folded scale does to this layer's input)."""
        inv = 1.0 / s
        if self.hessian is not None:
            inv64 = inv.double()
            self.hessian = self.hessian * inv64[:, None] * inv64[None, :]
        if self.abs_mean is not None:
            self.abs_mean = self.abs_mean * inv
        if self.abs_max is not None:
            self.abs_max = self.abs_max * inv
        if self.samples is not None:
            self.samples = self.samples * inv


@dataclass
class QuantResult:
    """Codes [out, in] (``spec.code_dtype``), scale/zero per ``qmath`` layout, the per-tensor global scale of
    formats that have one (NVFP4, ``qmath.global_scale``), and method diagnostics."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    info: dict = field(default_factory=dict)
    global_scale: torch.Tensor | None = None


class WeightMethod:
    """A weight quantization method; ``needs`` lists the ``LayerStats`` fields it reads (empty: no calibration)."""

    name: str = ""
    needs: tuple[str, ...] = ()
    types: tuple[str, ...] = ("int",)  # number types (quant.scheme.NUMBER_TYPES) of the codes it can produce
    granularities: tuple[str, ...] = ("tensor", "channel", "group")  # of the scales it can produce
    rotation_refusal: str | None = None  # why it cannot run on a rotated model (quant/rotation.py), if it cannot

    @property
    def needs_calibration(self) -> bool:
        return bool(self.needs)

    def can(self, spec: WeightSpec) -> bool:
        """Whether it produces this weight format's codes and scales."""
        return spec.type in self.types and spec.granularity in self.granularities

    def transform(self, lm, stats: dict[str, LayerStats], spec: WeightSpec) -> dict:
        """Model-level rewrite before per-layer quantization (see the module docstring); returns diagnostics."""
        return {}

    def quantize_weight(self, weight: torch.Tensor, spec: WeightSpec, stats: LayerStats | None) -> QuantResult:
        raise NotImplementedError


METHODS: Registry[WeightMethod] = Registry("method")


def register_method(cls: type[WeightMethod]) -> type[WeightMethod]:
    """Class decorator: an instance of ``cls`` becomes ``--method cls.name``."""
    METHODS.add(cls.name, cls())
    return cls


def get_method(name: str, spec: WeightSpec | None = None) -> WeightMethod:
    """The method named ``name``; with ``spec``, a UserError when it cannot produce that scheme's codes."""
    method = METHODS.get(name)
    if spec is not None and not method.can(spec):
        able = ", ".join(sorted(n for n, m in METHODS.items() if m.can(spec)))
        what = spec.type if spec.type not in method.types else f"per-{spec.granularity}"
        raise UserError(f"method {name!r} cannot quantize {what} weights ({spec.label}): use {able}")
    return method


def require_stats(method: WeightMethod, stats: LayerStats | None) -> LayerStats:
    """The layer's statistics, or a UserError saying the method needs calibration data."""
    missing = [k for k in method.needs if stats is None or getattr(stats, k) is None]
    if missing:
        raise UserError(f"method {method.name!r} needs calibration statistics ({', '.join(missing)}); "
                        "pass a calibration source (--calib wikitext2|self|PATH.jsonl)")
    return stats
