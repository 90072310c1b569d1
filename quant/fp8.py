"""FP8 W8A8: E4M3 weights (per-channel or per-tensor scales) x E4M3 activations (dynamic per-token scales, or
one calibrated per-tensor scale: compressed-tensors' ``FP8_DYNAMIC`` and ``FP8``).

``torch._scaled_mm(a [M, K] fp8, b [K, N] fp8 column-major, scale_a [M, 1], scale_b [1, N] fp32)`` runs float8
inputs on CPU in torch 2.13. Whether it runs and is right is probed once per process on a small product
(``probe_scaled_mm``); where it fails, or where a micro-benchmark finds it slower (on an AMD EPYC with AVX-512
it was 25-50x slower than the fp32 GEMM at one row and ~2x at 128), the *exact upcast* runs instead: the fp8
codes widened to fp32 (every product of two E4M3 values is exact in fp32) on the fp32 GEMM, accumulating in
fp32, the scales applied after. The pick is per machine and shape class (``fp8_product_pick``) and
the kernel's ``detail`` names what ran and why.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from quant.actquant import quantize_activation, quantize_per_token
from quant.qlinear import Kernel, StaticInputScale, register_kernel
from quant.scheme import ActSpec
from runtime.hardware import OVERRIDE_ENV, SHAPE_CLASSES, probe, ranked, shape_class

FP8_TOKEN = ActSpec(8, "token", True, type="float")
SCALED_MM, UPCAST = "scaled_mm", "fp32-upcast"


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp8 [M, K] x fp8 [N, K]ᵀ with scales [M, 1] and [1, N] -> fp32 [M, N] (``torch._scaled_mm``)."""
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32)


def fp8_matmul_upcast(xq: torch.Tensor, x_scale: torch.Tensor, w_up: torch.Tensor,
                      w_scale: torch.Tensor) -> torch.Tensor:
    """The same product on the fp32 GEMM: ``w_up`` is the weight's fp8 codes widened to fp32 (exact)."""
    return F.linear(xq.float(), w_up) * x_scale * w_scale


def scaled_mm_missing() -> str | None:
    """Why ``torch._scaled_mm`` is not used for the FP8 product here (the AVX2 override, or what
    ``probe_scaled_mm`` found), or None."""
    if probe().forced:
        return f"not used under {OVERRIDE_ENV}={probe().forced}"
    return probe_scaled_mm()


@functools.cache
def probe_scaled_mm() -> str | None:
    """Why ``torch._scaled_mm`` cannot run the FP8 product in this process (a small product checked against the
    exact upcast), or None when it runs and is right."""
    g = torch.Generator().manual_seed(0)
    xq, xs = quantize_per_token(torch.randn(3, 256, generator=g), FP8_TOKEN)
    wq, ws = quantize_per_token(torch.randn(64, 256, generator=g), FP8_TOKEN)
    ws = ws.reshape(1, -1)
    try:
        got = fp8_matmul(xq, xs, wq, ws)
    except Exception as exc:  # noqa: BLE001  (any failure means: not on this machine, use the upcast)
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
    want = fp8_matmul_upcast(xq, xs, wq.float(), ws)
    err = float((got - want).abs().max() / want.abs().max())
    return None if err < 1e-5 else f"wrong results (max relative error {err:.3g})"


def fp8_product_pick(shape: tuple[int, int]) -> dict[str, str]:
    """Per shape class, which FP8 product is faster here: ``scaled_mm`` or ``fp32-upcast`` (always the upcast
    where ``torch._scaled_mm`` is missing or wrong)."""
    if scaled_mm_missing():
        return {cls: UPCAST for cls in SHAPE_CLASSES}
    n, k = shape
    g = torch.Generator().manual_seed(0)

    @functools.cache
    def products():  # the weight is built only if the ranking is measured
        wq, ws = quantize_per_token(torch.randn(n, k, generator=g), FP8_TOKEN)
        ws, w_up = ws.reshape(1, -1), wq.float()
        return {SCALED_MM: lambda xq, xs: fp8_matmul(xq, xs, wq, ws),
                UPCAST: lambda xq, xs: fp8_matmul_upcast(xq, xs, w_up, ws)}

    def make(name):
        def factory(rows):
            fn = products()[name]
            xq, xs = quantize_per_token(torch.randn(rows, k, generator=g), FP8_TOKEN)
            return lambda: fn(xq, xs)
        return factory

    rank = ranked(f"fp8xfp8/{n}x{k}", {name: make(name) for name in (SCALED_MM, UPCAST)})
    return {cls: order[0] for cls, order in rank.items()}


@register_kernel
class Fp8xFp8Kernel(StaticInputScale, Kernel):
    """``y = (x̂ @ ŵᵀ) * s_x * s_w`` with fp32 accumulation: E4M3 weights with per-channel scales ``s_w`` [N] (or
    one per tensor), E4M3 activations with dynamic per-token scales ``s_x`` (or one calibrated per tensor)."""

    name, priority, devices, types = "fp8xfp8", 20, ("cpu",), ("float",)  # its product pick is a CPU benchmark

    @classmethod
    def supports(cls, spec, act, out_features, in_features):
        return (act is not None and act.granularity in ("token", "tensor") and spec.bits == act.bits == 8
                and spec.granularity in ("channel", "tensor"))

    def __init__(self, q, scale, zero, spec, act=None, dtype=torch.float32):
        super().__init__()
        self.act = act
        self.register_buffer("weight", q.to(spec.code_dtype).contiguous())
        self.register_buffer("weight_scale", scale.reshape(1, -1).float().contiguous())  # [1, N], or [1, 1]
        self.register_buffer("input_scale", None)
        self.pick = fp8_product_pick(tuple(self.weight.shape))
        self._upcast: torch.Tensor | None = None

    @property
    def detail(self) -> str:
        impls = sorted(set(self.pick.values()))
        if impls == [SCALED_MM]:
            return "fp8xfp8 on torch._scaled_mm"
        why = f": {scaled_mm_missing()}" if scaled_mm_missing() else " is slower here"
        return (f"fp8xfp8 on {'/'.join(impls)} ({UPCAST}: the fp8 codes widened to fp32, exact products on the "
                f"fp32 GEMM; torch._scaled_mm{why})")

    def product(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        if self.pick[shape_class(xq.shape[0])] == SCALED_MM:  # its row-wise scales: [M, 1] and [1, N]
            return fp8_matmul(xq, x_scale.expand(xq.shape[0], 1).contiguous(), self.weight,
                              self.weight_scale.expand(1, self.weight.shape[0]).contiguous())
        if self._upcast is None:
            self._upcast = self.weight.float()
        return fp8_matmul_upcast(xq, x_scale, self._upcast, self.weight_scale)

    def forward(self, x):
        xq, x_scale = quantize_activation(x, self.act, self.input_scale)
        return self.product(xq, x_scale).to(x.dtype)

    def export(self):
        scale = self.weight_scale.reshape(-1, 1)
        return self.weight, scale, torch.zeros_like(scale, dtype=torch.int8)
