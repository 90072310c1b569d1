"""``nn.Linear`` whose inference forward runs on the best dense kernel this machine has (``runtime.hardware``).

At batch 1 decoding is one matrix-vector product per layer, and the plain ``F.linear`` GEMV reaches a fraction
of the memory bandwidth; the same product on a weight reordered once into the library's blocked layout is
faster (what inductor's weight freezing does; measured in bench/results, decode-*.json). Kernels, picked per dtype and machine:

* fp32: ``mkl-prepacked`` (MKL's packed GEMM) or ``aten-fp32`` (plain ``F.linear``).
* bf16: ``onednn-prepacked`` where the probe found oneDNN bf16 prepacking works (AVX-512 / AMX), ``aten-bf16``
  (plain ``F.linear``) or ``fp32-upcast`` (fp32 GEMM on an fp32 copy of the weight); where prepacking is
  missing the others are labelled as a fallback. For decode-sized products (up to ``EXACT_ROWS`` rows)
  ``bf16gemv``, quantspec's own AVX-512 / AVX2 kernel (``runtime/cpu_ops.py``), goes first where it runs, is right
  and streams one row faster than the kernel it displaces (``gemv_missing`` says why not otherwise), and runs wider
  products too where it also multiplies 128 rows faster (``gemv_wide``: where bf16 is emulated); compiled
  steps call it too, as an extern kernel on the same packed weight, so their verification rows are the one-token
  step's by construction.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cpu_ops import bf16_fits, build_dir, ops_missing, pack_bf16
from runtime.hardware import (EXACT_ROWS, beaten, cached_per_thread_count, measured_speeds, probe, ranked,
                              row_invariance, streamed_decode_us)

Fn = Callable[[torch.Tensor], torch.Tensor]


class GemvPart:
    """A linear's decode product on one of quantspec's ops (``runtime.cpu_ops``), whose weights are whole blocks of
    16 output rows: ``prepare`` fuses the linears of one input whose parts share a ``fuse_key`` into one call, each
    of the parts' ``BUFFERS`` concatenated (each output row bitwise the separate call's: the same blocks, the same
    instructions). ``product(x, buffers, out_features)`` runs the op on such buffers."""

    BUFFERS: tuple[str, ...] = ()
    out_features: int

    @property
    def fuse_key(self) -> tuple:
        raise NotImplementedError

    def product(self, x: torch.Tensor, buffers: tuple[torch.Tensor, ...], out_features: int) -> torch.Tensor:
        raise NotImplementedError

    def gemv_buffers(self) -> tuple[torch.Tensor, ...]:
        """This part's own ``BUFFERS`` (what ``product`` runs on for this layer alone)."""
        return tuple(getattr(self, name) for name in self.BUFFERS)


class _Bf16Gemv(GemvPart):
    """``quantspec::bf16_gemv`` on one packed weight (``packed``: what compiled steps pass the op)."""

    BUFFERS = ("packed",)

    def __init__(self, weight: torch.Tensor):
        self.packed, self.out_features, self.in_features = pack_bf16(weight), weight.shape[0], weight.shape[1]

    @property
    def fuse_key(self) -> tuple:
        return "bf16", self.in_features

    def product(self, x, buffers, out_features):
        return torch.ops.quantspec.bf16_gemv(x, buffers[0], out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.gemv_buffers(), self.out_features)


@dataclass
class DenseKernel:
    """One packed weight: ``fn`` computes ``x [M, K] -> [M, N]``; ``name`` and ``batch_invariant`` are reported;
    ``gemv``: the ``bf16gemv`` product where it runs the decode rows (compiled steps call its op on its weight)."""

    fn: Fn
    name: str
    batch_invariant: bool
    gemv: _Bf16Gemv | None = field(default=None, repr=False)


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
    torch.bfloat16: {"bf16gemv": _Bf16Gemv, "onednn-prepacked": _onednn_bf16, "aten-bf16": _aten,
                     "fp32-upcast": _fp32_upcast},
    torch.float32: {"mkl-prepacked": _mkl_fp32, "aten-fp32": _aten},
}
GEMV = "bf16gemv"


