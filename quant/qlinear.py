"""Quantized Linear layers and the kernel registry that runs them.

A ``QuantizedLinear`` holds one *kernel*: a small module that owns the packed buffers and computes
``x [M, K] -> y [M, N]``. Kernels register by name; ``select_kernel`` picks the highest-priority kernel whose
``supports(spec, act, out_features, in_features)`` is true, so there are no if-chains over formats:

* ``int8pack``  -- W8 symmetric per-channel, weight-only: ``torch.ops.aten._weight_int8pack_mm`` (real int8).
* ``int4pack``  -- W4 per-group (sym or asym), weight-only: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on
  weights packed by ``_convert_weight_to_int4pack_for_cpu`` (real int4).
* ``int4gemv`` / ``int8gemv`` -- the same two formats on quantspec's own AVX-512 kernels (``quant.gemv``):
  each is chosen over the torch kernel where it builds, is right and streams faster on one row.
* ``int4pack-cuda`` / ``int8-dequant-cuda`` -- the same two formats on a GPU (torch's CUDA tinygemm; int8
  codes widened inside the product), chosen only where a small product on that GPU ran and was right.
* ``simulated`` -- everything else (3/2-bit, asymmetric int8, per-tensor, FP8 weight-only, the microscaling
  formats MXFP4 / NVFP4 / MXFP8, activation quantization without a registered kernel): dequantized weight +
  plain matmul. Its speed is *not* a real
  low-bit speed and every report labels it ``simulated``.

W8A8 kernels live in ``quant.w8a8`` (int8) and ``quant.fp8`` (FP8 E4M3). A kernel reads the number types it
names in ``types`` (``int`` codes unless it says otherwise).

Real kernels run bf16 activations (the CPU kernels are much slower on fp32); a model in fp32 casts the
layer input to bf16 and the output back.

Adding a kernel (e.g. W8A8 int8 x int8)::

    from quant.qlinear import Kernel, register_kernel

    @register_kernel
    class W8A8Kernel(Kernel):
        name, simulated, priority = "w8a8", False, 20
        @classmethod
        def supports(cls, spec, act, out_features, in_features): return spec.bits == 8 and act is not None ...
        def __init__(self, q, scale, zero, spec, act, dtype): ...      # pack (q, scale, zero) into buffers
        def forward(self, x): ...                                        # x [M, K] -> [M, N] in x.dtype
        def export(self): ...                                            # -> (q, scale, zero), exactly

``export`` must return codes, scale and zero such that building the kernel again from them gives identical
buffers (checkpoints store what ``export`` returns, so a save/load round trip is bit-exact).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from quant.actquant import fake_quantize_activation
from quant.qmath import dequantize
from quant.scheme import ActSpec, WeightSpec, parse_scheme
from runtime.errors import UserError
from runtime.registry import Registry
from runtime.hardware import row_invariance
from runtime.packed_linear import DensePack, GemvPart

FAST_DTYPE = torch.bfloat16


class Kernel(nn.Module):
    """Base class: ``q`` [N, K] codes (``spec.code_dtype``), ``scale``/``zero`` in ``quant.qmath`` layout."""

    name: str = ""
    simulated: bool = False
    priority: int = 0  # higher wins when several kernels support a format
    scale_bytes: int = 4  # bytes per exported scale (fp32 unless the kernel keeps bf16 scales)
    devices: tuple[str, ...] = ("cpu", "cuda")  # device types its ops run on
    types: tuple[str, ...] = ("int",)  # number types (quant.scheme.NUMBER_TYPES) of the weight and input codes
    static_inputs: bool = False  # runs calibrated per-tensor input scales (``StaticInputScale``)

    @classmethod
    def reads(cls, spec: WeightSpec, act: ActSpec | None) -> bool:
        """Whether this kernel reads these number types (checked before ``supports``)."""
        return spec.type in cls.types and (act is None or act.type in cls.types)

    @classmethod
    def supports(cls, spec: WeightSpec, act: ActSpec | None, out_features: int, in_features: int) -> bool:
        """Whether this kernel runs this format at this shape ([out, in] of the codes)."""
        raise NotImplementedError

    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def detail(self) -> str:
        """What actually computes the product here (run records name it beside the kernel)."""
        return self.name

    @property
    def device(self) -> torch.device:
        """Where this kernel's buffers live (and its inputs must)."""
        return next(self.buffers()).device


