"""The weight-method registry and the data a method receives and returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quant.errors import UserError
from quant.scheme import WeightSpec


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


@dataclass
class QuantResult:
    """Codes [out, in] (int8 storage), scale/zero per ``qmath`` layout, and an optional per-input-channel
    ``input_scale`` s (the layer then computes (x / s) @ (W·s)ᵀ; folded into the previous op on export)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    input_scale: torch.Tensor | None = None
    info: dict = field(default_factory=dict)


class WeightMethod:
    name: str = ""
    needs_calibration: bool = False

    def quantize_weight(self, weight: torch.Tensor, spec: WeightSpec, stats: LayerStats | None) -> QuantResult:
        raise NotImplementedError


METHODS: dict[str, WeightMethod] = {}


def register_method(cls: type[WeightMethod]) -> type[WeightMethod]:
    METHODS[cls.name] = cls()
    return cls


def get_method(name: str) -> WeightMethod:
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"unknown method {name!r}: use one of {', '.join(sorted(METHODS))}") from None