def candidates(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], Fn]]:
    """The dense kernels that run here for ``dtype`` (the probe decides about the prepacked ones, ``gemv_missing``
    about ``bf16gemv``)."""
    missing = {"onednn-prepacked": not probe().bf16_prepack_ok, "mkl-prepacked": not torch.backends.mkl.is_available(),
               GEMV: dtype == torch.bfloat16 and gemv_missing() is not None}
    return {name: make for name, make in DENSE.get(dtype, {}).items() if not missing.get(name)}


def gemv_missing() -> str | None:
    """Why ``bf16gemv`` does not run bf16 decode rows here (its ops cannot run, a wrong product, or slower than
    the kernel it would displace on one streamed row, beyond ``hardware.TIE``), or None."""
    return ops_missing() or _gemv_verdict(build_dir())


def displaced() -> str:
    """The dense kernel bf16 decode rows run where ``bf16gemv`` does not (what it must beat)."""
    return "onednn-prepacked" if probe().bf16_prepack_ok else "aten-bf16"


@cached_per_thread_count
def _gemv_verdict(build: Path, n: int = 1536, k: int = 576) -> str | None:
    """``bf16gemv``'s product checked, and timed against the kernel it would displace on one row of the default
    model's MLP shape, weights streamed from memory as decoding streams them (once per build of the ops and home:
    the timings are kept in its ``hardware.json``)."""
    g = torch.Generator().manual_seed(0)
    w, x = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((32, 128), (3, 128)))
    want = F.linear(x.float(), w.float())
    err = float((_Bf16Gemv(w)(x).float() - want).abs().max() / want.abs().max())
    if err > 1e-2:
        return f"wrong results (max relative error {err:.3g} against an fp32 product)"
    other = displaced()
    makers = {name: lambda seed, make=DENSE[torch.bfloat16][name]: make(
        torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)) for name in (GEMV, other)}
    us = streamed_decode_us(_gemv_probe(build), makers, n, k, bytes_per_weight=2)
    if beaten(us[GEMV], us[other]):
        return f"slower than {other} on one row here ({us[GEMV]} vs {us[other]} us)"
    return None


def _gemv_probe(build: Path, n: int = 1536, k: int = 576) -> str:
    return f"{GEMV}-vs-{displaced()}/{n}x{k}/streamed/{build.name}"  # re-measured per build


def gemv_wide() -> bool:
    """Whether ``bf16gemv`` also runs bf16 products wider than ``EXACT_ROWS`` (prefill, evaluation, calibration):
    where it runs and its probe's 128-row product beat the kernel it displaces beyond ``TIE`` (Intel Ice Lake,
    bf16 emulated: 2606 vs 4741 us against oneDNN's prepacked kernel)."""
    if gemv_missing() is not None:
        return False
    us = measured_speeds().get(_gemv_probe(build_dir()), {}).get("us", {}).get("batch", {})
    return GEMV in us and displaced() in us and beaten(us[displaced()], us[GEMV])