class StaticInputScale:
    """A W8A8 kernel that also runs one calibrated per-tensor input scale (``input_scale`` buffer, None while
    its activations are dynamic); ``quant.w8a8.set_static_input_scales`` switches it."""

    static_inputs = True

    def set_static_input_scale(self, act: ActSpec, input_scale: torch.Tensor) -> None:
        self.act = act
        self.register_buffer("input_scale", input_scale.float().reshape(1))


KERNELS: Registry[type[Kernel]] = Registry("kernel")


def register_kernel(cls: type[Kernel]) -> type[Kernel]:
    return KERNELS.add(cls.name, cls)


def select_kernel(spec: WeightSpec, act: ActSpec | None, shape: tuple[int, int],
                  kernel: str | None = None, device: str = "cpu") -> type[Kernel]:
    """The named kernel (checked), or the highest-priority kernel that supports this format and shape on this
    device type."""
    if kernel is not None:
        cls = KERNELS.get(kernel)
        if not (cls.reads(spec, act) and cls.supports(spec, act, *shape)) or device not in cls.devices:
            raise UserError(f"kernel {kernel!r} cannot run {spec.label}{'_' + act.label if act else ''} "
                            f"at shape {list(shape)} on {device}")
        return KERNELS[kernel]
    candidates = [k for k in KERNELS.values()
                  if device in k.devices and k.reads(spec, act) and k.supports(spec, act, *shape)]
    return max(candidates, key=lambda k: k.priority)


@register_kernel
class Int8PackKernel(Kernel):
    """Symmetric per-channel int8 weights, bf16 scales [N]: ``y = (x @ q.T) * s``."""

    name, priority, scale_bytes, devices = "int8pack", 10, 2, ("cpu",)

    @classmethod
    def supports(cls, spec, act, out_features, in_features):
        # the op reads out of bounds for input widths that are not a multiple of 16 (checked: 66, 72)
        return (act is None and spec.bits == 8 and spec.symmetric and spec.granularity == "channel"
                and in_features % 32 == 0)

    def __init__(self, q, scale, zero, spec, act=None, dtype=torch.float32):
        super().__init__()
        self.register_buffer("weight", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scale.reshape(-1).to(FAST_DTYPE).contiguous())

    def forward(self, x):
        return torch.ops.aten._weight_int8pack_mm(x.to(FAST_DTYPE), self.weight, self.scales).to(x.dtype)

    def export(self):
        scale = self.scales[:, None]
        return self.weight, scale, torch.zeros_like(scale, dtype=torch.int8)


