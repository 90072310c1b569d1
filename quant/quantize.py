"""Quantize a loaded model in place: rotate it if asked (``rotate``: quant/rotation.py), pick the Linear layers,
calibrate if the method needs it, replace each layer by a ``QuantizedLinear`` running the best registered kernel,
and report what happened per layer."""
from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from rich.progress import track
from torch import nn

from runtime.errors import UserError
from runtime.loading import LoadedModel
from quant.actquant import calibrate_input_scales, check_scale, observe_linear_inputs
from quant.calibration import CalibConfig, calibration_batches, collect_layer_stats
from quant.methods import LayerStats, get_method
from quant.smoothquant import apply_smoothquant
from quant.w8a8 import STATIC_NEEDS, dynamic_twin, runs_static, set_static_input_scales
from quant import store
from quant.qlinear import QuantizedLinear
from quant.rotation import apply_rotation, check_rotation
from quant.scheme import QuantScheme, check_group_fits, is_ignored, padded_width, parse_scheme


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]  # [out, in]
    kernel: str
    simulated: bool
    bytes_before: int  # dense weight in the model dtype
    bytes_after: int  # stored format: packed codes + scales (+ zeros)
    weight_rel_error: float  # ||W - Ŵ||_F / ||W||_F
    output_rel_error: float | None  # ||X (W - Ŵ)ᵀ|| / ||X Wᵀ|| on calibration samples, when available
    seconds: float
    info: dict = field(default_factory=dict)


