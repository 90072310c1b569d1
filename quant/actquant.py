"""Activation quantization: range observers (registry by name) and int8 / fp8 / int4 activation quantizers (the
microscaling formats' dynamic group quantizer is compressed-tensors' own, in ``quant.microscale``).

Observers watch a stream of rows ``x [n, k]`` and return a clipping range (an absolute max) per column ``[k]``
(``k = 1`` for per-tensor scales): ``minmax`` (running max |x|), ``percentile`` (a high quantile of |x|),
``mse`` (the clipped range minimising the quantization error on the codes' grid: int8, or E4M3 for fp8). Static per-tensor input
scales of Linear layers and static KV-cache scales (quant/kvcache.py) both come from them.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from runtime.errors import UserError
from runtime.registry import Registry
from quant.scheme import ActSpec

STATIC_INT8 = ActSpec(8, "tensor", False)
MAX_SAMPLES = 1 << 20  # about as many values kept by sampling observers (a uniform random sample beyond)


def check_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    """Refuse scales that are zero, negative or non-finite (they would write a broken checkpoint)."""
    if scale.numel() == 0 or not torch.isfinite(scale).all() or (scale <= 0).any():
        raise UserError(f"{what}: calibration produced a zero or non-finite scale; calibrate on real text "
                        "(more samples) or use dynamic scales")
    return scale


class Observer:
    """Tracks ``x [n, k]`` rows; ``range()`` is the clipping range per column."""

    name = ""

    def __init__(self, act: ActSpec = STATIC_INT8):
        self.act = act  # the codes the range is for (only ``mse`` looks at them)
        self.n_seen = 0

    def observe(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        if not torch.isfinite(x).all():
            raise UserError(f"{self.name} observer saw NaN/inf activations; the model or input is broken")
        self.n_seen += x.shape[0]
        self._observe(x.abs())

    def range(self) -> torch.Tensor:
        if self.n_seen == 0:
            raise UserError(f"{self.name} observer saw zero calibration samples; give calibration text "
                            "(raise the number of calibration samples)")
        return self._range()

    def _observe(self, absx: torch.Tensor) -> None:
        raise NotImplementedError

    def _range(self) -> torch.Tensor:
        raise NotImplementedError


class SamplingObserver(Observer):
    """Keeps a uniform random sample of about ``MAX_SAMPLES`` values (rows of |x|) of all it observed: every row
    draws a random key and a row is kept while its key is below ``MAX_SAMPLES / values seen`` (Bernoulli sampling
    at a rate that only falls, so earlier rows are thinned by the same test), pruned when half as many again are
    held. Before, each batch was merged with the kept sample and the union subsampled, which kept the last batches
    at a higher rate than the first (the last of eight batches of half the sample size was a third of the sample),
    and permuted the whole union per batch: 21 s of a 73 s profile of a static W8A8 calibration of the default model
    (AMD EPYC, AVX2, one thread)."""

    def __init__(self, act: ActSpec = STATIC_INT8):
        super().__init__(act)
        self.rows: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []
        self.gen = torch.Generator().manual_seed(0)

    def _observe(self, absx):
        self.capacity = max(1, MAX_SAMPLES // absx.shape[1])
        self.rows.append(absx)
        self.keys.append(torch.rand(absx.shape[0], generator=self.gen))
        self._thin(len(self.rows) - 1)  # its rows over today's rate would never be kept
        if sum(map(len, self.keys)) > 1.5 * self.capacity:
            self._thin(*range(len(self.rows)))

    def _thin(self, *chunks: int) -> None:
        """Drop the rows of the held ``chunks`` whose keys are over the rate."""
        rate = self.capacity / self.n_seen
        for i in chunks if rate < 1 else ():
            kept = (self.keys[i] < rate).nonzero().squeeze(1)
            self.rows[i], self.keys[i] = self.rows[i].index_select(0, kept), self.keys[i].index_select(0, kept)

    @property
    def sample(self) -> torch.Tensor:
        """The kept rows of |x| [n, k]."""
        self._thin(*range(len(self.rows)))
        return torch.cat(self.rows)


OBSERVERS: Registry[type[Observer]] = Registry("observer")


def register_observer(cls: type[Observer]) -> type[Observer]:
    return OBSERVERS.add(cls.name, cls)


def make_observer(name: str, **kwargs) -> Observer:
    return OBSERVERS.get(name)(**kwargs)


@register_observer
class MinMaxObserver(Observer):
    name = "minmax"

    def __init__(self, act: ActSpec = STATIC_INT8):
        super().__init__(act)
        self.absmax: torch.Tensor | None = None

    def _observe(self, absx):
        m = absx.amax(0)
        self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)

    def _range(self):
        return self.absmax


@register_observer
class PercentileObserver(SamplingObserver):
    name = "percentile"

    def __init__(self, act: ActSpec = STATIC_INT8, percentile: float = 99.99):
        super().__init__(act)
        if not 0 < percentile <= 100:
            raise UserError(f"percentile must be in (0, 100], got {percentile}")
        self.q = percentile / 100

    def _range(self):
        return torch.quantile(self.sample.double(), self.q, dim=0).float()


@register_observer
class MSEObserver(SamplingObserver):
    """Searches ``ratio * absmax`` over a grid of ratios for the smallest error of the symmetric codes ``act``
    (int8 rounding, or the E4M3 cast for fp8)."""

    name = "mse"

    def __init__(self, act: ActSpec = STATIC_INT8, grid: int = 50, min_ratio: float = 0.3):
        super().__init__(act)
        self.ratios = torch.linspace(1.0, min_ratio, grid)

    def _range(self):
        x = self.sample
        absmax = x.amax(0)
        best, best_err = absmax.clone(), torch.full_like(absmax, float("inf"))
        for r in self.ratios:
            rng = (absmax * r).clamp_min(torch.finfo(torch.float32).tiny)
            err = self._error(x, rng / self.act.qmax)
            better = err < best_err
            best, best_err = torch.where(better, rng, best), torch.where(better, err, best_err)
        return best

    def _error(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Squared error per column of ``x`` coded under ``scale``. Integer codes: the same rounding and clamp as
        ``_codes`` in place on one buffer, bitwise its result (the int8 round trip is exact) in a third of the time
        (one thread, 1M values)."""
        if self.act.code_dtype.is_floating_point:  # fp8: the cast rounds
            return ((_codes(x, scale, self.act).float() * scale - x) ** 2).sum(0)
        q = x / scale
        return q.round_().clamp_(-self.act.qmax, self.act.qmax).mul_(scale).sub_(x).square_().sum(0)


