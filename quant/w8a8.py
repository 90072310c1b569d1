"""W8A8: int8 weights x int8 activations on a real integer matmul (``torch._int_mm``, int32 accumulation).

``torch._int_mm(a [M, K] int8, b [K, N] int8) -> int32`` runs on CPU in torch 2.13 for any M, K, N (checked:
M = 1..64, odd K and N, transposed b); where it is slower than the fp32 GEMM (no VNNI / AMX-INT8), the same
integers come bitwise from fp32 blocks (``int8_matmul_fp32``), picked per machine by a micro-benchmark. The kernel computes ``y = (q_x @ q_wᵀ) * s_x * s_w`` with symmetric
per-channel weight scales ``s_w`` [N] and activation scales ``s_x`` per token (dynamic) or one calibrated
per-tensor scale (static). ``quantize_w8a8`` builds a W8A8 model end to end: optional SmoothQuant, static
input-scale calibration (observer by name), any weight method.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from quant.actquant import calibrate_input_scales, quantize_activation
from runtime.errors import UserError
from runtime.hardware import SHAPE_CLASSES, probe, ranked, shape_class
from quant.qlinear import KERNELS, Kernel, QuantizedLinear, StaticInputScale, register_kernel
from quant.scheme import ActSpec, QuantScheme, parse_scheme

STATIC_NEEDS = ("static activation scales need a W8A8 kernel: int8 symmetric per-channel weights "
                "(w8ch-sym_a8t-static) or fp8 per-tensor / per-channel weights (FP8 = wfp8t-sym_afp8t-static)")


EXACT_CHUNK = 1024  # |partial sum| <= 1024 * 128 * 128 = 2**24: every fp32 partial sum is an exact integer


def int8_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K]ᵀ -> int32 [M, N], exact (``torch._int_mm``)."""
    return torch._int_mm(xq, wq.t())


def int8_matmul_fp32(xq: torch.Tensor, w_chunks: list[torch.Tensor]) -> torch.Tensor:
    """The same int32 product, bitwise, on the fp32 GEMM: ``w_chunks`` are the weight's fp32 column blocks of at
    most ``EXACT_CHUNK``; within a block every product and partial sum is an integer below 2**24, so any
    summation order is exact, and the blocks are added in int32."""
    out, start = None, 0
    for w in w_chunks:
        part = F.linear(xq[:, start:start + w.shape[1]].float(), w).to(torch.int32)
        out, start = part if out is None else out + part, start + w.shape[1]
    return out


def fp32_chunks(wq: torch.Tensor) -> list[torch.Tensor]:
    return [c.float().contiguous() for c in wq.split(EXACT_CHUNK, dim=1)]


def int8_product_pick(shape: tuple[int, int]) -> dict[str, str]:
    """Per shape class, which exact int8 product is faster here: ``torch._int_mm`` (fast with VNNI / AMX-INT8,
    many times slower than fp32 on an AVX2-only CPU: the probe measures it) or ``fp32-exact``. Forced to ``fp32-exact`` by the AVX2 override."""
    if probe().forced:
        return {cls: "fp32-exact" for cls in SHAPE_CLASSES}
    n, k = shape

    @functools.cache
    def products():  # the weight is built only if the ranking is measured
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        chunks = fp32_chunks(w)
        return {"int_mm": lambda x: int8_matmul(x, w), "fp32-exact": lambda x: int8_matmul_fp32(x, chunks)}

    def make(name):
        return lambda rows: (lambda fn, x: lambda: fn(x))(products()[name],
                                                          torch.randint(-127, 128, (rows, k), dtype=torch.int8))

    rank = ranked(f"int8xint8/{n}x{k}", {name: make(name) for name in ("int_mm", "fp32-exact")})
    return {cls: order[0] for cls, order in rank.items()}


@register_kernel
class Int8xInt8Kernel(StaticInputScale, Kernel):
    """Symmetric per-channel int8 weights with int8 activations (per-token dynamic or per-tensor static)."""

    name, priority, devices = "int8xint8", 20, ("cpu",)  # its product pick is a CPU micro-benchmark

    @classmethod
    def supports(cls, spec, act, out_features, in_features):
        return (act is not None and act.bits == 8 and spec.bits == 8 and spec.symmetric
                and spec.granularity == "channel")

    def __init__(self, q, scale, zero, spec, act=None, dtype=torch.float32):
        super().__init__()
        self.act = act
        self.register_buffer("weight", q.to(torch.int8).contiguous())
        self.register_buffer("weight_scale", scale.reshape(-1).float().contiguous())
        self.register_buffer("input_scale", None)
        self.pick = int8_product_pick(tuple(self.weight.shape))
        self._chunks: list[torch.Tensor] | None = None

    @property
    def detail(self) -> str:
        impls = sorted(set(self.pick.values()))
        why = "" if impls == ["int_mm"] else f" (torch._int_mm is slower here: int8 matmul {probe().int8_matmul})"
        return f"int8xint8 on {'/'.join(impls)}{why}"

    def product(self, xq: torch.Tensor) -> torch.Tensor:
        if self.pick[shape_class(xq.shape[0])] == "int_mm":
            return int8_matmul(xq, self.weight)
        if self._chunks is None:
            self._chunks = fp32_chunks(self.weight)
        return int8_matmul_fp32(xq, self._chunks)

    def forward(self, x):
        xq, x_scale = quantize_activation(x, self.act, self.input_scale)
        y = self.product(xq).float() * x_scale * self.weight_scale
        return y.to(x.dtype)

    def export(self):
        scale = self.weight_scale[:, None]
        return self.weight, scale, torch.zeros_like(scale, dtype=torch.int8)


def dynamic_twin(scheme: QuantScheme) -> QuantScheme:
    """The same scheme with per-token dynamic activations (what ``quantize_model`` builds)."""
    return replace(scheme, activations=replace(scheme.activations, granularity="token", dynamic=True))


def runs_static(scheme: QuantScheme) -> bool:
    """Whether a kernel here runs ``scheme``'s weights with calibrated per-tensor input scales."""
    acts = dynamic_twin(scheme).activations
    return any(k.static_inputs and k.reads(scheme.weights, acts) and k.supports(scheme.weights, acts, 0, 0)
               for k in KERNELS.values())


def set_static_input_scales(model, act: ActSpec, input_scales: dict[str, torch.Tensor]) -> None:
    """Switch the named W8A8 layers to static per-tensor activations with the given scales."""
    for name, scale in input_scales.items():
        layer = model.get_submodule(name)
        if not isinstance(layer, QuantizedLinear) or not layer.kernel.static_inputs:
            raise UserError(f"{name}: {STATIC_NEEDS}")
        layer.act = act
        layer.kernel.set_static_input_scale(act, scale)