@dataclass
class QuantReport:
    scheme: QuantScheme
    method: str
    dtype: str
    calibration: str | None
    layers: list[LayerReport]
    dense: list[str]  # Linear layers left unquantized (ignored or tied to the embedding)
    transform: dict
    seconds: float
    rotate: str | None = None  # the rotation applied before quantization (quant/rotation.py), None for none
    stored: str | None = None  # the disk entry its calibrated layers were read from (quant/store.py), None: made here

    @property
    def simulated(self) -> bool:
        return any(layer.simulated for layer in self.layers)

    @property
    def kernels(self) -> dict[str, int]:
        return dict(Counter(layer.kernel for layer in self.layers))

    @property
    def bytes_before(self) -> int:
        return sum(layer.bytes_before for layer in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(layer.bytes_after for layer in self.layers)

    @property
    def mean_weight_error(self) -> float:
        return sum(layer.weight_rel_error for layer in self.layers) / len(self.layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["scheme"] = self.scheme.label
        d.update(simulated=self.simulated, kernels=self.kernels, bytes_before=self.bytes_before,
                 bytes_after=self.bytes_after, mean_weight_rel_error=self.mean_weight_error)
        return d


def quantizable_linears(model: nn.Module, scheme: QuantScheme) -> tuple[list[str], list[str]]:
    """(Linear layers to quantize, Linear layers kept dense). The LM head is quantized only where the scheme's
    ignore list leaves it out (``@ignore=`` with no ``lm_head``); a tied one is then untied by ``quantize_model``,
    so the embedding lookup stays dense."""
    chosen, dense = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            (dense if is_ignored(scheme, name) else chosen).append(name)
    return chosen, dense


def plan_layers(lm: LoadedModel, scheme: QuantScheme) -> tuple[list[str], list[str]]:
    """``quantizable_linears`` plus the checks that need no work: something to quantize, groups that fit."""
    names, dense = quantizable_linears(lm.model, scheme)
    if not names:
        raise UserError(f"{lm.path}: no Linear layers to quantize (the model has none, or scheme ignore "
                        f"{list(scheme.ignore)} covers them all)")
    for name in names:
        check_group_fits(scheme, name, lm.model.get_submodule(name).in_features)
    return names, dense


def _padded_stats(stats: LayerStats | None, width: int) -> LayerStats | None:
    """Statistics of an input zero-padded to ``width`` columns (padded inputs are always 0)."""
    if stats is None:
        return None
    pad = width - (stats.hessian.shape[0] if stats.hessian is not None else
                   next(t.shape[-1] for t in (stats.abs_mean, stats.abs_max, stats.samples) if t is not None))
    grow = lambda t, dims: None if t is None else F.pad(t, (0, pad) * dims)  # noqa: E731
    return replace(stats, hessian=grow(stats.hessian, 2), abs_mean=grow(stats.abs_mean, 1),
                   abs_max=grow(stats.abs_max, 1), samples=grow(stats.samples, 1))


def _output_error(stats: LayerStats | None, w: torch.Tensor, w_hat: torch.Tensor) -> float | None:
    if stats is None or stats.samples is None:
        return None
    x = stats.samples.float()
    return ((x @ (w - w_hat).T).norm() / (x @ w.T).norm().clamp_min(1e-12)).item()


def calibrate_input_global_scales(lm: LoadedModel, calib, names: list[str]) -> dict[str, torch.Tensor]:
    """NVFP4 activations' per-tensor scale of each named Linear's input: ``range_global_scale`` of the range it took
    over the calibration set (compressed-tensors' ``static_minmax`` observer)."""
    from quant.microscale import range_global_scale  # loads compressed-tensors: these formats only

    batches = [torch.tensor([b]) for b in calibration_batches(calib, lm)]
    observers = observe_linear_inputs(lm.model, batches, names, "minmax")
    return {n: check_scale(range_global_scale(o.range()), f"input global scale of {n}") for n, o in observers.items()}


@torch.no_grad()
def quantize_model(lm: LoadedModel, scheme: QuantScheme | str, method: str = "rtn", calib=None,
                   progress: bool = True, rotate: str | None = None, stored: bool = False) -> QuantReport:
    """Replace ``lm.model``'s Linear layers by quantized ones in place (see module docstring); ``rotate``
    (``hadamard``) rotates the full-precision model first, so calibration and the method see rotated weights.
    ``stored``: ``lm`` is as loaded from ``lm.path``, so a calibrated method's result is read from and kept in the
    disk store (quant/store.py) instead of being calibrated again."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    if scheme.weights is None:
        raise UserError("scheme 'none' quantizes nothing: pick a weight scheme such as W8A16 or w4g32-asym")
    if scheme.static_activations:
        raise UserError(f"{scheme.label}: static activation scales need calibrated input scales, which "
                        "weight quantization does not produce; use dynamic per-token activations (a8tok-dyn)")
    weight_method = get_method(method, scheme.weights)
    check_rotation(rotate, method)
    t_start = time.perf_counter()
    plan_layers(lm, scheme)  # refusals before the rotation changes the model
    rotation = apply_rotation(lm, rotate)
    names, dense = plan_layers(lm, scheme)
    if "lm_head" in names:  # the head's own quantized copy; the embedding stays as it was
        lm.model.untie_lm_head()
    calibrated = weight_method.needs_calibration or scheme.calibrated_global
    if calibrated:
        calib = calib or CalibConfig()
    calibration = calib.label if calibrated else None
    key = store.entry_key(lm.path, lm.precision, scheme.label, weight_method, calib, rotate) \
        if stored and calibrated else None
    made = store.load(key) if key else None
    if made is None:
        made = _calibrate(lm, scheme, weight_method, calib, calibration, names, progress,
                          keep_changed=key is not None)
        if key:
            store.save(key, made)
        stored_at = None
    else:
        for name, tensor in made.changed.items():
            lm.model.get_parameter(name).copy_(tensor)
        for name in names:
            lm.model.set_submodule(name, _quantized_linear(lm.model.get_submodule(name), made, name, scheme, lm.dtype))
        stored_at = str(store.store_dir() / key)
    layers = [_report(name, lm.model.get_submodule(name), made, lm.dtype) for name in names]
    if scheme.head:  # the head alone on the quantized body (a calibrated method sees the body's outputs)
        head = quantize_model(lm, scheme.head_scheme, method, calib, progress)
        layers, dense = layers + head.layers, head.dense
    return QuantReport(scheme, method, lm.precision, made.calibration, layers, dense,
                       made.transform | ({"rotation": rotation} if rotation else {}), time.perf_counter() - t_start,
                       rotation.get("rotate"), stored_at)


def _calibrate(lm: LoadedModel, scheme: QuantScheme, weight_method, calib, calibration: str | None,
               names: list[str], progress: bool, keep_changed: bool) -> store.Calibrated:
    """Run ``weight_method`` on the named layers of ``lm`` (calibrating first if it needs statistics), putting each
    quantized layer in place; ``keep_changed``: also keep the other parameters its transform rewrote."""
    model, spec = lm.model, scheme.weights
    modules = dict(model.named_modules())
    stats: dict[str, LayerStats] = {}
    if weight_method.needs_calibration:
        stats = collect_layer_stats(lm, calibration_batches(calib, lm), names, need=weight_method.needs)
    quantized = {f"{name}.weight" for name in names}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n not in quantized} if keep_changed else {}
    transform = weight_method.transform(lm, stats, spec)
    made = store.Calibrated({}, {}, {n: p.detach().clone() for n, p in model.named_parameters()
                                     if n in before and not torch.equal(p, before[n])},
                            calibrate_input_global_scales(lm, calib, names) if scheme.calibrated_global else {},
                            transform, calibration)
    for name in track(names, description=f"quantizing {scheme.label} ({weight_method.name})", disable=not progress,
                      transient=True):
        linear = modules[name]
        t0 = time.perf_counter()
        w = linear.weight.detach().float()
        width = padded_width(scheme, linear.in_features)
        layer_stats = stats.get(name)
        if width != linear.in_features:
            w_in, layer_stats = F.pad(w, (0, width - linear.in_features)), _padded_stats(layer_stats, width)
        else:
            w_in = w
        made.results[name] = weight_method.quantize_weight(w_in, spec, layer_stats)
        qlinear = _quantized_linear(linear, made, name, scheme, lm.dtype)
        w_hat = qlinear.dequantized_weight()
        model.set_submodule(name, qlinear)
        made.errors[name] = (((w - w_hat).norm() / w.norm().clamp_min(1e-12)).item(),
                             _output_error(stats.get(name), w, w_hat), time.perf_counter() - t0)
    return made


def _quantized_linear(linear: nn.Linear, made: store.Calibrated, name: str, scheme: QuantScheme,
                      dtype: torch.dtype) -> QuantizedLinear:
    qlinear = QuantizedLinear.from_result(made.results[name], scheme.weights, linear.in_features, linear.bias,
                                          scheme.activations, dtype)
    if name in made.input_global_scales:
        qlinear.kernel.set_input_global_scale(made.input_global_scales[name])
    return qlinear


def _report(name: str, qlinear: QuantizedLinear, made: store.Calibrated, dtype: torch.dtype) -> LayerReport:
    weight_error, output_error, seconds = made.errors[name]
    return LayerReport(name, (qlinear.out_features, qlinear.in_features), qlinear.kernel_name, qlinear.simulated,
                       qlinear.out_features * qlinear.in_features * dtype.itemsize, qlinear.format_bytes(),
                       weight_error, output_error, seconds, made.results[name].info)


QUANTIZED_CACHE_SIZE = 3
_quantized_models: dict[tuple, tuple[nn.Module, QuantReport]] = {}


def quantize_fresh(lm: LoadedModel, scheme: QuantScheme | str, method: str = "rtn", calib=None,
                   progress: bool = True, rotate: str | None = None) -> QuantReport:
    """``quantize_model`` for a model just loaded from ``lm.path``: the result is memoised per (checkpoint,
    dtype, scheme, method, calibration set, rotation) in this process, so a search that evaluates quality, speed
    and a greedy twin of one configuration calibrates (GPTQ, AWQ) once, and a calibrated one is kept on disk for
    the next process (quant/store.py). ``lm.model`` gets its own copy, with the
    attention ``lm`` was loaded with (a runtime choice, not part of the quantized weights)."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    calib_label = calib.label if calib is not None else "default"
    key = (str(lm.path), lm.dtype, scheme.label, method, calib_label, rotate)
    if key not in _quantized_models:
        report = quantize_model(lm, scheme, method, calib, progress, rotate, stored=True)
        _quantized_models[key] = (copy.deepcopy(lm.model), report)
        while len(_quantized_models) > QUANTIZED_CACHE_SIZE:
            _quantized_models.pop(next(iter(_quantized_models)))
        return report
    model, report = _quantized_models.pop(key)
    _quantized_models[key] = (model, report)  # most recently used last
    attention = lm.model.attn_implementation
    lm.model = copy.deepcopy(model)
    lm.model.attn_implementation = attention
    return report


def quantize_w8a8(lm, scheme: QuantScheme | str = "W8A8", method: str = "rtn", calib=None,
                  observer: str = "mse", smoothquant: float | None = None, progress: bool = True):
    """Quantize ``lm`` in place to a W8A8 scheme; returns Q1's ``QuantReport`` (with this scheme's label).

    Order: SmoothQuant (if ``smoothquant`` = alpha) on the fp model, then static input scales (if the scheme
    asks for them) observed on the smoothed fp model, then the weight method, then the static switch.
    ``mse`` is the default observer: on the default model minmax and percentile static scales lose far more
    (bench/act_quality.py)."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    if scheme.activations is None:
        raise UserError(f"{scheme.label} has no activation quantization; use W8A8 or a label like w8ch-sym_a8t-static")
    calib = calib or CalibConfig(samples=32)
    static = not scheme.activations.dynamic
    if static and not runs_static(scheme):
        raise UserError(f"{scheme.label}: {STATIC_NEEDS}")
    batches = calibration_batches(calib, lm) if static or smoothquant is not None else []
    transform = {}
    if smoothquant is not None:
        transform["smoothquant"] = apply_smoothquant(lm, smoothquant, batches)
    names, _ = quantizable_linears(lm.model, scheme)
    input_scales = {}
    if static:
        token_batches = [torch.tensor([b]) for b in batches]
        input_scales = calibrate_input_scales(lm.model, token_batches, names, observer, scheme.activations)
    report = quantize_model(lm, dynamic_twin(scheme), method, calib, progress)
    if static:
        set_static_input_scales(lm.model, scheme.activations, input_scales)
        transform["static_input_scales"] = {"observer": observer, "calibration": calib.label}
    calibration = report.calibration or (calib.label if batches else None)
    return replace(report, scheme=scheme, transform={**report.transform, **transform}, calibration=calibration)