@torch.library.custom_op("quantspec::int4pack_mm", mutates_args=())
def int4pack_mm(x: torch.Tensor, weight: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
                ) -> torch.Tensor:
    """torch's int4pack product as an op inductor calls as it is. Lowered, it failed inside per-block regions
    (torch 2.13: "group size must be a scalar"), so int4pack steps built unrolled (80-160 s per step and span on the
    default model), and in max-autotune its GEMM template ran an AMX micro-kernel from 5 rows up, so verification
    rows differed from the one-token step's."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group_size, scales_and_zeros)


@int4pack_mm.register_fake
def _(x, weight, group_size, scales_and_zeros):
    return x.new_empty(*x.shape[:-1], scales_and_zeros.shape[1])


@register_kernel
class Int4PackKernel(Kernel):
    """Group-wise int4 in torch's CPU tinygemm layout.

    torch's kernel computes ``w = (u - 8) * s + t`` with unsigned codes ``u`` in 0..15 and per-group
    ``scales_and_zeros`` [n_groups, N, 2] = (s, t). Our signed codes ``q`` in -8..7 mean ``w = (q - z) * s``, so
    ``u = q + 8`` and ``t = -z * s`` (rounded to bf16 once, like ``s``)."""

    name, priority, scale_bytes, devices = "int4pack", 10, 2, ("cpu",)  # torch's CPU tinygemm layout

    @classmethod
    def supports(cls, spec, act, out_features, in_features):
        return (act is None and spec.bits == 4 and spec.granularity == "group"
                and spec.group_size in (32, 64, 128, 256) and in_features % spec.group_size == 0
                and out_features % 16 == 0)

    def __init__(self, q, scale, zero, spec, act=None, dtype=torch.float32):
        super().__init__()
        self.group_size = spec.group_size
        self.in_features = q.shape[1]
        self.register_buffer("weight", self.pack((q.to(torch.int32) + 8).contiguous()))
        s, t = self.scales_and_offsets(scale, zero)
        self.register_buffer("scales_and_zeros", torch.stack([s, t], -1).transpose(0, 1).contiguous())

    @staticmethod
    def scales_and_offsets(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 ``(s, t = -z * s)``; ``t`` never -0.0, so rebuilding from ``export`` gives the same bytes."""
        s = scale.to(FAST_DTYPE)
        return s, (-zero.float() * s.float()).to(FAST_DTYPE) + 0.0

    def pack(self, unsigned: torch.Tensor) -> torch.Tensor:
        """The unsigned codes [N, K] in 0..15 in this kernel's tiled layout."""
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)

    @staticmethod
    def mm(x, weight, group_size, scales_and_zeros):
        """torch's kernel; in a compiled step, through ``int4pack_mm``."""
        mm = int4pack_mm if torch.compiler.is_compiling() else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x, weight, group_size, scales_and_zeros)

    def forward(self, x):
        return self.mm(x.to(FAST_DTYPE), self.weight, self.group_size, self.scales_and_zeros).to(x.dtype)

    def export(self):
        """Codes by running the kernel on the identity with (s, t) = (1, 0): exact small integers."""
        unit = torch.zeros_like(self.scales_and_zeros)
        unit[..., 0] = 1
        eye = torch.eye(self.in_features, dtype=FAST_DTYPE, device=unit.device)
        q = self.mm(eye, self.weight, self.group_size, unit).T
        s, t = self.scales_and_zeros.transpose(0, 1).unbind(-1)  # [N, n_groups] each
        zero = torch.round(-t.float() / s.float())  # |z| <= 8, so bf16 rounding of t cannot move it
        return q.round().to(torch.int8).contiguous(), s.contiguous(), zero.to(torch.int8)


@functools.cache
def cuda_op_missing(name: str) -> str | None:
    """Why this CUDA kernel cannot run on this GPU (one small product, checked against its dequantized
    reference), or None when it runs."""
    cls = KERNELS[name]
    spec = parse_scheme(cls.probe_scheme).weights
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-2 ** (spec.bits - 1), 2 ** (spec.bits - 1), (64, 256), generator=g, dtype=torch.int8)
    n_scales = 256 // spec.group_size if spec.granularity == "group" else 1
    scale = torch.rand(64, n_scales, generator=g) / 16 + 1e-3
    zero = torch.zeros_like(scale, dtype=torch.int8)
    x = torch.randn(3, 256, generator=g)
    try:
        kernel = cls(q.cuda(), scale.cuda(), zero.cuda(), spec, None, torch.bfloat16)
        got = kernel(x.to("cuda", torch.bfloat16)).float().cpu()
    except Exception as exc:  # noqa: BLE001  (any failure means: not on this GPU, use another kernel)
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
    want = x.bfloat16().float() @ dequantize(q, scale, zero, spec, torch.float32).T
    err = float((got - want).abs().max() / want.abs().max())
    return None if err < 2e-2 else f"wrong results (max relative error {err:.3g})"


class CudaKernel(Kernel):
    """A kernel of torch's CUDA ops: chosen only where a small product on this GPU ran and was right."""

    devices = ("cuda",)
    probe_scheme = ""  # a scheme this kernel runs, for ``cuda_op_missing``

    @classmethod
    def supports(cls, spec, act, out_features, in_features):
        return cls.fits(spec, act, out_features, in_features) and cuda_op_missing(cls.name) is None

    @classmethod
    def fits(cls, spec, act, out_features, in_features) -> bool:
        raise NotImplementedError