def _by_speed(dtype: torch.dtype, shape: torch.Size) -> dict[str, list[str]]:
    """This dtype's kernels, fastest first per shape class (one row: a decode step; 128 rows: prefill and
    evaluation), measured once per machine."""
    n, k = shape

    def timed(make: Callable[[torch.Tensor], Fn]):
        fn = functools.cache(lambda: make(torch.randn(n, k).to(dtype)))  # built only if the ranking is measured
        return lambda rows: (lambda f, x: lambda: f(x))(fn(), torch.randn(rows, k).to(dtype))

    names = {name: make for name, make in candidates(dtype).items() if name != GEMV}  # ranked apart (``pack``)
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
    the fastest fallback here. In bf16: for up to ``EXACT_ROWS`` rows ``bf16gemv`` where it runs and fits, else
    the fastest at decode whose rows are batch-invariant (exact speculation; the fastest when none is), above that
    the fastest at 128 rows (``bf16gemv`` too where it beat that kernel there, ``gemv_wide``). Fallbacks are
    labelled as such."""
    makers = candidates(weight.dtype)
    gemv = [GEMV] if makers.pop(GEMV, None) and bf16_fits(weight) else []  # ranked apart: decode rows only
    if not makers:
        return None
    prepacked = [name for name in makers if name.endswith("-prepacked")]
    if prepacked:
        decode = batch = prepacked + [n for n in makers if n not in prepacked]
    else:
        rank = _by_speed(weight.dtype, weight.shape)
        decode, batch = rank["decode"], rank["batch"]
    build = DENSE[weight.dtype]  # bf16gemv too
    missing = probe().bf16_prepack if weight.dtype == torch.bfloat16 else None
    fallback = f" (fallback: {missing})" if missing else ""
    if weight.dtype != torch.bfloat16:  # fp32 is not made batch-invariant: its greedy equality is tested
        return DenseKernel(build[decode[0]](weight), decode[0] + fallback, False)
    tried = ((name, *_invariant(build[name](weight), name, weight.shape)) for name in gemv + decode)
    first = next(tried)
    name, fn, invariant = first if first[2] else next((t for t in tried if t[2]), first)
    gemv_fn = fn if name == GEMV else None
    wide = GEMV if gemv_fn and batch[0] == displaced() and gemv_wide() else batch[0]
    if wide == name:
        return DenseKernel(fn, name + fallback, invariant, gemv_fn)
    return DenseKernel(by_rows(fn, lambda: build[wide](weight)),
                       f"{name} up to {EXACT_ROWS} rows, {wide} above{fallback}", invariant, gemv_fn)


class DensePack:
    """A cached ``DenseKernel`` for one weight tensor, rebuilt when the tensor or its contents change."""

    def __init__(self):
        self.kernel: DenseKernel | None = None
        self._key = None

    @property
    def gemv_weight(self) -> torch.Tensor | None:
        """The ``bf16gemv`` layout of the weight last packed (None: another kernel runs its decode rows)."""
        return self.kernel.gemv.packed if self.kernel and self.kernel.gemv else None

    def get(self, weight: torch.Tensor) -> DenseKernel | None:
        if weight.device.type != "cpu":
            return None
        key = (weight.data_ptr(), weight._version, weight.shape, weight.dtype)
        if self._key != key:
            self.kernel, self._key = pack(weight.detach()), key
        return self.kernel

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight)`` on the packed kernel (plain ``F.linear`` for grad, other dtypes/devices, and
        under ``torch.compile``, whose weight freezing prepacks it: ``runtime.compiled``; compiled steps of up to
        ``EXACT_ROWS`` rows call ``bf16gemv`` where it runs the eager decode rows, on the weight ``prepare`` packed)."""
        y = _compiled_gemv(x, self.gemv_weight, weight.shape[0])
        if y is not None:
            return y
        kernel = None
        if (x.dtype == weight.dtype and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and weight.requires_grad)):
            kernel = self.get(weight)
        if kernel is None:
            return F.linear(x, weight)
        return kernel.fn(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*x.shape[:-1], weight.shape[0])


def prepare(model: nn.Module) -> None:
    """Pack every layer's weight as it is now, before a compiled step traces the layers (it reads the packs), and
    fuse the linears each module lists in ``FUSE`` (same input) into one call where all have a ``gemv_part`` of one
    ``fuse_key`` (``bf16gemv``, or ``int8gemv`` / ``int4gemv`` of one format): their buffers concatenated, each
    layer's then a view of the fused one."""
    for module in model.modules():
        pack_ = getattr(module, "_pack", None)
        if isinstance(pack_, DensePack) and isinstance(getattr(module, "weight", None), torch.Tensor):
            pack_.get(module.weight)
    for module in model.modules():
        for names in getattr(module, "FUSE", ()):
            layers = [getattr(module, n) for n in names]
            parts = [getattr(layer, "gemv_part", None) for layer in layers]
            done = module.fused.get(names)
            if done and all(part and done.holds(part) for part in parts):
                continue  # fused by an earlier step's prepare, weights unchanged since
            module.fused[names] = None
            if all(parts) and len({part.fuse_key for part in parts}) == 1:
                module.fused[names] = Fused.of(parts, [layer.bias for layer in layers])


