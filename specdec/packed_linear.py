"""``nn.Linear`` whose inference forward runs on the best dense kernel this machine has (``runtime.hardware``).

At batch 1 decoding is one matrix-vector product per layer, and the plain ``F.linear`` GEMV reaches only
~11-13 GB/s; the same product on a weight reordered once into the library's blocked layout is ~2x faster
(what inductor's weight freezing does). Kernels, picked per dtype and machine:

* fp32: ``mkl-prepacked`` (MKL's packed GEMM).
* bf16: ``onednn-prepacked`` where the probe found oneDNN bf16 prepacking works (AVX-512 / AMX); elsewhere
  ``aten-bf16`` (plain ``F.linear``) or ``fp32-upcast`` (fp32 GEMM on an fp32 copy of the weight), labelled as
  a fallback: the faster at decode (measured once per machine and shape) unless only the other one is
  batch-invariant.

The pack is built on the first no-grad forward and rebuilt whenever the weight changes (in-place edits bump
``weight._version``), so it can never be stale; the plain weight stays the source of truth.

bf16 rows must be batch-invariant for exact speculation: a row's output may not depend on how many rows run
with it. Every bf16 kernel is probed for that (``runtime.hardware.row_invariance``): oneDNN's one-row kernel
sums wide inputs in another order, so those layers run a lone row as two; a kernel with no invariant form is
reported (``batch_invariant`` False) and bf16 speculation refuses it (``specdec.speculative``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.hardware import faster, probe, row_invariance

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DenseKernel:
    """One packed weight: ``fn`` computes ``x [M, K] -> [M, N]``; ``name`` and ``batch_invariant`` are reported."""

    fn: Fn
    name: str
    batch_invariant: bool


def _onednn_bf16(weight: torch.Tensor) -> Fn:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _aten(weight: torch.Tensor) -> Fn:
    return lambda x: F.linear(x, weight)


def _fp32_upcast(weight: torch.Tensor) -> Fn:
    w32 = weight.float()
    return lambda x: F.linear(x.float(), w32).to(weight.dtype)


BF16_FALLBACKS = {"aten-bf16": _aten, "fp32-upcast": _fp32_upcast}


def _fallback_name(shape: torch.Size) -> str:
    """The faster bf16 fallback at this shape, measured once per machine (decode rows: what generation runs)."""
    n, k = shape

    def bench(make: Callable[[torch.Tensor], Fn]):
        w = torch.randn(n, k).to(torch.bfloat16)
        fn = make(w)
        return lambda rows: (lambda x: lambda: fn(x))(torch.randn(rows, k).to(torch.bfloat16))

    return faster(f"bf16-dense/{n}x{k}", {name: bench(make) for name, make in BF16_FALLBACKS.items()})["decode"]


def _invariant(fn: Fn, name: str, shape: torch.Size) -> tuple[Fn, bool]:
    """``fn`` in its batch-invariant form (a lone row run as two where that is what it takes), and whether
    one exists."""
    how = row_invariance((name, *shape), fn, shape[1])
    if how == "two-rows":
        return (lambda x: fn(torch.cat((x, x)))[:1] if x.shape[0] == 1 else fn(x)), True
    return fn, how == "alone"


def pack_bf16(weight: torch.Tensor) -> DenseKernel:
    """oneDNN's prepacked kernel where it works; else the fastest fallback whose rows are batch-invariant
    (exact speculation), or the fastest one when none is."""
    if probe().bf16_prepack_ok:
        fn, invariant = _invariant(_onednn_bf16(weight), "onednn-prepacked", weight.shape)
        return DenseKernel(fn, "onednn-prepacked", invariant)
    fastest = _fallback_name(weight.shape)
    kernels = []
    for name in (fastest, *(n for n in BF16_FALLBACKS if n != fastest)):
        fn, invariant = _invariant(BF16_FALLBACKS[name](weight), name, weight.shape)
        kernels.append(DenseKernel(fn, f"{name} (fallback: {probe().bf16_prepack})", invariant))
        if invariant:
            return kernels[-1]
    return kernels[0]


def pack_fp32(weight: torch.Tensor) -> DenseKernel:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
    return DenseKernel(lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0]),
                       "mkl-prepacked", False)  # MKL rows differ from M >= 4: fp32 equality is tested, not built


PACKERS: dict[torch.dtype, Callable[[torch.Tensor], DenseKernel]] = {torch.bfloat16: pack_bf16}
if torch.backends.mkl.is_available():
    PACKERS[torch.float32] = pack_fp32


class DensePack:
    """A cached ``DenseKernel`` for one weight tensor, rebuilt when the tensor or its contents change."""

    def __init__(self):
        self.kernel: DenseKernel | None = None
        self._key = None

    def get(self, weight: torch.Tensor) -> DenseKernel | None:
        packer = PACKERS.get(weight.dtype)
        if packer is None or weight.device.type != "cpu":
            return None
        key = (weight.data_ptr(), weight._version, weight.shape)
        if self._key != key:
            self.kernel, self._key = packer(weight.detach()), key
        return self.kernel

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight)`` on the packed kernel (plain ``F.linear`` for grad, other dtypes/devices)."""
        kernel = None
        if x.dtype == weight.dtype and not (torch.is_grad_enabled() and weight.requires_grad):
            kernel = self.get(weight)
        if kernel is None:
            return F.linear(x, weight)
        return kernel.fn(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters and state dict) with a cached prepacked inference path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pack = DensePack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._pack.linear(x, self.weight)
        return y + self.bias if self.bias is not None else y

    @property
    def kernel_detail(self) -> str:
        kernel = self._pack.get(self.weight)
        return kernel.name if kernel else "aten"

    @property
    def batch_invariant(self) -> bool:
        kernel = self._pack.get(self.weight)
        return bool(kernel and kernel.batch_invariant)