def _codes(x: torch.Tensor, scale: torch.Tensor, spec: ActSpec) -> torch.Tensor:
    """Symmetric codes of ``x / scale`` in [-qmax, qmax] (int8: rounded; fp8: rounded by the cast)."""
    scaled = spec.number.round(x.float() / scale, spec.bits)
    return torch.clamp(scaled, -spec.qmax, spec.qmax).to(spec.code_dtype)


def quantize_per_token(x: torch.Tensor, spec: ActSpec = ActSpec()) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per row: ``q = round(x / s)``, ``s = max|x_row| / qmax`` (int8: 127, fp8: 448)
    -> (codes, s [.., 1] fp32)."""
    scale = (x.float().abs().amax(-1, keepdim=True) / spec.qmax).clamp_min(torch.finfo(torch.float32).eps)
    return _codes(x, scale, spec), scale


def quantize_per_group(x: torch.Tensor, spec: ActSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per group of ``spec.group_size`` columns -> (codes [.., n_groups, group_size],
    s [.., n_groups, 1] fp32): ``quantize_per_token`` on each group."""
    return quantize_per_token(x.unflatten(-1, (-1, spec.group_size)), spec)


DYNAMIC = {"token": quantize_per_token, "group": quantize_per_group}  # granularity -> dynamic quantizer


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, spec: ActSpec = ActSpec(8, "tensor", False)):
    """Static symmetric codes with one calibrated scale."""
    return _codes(x, scale, spec)


def quantize_activation(x: torch.Tensor, spec: ActSpec, input_scale: torch.Tensor | None = None):
    """(codes in ``spec.code_dtype``, scale broadcastable to the codes) for a Linear input, per ``spec``; per-group
    codes have a group axis (``quantize_per_group``)."""
    if spec.dynamic:
        if spec.granularity not in DYNAMIC:
            raise UserError("dynamic activation scales are per-token or per-group only: use a8tok-dyn, a4g32-dyn, "
                            "or a8t-static")
        return DYNAMIC[spec.granularity](x, spec)
    if input_scale is None:
        raise UserError("static activation scales need calibration: run calibration first or use a8tok-dyn")
    return quantize_per_tensor(x, input_scale, spec), input_scale.reshape(1)


def fake_quantize_activation(x: torch.Tensor, spec: ActSpec, input_scale: torch.Tensor | None = None,
                             global_scale: torch.Tensor | None = None):
    """Quantize-dequantize ``x`` per ``spec`` in its dtype (microscaling formats: compressed-tensors' own, NVFP4's
    under the layer's calibrated ``global_scale``)."""
    if spec.number.microscaled:
        import quant.microscale  # loads compressed-tensors (seconds): only for these formats

        return quant.microscale.fake_quantize_activation(x, spec, global_scale)
    q, scale = quantize_activation(x, spec, input_scale)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)


def input_scale_from_range(absmax: torch.Tensor, act: ActSpec = STATIC_INT8) -> torch.Tensor:
    return absmax.float().reshape(1) / act.qmax


@contextmanager
def watch_linear_inputs(model: nn.Module, names: list[str], observer: str = "minmax", **kwargs):
    """Forward hooks feeding each named Linear's input rows into its own observer (yields the dict)."""
    modules = dict(model.named_modules())
    observers = {n: make_observer(observer, **kwargs) for n in names}
    hooks = [modules[n].register_forward_pre_hook(
        lambda _m, args, o=observers[n]: o.observe(args[0].reshape(-1, 1))) for n in names]
    try:
        yield observers
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()  # not inference_mode: the scales become buffers of modules used outside it
def observe_linear_inputs(model, batches: list[torch.Tensor], names: list[str], observer: str = "minmax",
                          **kwargs) -> dict[str, Observer]:
    """Each named Linear's input observer after the token batches [B, T] ran through ``model``."""
    if not batches:
        raise UserError("calibration needs at least one sample; give calibration text")
    with watch_linear_inputs(model, names, observer, **kwargs) as observers:
        for tokens in batches:
            model.setup_cache(tokens.shape[0], tokens.shape[1])
            model(tokens, torch.arange(tokens.shape[1]))
    return observers


def calibrate_input_scales(model, batches: list[torch.Tensor], names: list[str], observer: str = "minmax",
                           act: ActSpec = STATIC_INT8, **kwargs) -> dict[str, torch.Tensor]:
    """Static per-tensor input scales ``range / qmax`` of ``act``'s codes (int8: 127, fp8: 448) for the named
    Linears, from token batches [B, T]."""
    observers = observe_linear_inputs(model, batches, names, observer, act=act, **kwargs)
    return {n: check_scale(input_scale_from_range(o.range(), act), f"input scale of {n}")
            for n, o in observers.items()}