@register_kernel
class Int4PackCudaKernel(CudaKernel, Int4PackKernel):
    """Group-wise int4 in torch's CUDA tinygemm layout (``_weight_int4pack_mm``, as gpt-fast and torchao use it):
    the CPU kernel's arithmetic ``w = (u - 8) * s + t`` on codes packed two per byte and tiled for the tensor
    cores (inner k-tiles of 16 columns: 8, 4 or 2 per tile, the most that divide the width)."""

    name, probe_scheme = "int4pack-cuda", "w4g32-sym"
    mm = staticmethod(torch.ops.aten._weight_int4pack_mm)

    @classmethod
    def fits(cls, spec, act, out_features, in_features):
        return (act is None and spec.bits == 4 and spec.granularity == "group"
                and spec.group_size in (32, 64, 128, 256) and in_features % spec.group_size == 0
                and in_features % 32 == 0 and out_features % 8 == 0)

    def pack(self, unsigned):
        inner_k_tiles = next(t for t in (8, 4, 2) if unsigned.shape[1] % (16 * t) == 0)
        packed = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)


@register_kernel
class Int8DequantCudaKernel(CudaKernel, Int8PackKernel):
    """Symmetric per-channel int8 weights on CUDA, stored as ``int8pack`` stores them: ``y = (x @ q.T) * s`` with
    the codes widened inside the product (gpt-fast's int8 weight-only: under ``torch.compile`` inductor fuses the
    widening into the GEMV, so only the int8 codes stream; eager it materializes a bf16 weight per call)."""

    name, probe_scheme = "int8-dequant-cuda", "w8ch-sym"

    @classmethod
    def fits(cls, spec, act, out_features, in_features):
        return act is None and spec.bits == 8 and spec.symmetric and spec.granularity == "channel"

    def forward(self, x):
        return (F.linear(x.to(FAST_DTYPE), self.weight.to(FAST_DTYPE)) * self.scales).to(x.dtype)


