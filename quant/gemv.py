"""``int4gemv`` and ``int8gemv``: quantspec's own C++ kernels (``runtime/csrc/gemv.cpp``) for decode-sized
products of int4 / int8 weights and bf16 inputs on AVX-512 (``vdpbf16ps`` with AVX512-BF16, two FMAs without) or
AVX2 (each code widened to fp32 and multiplied in one FMA).

torch's ``_weight_int4pack_mm_for_cpu`` streams the default model's int4 body at about 12 GB/s at one row on an
AMD EPYC (AVX-512), a third of the machine's read bandwidth: each code is widened and converted to fp32 before
its multiply. Here a 4-bit code ``u`` becomes the exact bf16 ``128 + u`` with one OR and ``vdpbf16ps``
multiplies 32 weights at once; the offset is folded in through the input's (group) sum. An int8 code is two such
nibbles. Each kernel runs the format of the torch kernel it stands in for (``int4pack``: ``w = (u - 8) * s + t``
with bf16 ``s``, ``t`` per group; ``int8pack``: ``w = q * s`` with a bf16 ``s`` per channel), so the weights
and checkpoints are the same; only the summation order differs.

The ops are built on first use (``runtime/cpu_ops.py``). A kernel is used only where they build, it gives the right
product and is faster than the torch kernel on one row of the default model's MLP shape (``gemv_missing`` says why
not otherwise; layers then run the torch kernel). A row's output is bitwise
the same alone as in a batch by construction: every row runs the same instructions.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quant.qlinear import FAST_DTYPE, KERNELS, Int4PackKernel, Int8PackKernel, Kernel, register_kernel, select_kernel
from quant.scheme import parse_scheme
from runtime.cpu_ops import ROWS, build_dir, ops_missing
from runtime.packed_linear import GemvPart
from runtime.errors import UserError
from runtime import hardware


class GemvKernel(Kernel, GemvPart):
    """A kernel run by one of the ops, in the format of the torch kernel ``replaces`` (its ``supports`` too); a
    ``GemvPart``, so compiled steps fuse q/k/v and gate/up into one call."""

    replaces: type[Kernel] = Kernel
    probe_scheme = ""  # a format it runs, for the correctness and speed checks

    @classmethod
    def supports(cls, spec, act, out_features, in_features):
        return (cls.replaces.supports(spec, act, out_features, in_features) and out_features % ROWS == 0
                and gemv_missing(cls.name) is None)

    def check_runnable(self) -> None:
        if why := ops_missing():
            raise UserError(f"kernel {self.name!r} cannot run here: {why}; use kernel {self.replaces.name!r}")


def pack4(unsigned: torch.Tensor, s: torch.Tensor, t: torch.Tensor, group_size: int) -> torch.Tensor:
    """int4 codes [N, K] in 0..15 and bf16 (s, t) [N, groups] -> ``int4_gemv``'s uint8 layout."""
    n, k = unsigned.shape
    groups, chunks = k // group_size, group_size // 32
    u = unsigned.to(torch.uint8).reshape(n // ROWS, ROWS, groups, chunks, 8, 2, 2)  # b, i, g, c, p, half, e
    pieces = (u[..., 0, :] | u[..., 1, :] << 4).permute(0, 2, 3, 4, 1, 5)  # b, g, c, p, i, e
    pieces = pieces.reshape(n // ROWS, groups, chunks * 256)

    def per_block(v):  # [N, groups] bf16 -> [blocks, groups, 32] bytes
        return v.to(FAST_DTYPE).reshape(n // ROWS, ROWS, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((per_block(s), per_block(t), pieces), -1).reshape(-1).contiguous()


def unpack4(packed: torch.Tensor, n: int, k: int, group_size: int):
    """The inverse of ``pack4``: (codes [N, K] int32, s, t [N, groups] bf16)."""
    groups, chunks = k // group_size, group_size // 32
    blocks = packed.reshape(n // ROWS, groups, 64 + chunks * 256)

    def from_block(b):  # [blocks, groups, 32] bytes -> [N, groups] bf16
        return b.contiguous().view(FAST_DTYPE).transpose(1, 2).reshape(n, groups)

    pieces = blocks[..., 64:].reshape(n // ROWS, groups, chunks, 8, ROWS, 2).permute(0, 4, 1, 2, 3, 5)
    u = torch.stack((pieces & 0xF, pieces >> 4), -2)  # b, i, g, c, p, half, e
    return u.reshape(n, k).to(torch.int32), from_block(blocks[..., :32]), from_block(blocks[..., 32:64])


@register_kernel
class Int4GemvKernel(GemvKernel, Int4PackKernel):
    """``int4pack``'s format in ``int4_gemv``'s layout."""

    name, priority, replaces, probe_scheme = "int4gemv", 11, Int4PackKernel, "w4g32-asym"

    def __init__(self, q, scale, zero, spec, act=None, dtype=torch.float32):
        Kernel.__init__(self)
        self.check_runnable()
        self.group_size, (self.out_features, self.in_features) = spec.group_size, q.shape
        s, t = self.scales_and_offsets(scale, zero)
        self.register_buffer("weight", pack4(q.to(torch.int32) + 8, s, t, self.group_size))

    BUFFERS = ("weight",)

    @property
    def fuse_key(self) -> tuple:
        return "int4", self.group_size, self.in_features

    def product(self, x, buffers, out_features):
        return torch.ops.quantspec.int4_gemv(x, buffers[0], self.group_size, out_features)

    def forward(self, x):
        return self.product(x.to(FAST_DTYPE), self.gemv_buffers(), self.out_features).to(x.dtype)

    def export(self):
        u, s, t = unpack4(self.weight, self.out_features, self.in_features, self.group_size)
        zero = torch.round(-t.float() / s.float())  # as int4pack's export: |z| <= 8 survives bf16 rounding of t
        return (u - 8).to(torch.int8).contiguous(), s.contiguous(), zero.to(torch.int8)


@register_kernel
class Int8GemvKernel(GemvKernel, Int8PackKernel):
    """``int8pack``'s format (bf16 scales per channel) in ``int8_gemv``'s layout: codes + 128 as bytes, per block
    of 16 rows and per pair of columns.

    On AMD EPYC (AVX-512) it decoded the default model 1.23x faster than ``int8pack`` on the eager step. Under
    ``torch.compile`` inductor turns ``int8pack``'s op into its own C++ template on frozen weights, which ran 1.14x
    ahead of this kernel before compiled steps fused its q/k/v and gate/up calls and it kept four accumulators a row
    (1.04x after: bench/results/quant_decode_compiled.*.json), but such a step builds only as one unrolled graph
    that no cache keeps (60-130 s per token count for every new set of weights), where this one builds in per-block
    regions in seconds (``runtime.compiled``); ``kernel="int8pack"`` (``QuantizedLinear.use_kernel``) runs the
    template."""

    name, priority, replaces, probe_scheme = "int8gemv", 11, Int8PackKernel, "w8ch-sym"

    def __init__(self, q, scale, zero, spec, act=None, dtype=torch.float32):
        Kernel.__init__(self)
        self.check_runnable()
        n, k = q.shape
        u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(n // ROWS, ROWS, k // 2, 2).permute(0, 2, 1, 3)
        self.register_buffer("weight", u.contiguous().reshape(-1))
        self.register_buffer("scales", scale.reshape(-1).to(FAST_DTYPE).contiguous())
        self.in_features, self.out_features = k, n

    BUFFERS = ("weight", "scales")

    @property
    def fuse_key(self) -> tuple:
        return "int8", self.in_features

    def product(self, x, buffers, out_features):
        return torch.ops.quantspec.int8_gemv(x, *buffers)

    def forward(self, x):
        return self.product(x.to(FAST_DTYPE), self.gemv_buffers(), self.out_features).to(x.dtype)

    def export(self):
        n, k = self.scales.numel(), self.in_features
        u = self.weight.reshape(n // ROWS, k // 2, ROWS, 2).permute(0, 2, 1, 3).reshape(n, k)
        scale = self.scales[:, None]
        return (u.to(torch.int16) - 128).to(torch.int8), scale, torch.zeros_like(scale, dtype=torch.int8)


def _example(scheme: str, n: int, k: int, seed: int = 0):
    """Random codes, scales and zero points [N, K] of a format."""
    spec = parse_scheme(scheme).weights
    g = torch.Generator().manual_seed(seed)
    lo, hi = -2 ** (spec.bits - 1), 2 ** (spec.bits - 1)
    n_scales = k // spec.group_size if spec.granularity == "group" else 1
    zero = torch.randint(-3, 4, (n, n_scales), generator=g) if not spec.symmetric else torch.zeros(n, n_scales)
    return torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8), torch.rand(n, n_scales, generator=g) / 16 \
        + 1e-3, zero, spec


def streamed(kernel_cls: type[Kernel], scheme: str, n: int, k: int, stream_mb: int = 64) -> list[Kernel]:
    """Kernels on distinct random weights of one shape, ``stream_mb`` of int8 codes in all (``hardware.streamed``)."""
    return hardware.streamed(lambda seed: kernel_cls(*_example(scheme, n, k, seed)), n, k, stream_mb=stream_mb)


def gemv_missing(name: str) -> str | None:
    """Why kernel ``name`` is not used here (neither AVX2 nor AVX-512, a failed build, a wrong
    product, or slower than the torch kernel on one row beyond ``hardware.TIE``), or None."""
    return ops_missing() or _verdict(name, build_dir())


@hardware.cached_per_thread_count
def _verdict(name: str, build: Path) -> str | None:
    """``name``'s product checked and its one-row speed against the torch kernel, once per build of the ops (a
    process that forces another instruction set asks again rather than reading the other build's verdict)."""
    cls: type[GemvKernel] = KERNELS[name]
    args = _example(cls.probe_scheme, 32, 128)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(FAST_DTYPE)
    got, want = cls(*args)(x).float(), cls.replaces(*args)(x).float()
    err = float((got - want).abs().max() / want.abs().max())
    if err > 1e-2:
        return f"wrong results (max relative error {err:.3g} against {cls.replaces.name})"
    us = decode_speeds(cls)
    if hardware.beaten(us[cls.name], us[cls.replaces.name]):
        return f"slower than {cls.replaces.name} on one row here ({us[cls.name]} vs {us[cls.replaces.name]} us)"
    return None


def decode_speeds(cls: type[GemvKernel], n: int = 1536, k: int = 576, stream_mb: int = 64) -> dict[str, float]:
    """Microseconds per one-row product of the kernel and the torch kernel it replaces at the default model's
    MLP shape, each call on the next of enough weights (``stream_mb`` of int8 codes) that it streams from memory
    as in decoding (measured once per machine, cached in ``$QUANTSPEC_HOME/hardware.json``)."""
    name = f"{cls.name}-vs-{cls.replaces.name}/{n}x{k}/streamed/{build_dir().name}"  # re-measured per build
    makers = {c.name: lambda seed, c=c: c(*_example(cls.probe_scheme, n, k, seed)) for c in (cls, cls.replaces)}
    return hardware.streamed_decode_us(name, makers, n, k, stream_mb=stream_mb)


def cpu_kernel(bits: int) -> str:
    """The kernel the registry picks here for int4 g32 (``bits=4``) or int8 per-channel (8) weight-only layers of
    the default model's MLP shape."""
    return select_kernel(parse_scheme({4: "w4g32-sym", 8: "w8ch-sym"}[bits]).weights, None, (1536, 576)).name