def gemv_only(model: nn.Module) -> bool:
    """Whether every linear layer of ``model`` (every module reporting a ``kernel_detail``) is a ``PackedLinear``
    whose decode rows run ``bf16gemv`` (after ``prepare``)."""
    layers = [m for m in model.modules() if hasattr(m, "kernel_detail")]
    return bool(layers) and all(isinstance(m, PackedLinear) and m._pack.gemv_weight is not None for m in layers)


@dataclass
class Fused:
    """Linears of one input as one call: the first layer's part (whose op runs), the concatenated buffers, output
    sizes, biases (None where a layer has none)."""

    part: GemvPart
    buffers: tuple[torch.Tensor, ...]
    sizes: list[int]
    biases: list[torch.Tensor | None]

    @classmethod
    def of(cls, parts: list[GemvPart], biases: list[torch.Tensor | None]) -> "Fused":
        """The parts' buffers concatenated, each part's buffers then views of them (no second copy)."""
        buffers = []
        for name in parts[0].BUFFERS:
            own = [getattr(part, name) for part in parts]
            fused = torch.cat([t.reshape(-1) for t in own])
            for part, view in zip(parts, fused.split([t.numel() for t in own])):
                setattr(part, name, view.view(getattr(part, name).shape))
            buffers.append(fused)
        return cls(parts[0], tuple(buffers), [part.out_features for part in parts], biases)

    def holds(self, part: GemvPart) -> bool:
        """Whether ``part``'s first buffer is still a view of this fused one."""
        return getattr(part, part.BUFFERS[0]).untyped_storage().data_ptr() == \
            self.buffers[0].untyped_storage().data_ptr()


def linears(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of ``module``'s linears ``names`` (one of its ``FUSE``) on ``x``: in a compiled step of up to
    ``EXACT_ROWS`` bf16 rows one call where ``prepare`` fused them, else a call each."""
    fused = module.fused.get(names)
    rows = _compiled_rows(x) if fused else None
    if rows is None:
        return [getattr(module, n)(x) for n in names]
    y = fused.part.product(rows, fused.buffers, sum(fused.sizes)).reshape(*x.shape[:-1], -1)
    return [out if bias is None else out + bias for out, bias in zip(y.split(fused.sizes, -1), fused.biases)]


def _compiled_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as [rows, in] inside a compiled step of up to ``EXACT_ROWS`` bf16 rows, where quantspec's ops run the
    linears; None elsewhere (eager, wider or other-dtype inputs)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if torch.compiler.is_compiling() and rows.shape[0] <= EXACT_ROWS and x.dtype == torch.bfloat16 else None


def _compiled_gemv(x: torch.Tensor, packed: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    """``bf16gemv``'s product of ``x`` and ``packed`` inside a compiled step (``_compiled_rows``); None elsewhere
    or without a packed weight."""
    rows = _compiled_rows(x) if packed is not None else None
    if rows is None:
        return None
    return torch.ops.quantspec.bf16_gemv(rows, packed, out_features).reshape(*x.shape[:-1], out_features)


class PackedLinear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters and state dict) with a cached prepacked inference path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pack = DensePack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._pack.linear(x, self.weight)
        return y + self.bias if self.bias is not None else y

    @property
    def gemv_part(self) -> GemvPart | None:
        """The ``bf16gemv`` product of the weight last packed (None: another kernel runs its decode rows)."""
        return self._pack.kernel.gemv if self._pack.kernel else None

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