@register_kernel
class SimulatedKernel(Kernel):
    """Any format: dequantized weight in the model dtype + plain matmul (activations fake-quantized if asked)."""

    name, simulated, priority = "simulated", True, -1

    @classmethod
    def reads(cls, spec, act):
        return True

    @classmethod
    def supports(cls, spec, act, out_features, in_features):
        return True

    def __init__(self, q, scale, zero, spec, act=None, dtype=torch.float32):
        super().__init__()
        self.spec, self.act = spec, act
        self.register_buffer("q", q.to(spec.code_dtype).contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("zero", zero.to(torch.int8).contiguous())
        self.register_buffer("weight", dequantize(self.q, self.scale, self.zero, spec, dtype), persistent=False)
        self.register_buffer("input_global_scale", None)  # NVFP4 activations: calibrated per layer
        self._pack = DensePack()

    def set_input_global_scale(self, scale: torch.Tensor) -> None:
        self.register_buffer("input_global_scale", scale.float().reshape(1))

    def forward(self, x):
        if self.act is not None:
            x = fake_quantize_activation(x, self.act, global_scale=self.input_global_scale)
        if x.dtype == self.weight.dtype:
            return self._pack.linear(x, self.weight)
        return F.linear(x, self.weight.to(x.dtype))

    @property
    def detail(self) -> str:
        kernel = self._pack.get(self.weight)
        return f"simulated on {kernel.name if kernel else 'aten'}"

    def export(self):
        return self.q, self.scale, self.zero


class QuantizedLinear(nn.Module):
    """Drop-in ``nn.Linear`` replacement: ``y = kernel(x) + bias``.

    With a padded scheme the codes are wider than ``in_features`` (zero columns appended up to a multiple of
    the group size) and the input is zero-padded to match. ``global_scale``: NVFP4's per-tensor scale, which the
    kernel's effective group scales already include; kept for export."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: WeightSpec,
                 in_features: int, bias: torch.Tensor | None = None, act: ActSpec | None = None,
                 dtype: torch.dtype = torch.float32, kernel: str | None = None,
                 global_scale: torch.Tensor | None = None):
        super().__init__()
        self.spec, self.act = spec, act
        self.register_buffer("global_scale", None if global_scale is None else global_scale.float().reshape(1))
        self.in_features, self.out_features = in_features, q.shape[0]
        self.padded_in, self.dtype = q.shape[1], dtype
        self.kernel = select_kernel(spec, act, tuple(q.shape), kernel, q.device.type)(q, scale, zero, spec, act,
                                                                                     dtype)
        self.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False) if bias is not None else None
        self._invariance: str | None = None

    @classmethod
    def from_result(cls, result, spec: WeightSpec, in_features: int, bias=None, act=None,
                    dtype=torch.float32, kernel: str | None = None) -> "QuantizedLinear":
        """From a ``quant.methods.QuantResult``."""
        return cls(result.q, result.scale, result.zero, spec, in_features, bias, act, dtype, kernel,
                   result.global_scale)

    @property
    def kernel_name(self) -> str:
        return self.kernel.name

    def use_kernel(self, name: str) -> None:
        """Run on kernel ``name`` from now on (checked): the same codes, scales and zero points, repacked (weight-only
        layers: calibrated input scales are not carried over)."""
        if self.act is not None:
            raise UserError(f"use_kernel switches weight-only layers; {self.spec.label}_{self.act.label} quantizes "
                            "activations too")
        q, scale, zero = self.export()
        cls = select_kernel(self.spec, self.act, tuple(q.shape), name, self.kernel.device.type)
        self.kernel, self._invariance = cls(q, scale, zero, self.spec, self.act, self.dtype), None

    @property
    def gemv_part(self) -> GemvPart | None:
        """The kernel where compiled steps may fuse it with others (``runtime.packed_linear.prepare``): one of
        quantspec's ops on unpadded inputs."""
        return self.kernel if isinstance(self.kernel, GemvPart) and self.padded_in == self.in_features else None

    @property
    def kernel_detail(self) -> str:
        return self.kernel.detail

    @property
    def batch_invariant(self) -> bool:
        """Whether a bf16 row's output is bitwise the same alone as among others (probed per kernel and shape;
        a kernel that needs a lone row run as two gets it)."""
        if self._invariance is None:
            how = row_invariance(("kernel", self.kernel.detail, self.out_features), self.kernel, self.padded_in,
                                 device=self.kernel.device)
            self._invariance = how or "none"
        return self._invariance != "none"

    @property
    def simulated(self) -> bool:
        return self.kernel.simulated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.padded_in != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in - self.in_features))
        if self._invariance == "two-rows" and x2.shape[0] == 1:
            y = self.kernel(torch.cat((x2, x2)))[:1].reshape(*shape[:-1], self.out_features)
        else:
            y = self.kernel(x2).reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, padded_in] in ``spec.code_dtype``, scale, zero int8) exactly as the kernel uses them."""
        return self.kernel.export()

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(q - z) * s`` [N, in_features]: the weight this layer represents."""
        q, scale, zero = self.export()
        return dequantize(q, scale.float(), zero, self.spec, dtype)[:, : self.in_features]

    def format_bytes(self) -> int:
        """Bytes of the stored format: packed codes + scales (+ int8 zero points when asymmetric, + the fp32
        global scale); microscaling formats store 1-byte scales."""
        n_scales = self.export()[1].numel()
        codes = self.out_features * self.padded_in * self.spec.bits // 8
        scale_dtype = self.spec.number.scale_dtype
        scale_bytes = scale_dtype.itemsize if scale_dtype is not None else self.kernel.scale_bytes
        extra = 4 if self.global_scale is not None else 0
        return codes + n_scales * (scale_bytes + (0 if self.spec.symmetric else 1)) + extra

    def resident_bytes(self) -> int:
        """Bytes this layer's buffers occupy in the runtime (what decoding streams for a real kernel)."""
        return sum(t.numel() * t.element_size() for t in self.buffers()) + (
            self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.spec.label}"
                f"{'_' + self.act.label if self.act else ''}, kernel={self.kernel_name}")

