"""``nn.Linear`` whose inference forward runs on the best dense kernel this machine has (``runtime.hardware``).

At batch 1 decoding is one matrix-vector product per layer, and the plain ``F.linear`` GEMV reaches a fraction
of the memory bandwidth; the same product on a weight reordered once into the library's blocked layout is
faster (what inductor's weight freezing does; measured in bench/results, decode-*.json). Kernels, picked per dtype and machine:

* fp32: ``mkl-prepacked`` (MKL's packed GEMM) or ``aten-fp32`` (plain ``F.linear``).
* bf16: ``onednn-prepacked`` where the probe found oneDNN bf16 prepacking works (AVX-512 / AMX), ``aten-bf16``
  (plain ``F.linear``) or ``fp32-upcast`` (fp32 GEMM on an fp32 copy of the weight); where prepacking is
  missing the others are labelled as a fallback.

Where the prepacked kernel is missing, kernels are ranked per weight shape at one row (decode) and at 128
(prefill, evaluation), measured once per machine (``runtime.hardware.ranked``). bf16 takes the fastest at decode
whose rows are batch-invariant (below) for up to ``EXACT_ROWS`` rows, and the fastest at 128 rows above that: on
an AVX2 CPU ``aten-bf16`` is the invariant one but ``fp32-upcast`` multiplies 128 rows 4.5-6x faster
(bench/results/decode-bf16.amd-epyc-avx2.json). The pack is built on the first no-grad forward and rebuilt
whenever the weight changes (in-place edits bump ``weight._version``), so it can never be stale; the plain weight
stays the source of truth.

bf16 rows must be batch-invariant for exact speculation: a row's output may not depend on how many rows run
with it, up to the widest verification (plain and speculative decoding prefill the same rows on the same
kernel). Every bf16 kernel is probed for that (``runtime.hardware.row_invariance``): oneDNN's one-row kernel
sums wide inputs in another order, so those layers run a lone row as two; a kernel with no invariant form is
reported (``batch_invariant`` False) and bf16 speculation refuses it (``specdec.speculative``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.hardware import EXACT_ROWS, probe, ranked, row_invariance

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


def _mkl_fp32(weight: torch.Tensor) -> Fn:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0])


def _aten(weight: torch.Tensor) -> Fn:
    return lambda x: F.linear(x, weight)


def _fp32_upcast(weight: torch.Tensor) -> Fn:
    w32 = weight.float()
    return lambda x: F.linear(x.float(), w32).to(weight.dtype)


DENSE: dict[torch.dtype, dict[str, Callable[[torch.Tensor], Fn]]] = {
    torch.bfloat16: {"onednn-prepacked": _onednn_bf16, "aten-bf16": _aten, "fp32-upcast": _fp32_upcast},
    torch.float32: {"mkl-prepacked": _mkl_fp32, "aten-fp32": _aten},
}


def candidates(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], Fn]]:
    """The dense kernels that run here for ``dtype`` (the probe decides about the prepacked ones)."""
    missing = {"onednn-prepacked": not probe().bf16_prepack_ok, "mkl-prepacked": not torch.backends.mkl.is_available()}
    return {name: make for name, make in DENSE.get(dtype, {}).items() if not missing.get(name)}


def _by_speed(dtype: torch.dtype, shape: torch.Size) -> dict[str, list[str]]:
    """This dtype's kernels, fastest first per shape class (one row: a decode step; 128 rows: prefill and
    evaluation), measured once per machine."""
    n, k = shape

    def timed(make: Callable[[torch.Tensor], Fn]):
        fn = make(torch.randn(n, k).to(dtype))
        return lambda rows: (lambda x: lambda: fn(x))(torch.randn(rows, k).to(dtype))

    names = candidates(dtype)
    return ranked(f"dense-{str(dtype).removeprefix('torch.')}/{n}x{k}", {c: timed(m) for c, m in names.items()})


def _invariant(fn: Fn, name: str, shape: torch.Size) -> tuple[Fn, bool]:
    """``fn`` in its batch-invariant form (a lone row run as two where that is what it takes), and whether
    one exists."""
    how = row_invariance((name, *shape), fn, shape[1])
    if how == "two-rows":
        return (lambda x: fn(torch.cat((x, x)))[:1] if x.shape[0] == 1 else fn(x)), True
    return fn, how == "alone"


def by_rows(narrow: Fn, make_wide: Callable[[], Fn]) -> Fn:
    """``narrow`` for up to ``EXACT_ROWS`` rows (decode steps and every verification), the wide kernel above
    (prefill, evaluation), built on its first call."""
    wide = functools.cache(make_wide)
    return lambda x: narrow(x) if x.shape[0] <= EXACT_ROWS else wide()(x)


def pack(weight: torch.Tensor) -> DenseKernel | None:
    """The prepacked kernel where the probe found it runs (measured fastest on every CPU kind seen); elsewhere
    the fastest fallback here. In bf16: for up to ``EXACT_ROWS`` rows the fastest at decode whose rows are
    batch-invariant (exact speculation; the fastest when none is), above that the fastest at 128 rows.
    Fallbacks are labelled as such."""
    makers = candidates(weight.dtype)
    if not makers:
        return None
    prepacked = [name for name in makers if name.endswith("-prepacked")]
    if prepacked:
        decode = batch = prepacked + [n for n in makers if n not in prepacked]
    else:
        rank = _by_speed(weight.dtype, weight.shape)
        decode, batch = rank["decode"], rank["batch"]
    missing = probe().bf16_prepack if weight.dtype == torch.bfloat16 else None
    fallback = f" (fallback: {missing})" if missing else ""
    if weight.dtype != torch.bfloat16:  # fp32 is not made batch-invariant: its greedy equality is tested
        return DenseKernel(makers[decode[0]](weight), decode[0] + fallback, False)
    tried = ((name, *_invariant(makers[name](weight), name, weight.shape)) for name in decode)
    first = next(tried)
    name, fn, invariant = first if first[2] else next((t for t in tried if t[2]), first)
    if batch[0] == name:
        return DenseKernel(fn, name + fallback, invariant)
    return DenseKernel(by_rows(fn, lambda: makers[batch[0]](weight)),
                       f"{name} up to {EXACT_ROWS} rows, {batch[0]} above{fallback}", invariant)


class DensePack:
    """A cached ``DenseKernel`` for one weight tensor, rebuilt when the tensor or its contents change."""

    def __init__(self):
        self.kernel: DenseKernel | None = None
        self._key = None

    def get(self, weight: torch.Tensor) -> DenseKernel | None:
        if weight.device.type != "cpu":
            return None
        key = (weight.data_ptr(), weight._version, weight.shape, weight.dtype)
        if self._key != key:
            self.kernel, self._key = pack(weight.detach()), key
        return self.kernel

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight)`` on the packed kernel (plain ``F.linear`` for grad, other dtypes/devices, and
        under ``torch.compile``, whose weight freezing prepacks it: ``runtime.compiled``)."""
        kernel = None
        if (x.dtype == weight.dtype and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and weight.requires_grad)):
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
        return kernel.name if kernel else "cublas" if self.weight.is_cuda else "aten"

    @property
    def batch_invariant(self) -> bool:
        if self.weight.device.type == "cuda":  # cuBLAS (F.linear) as is: probed, no two-row form
            return row_invariance(("cublas", *self.weight.shape), lambda x: F.linear(x, self.weight),
                                  self.weight.shape[1], self.weight.dtype, self.weight.device) == "alone"
        kernel = self._pack.get(self.weight)
        return bool(kernel and kernel.batch_invariant)
