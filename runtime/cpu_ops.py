"""quantspec's own C++ ops (``runtime/csrc/gemv.cpp``): ``quantspec::bf16_gemv``, ``int4_gemv`` and ``int8_gemv``,
decode-sized products of bf16 / int4 / int8 weights and bf16 inputs on AVX-512 or AVX2, each output row run by the
same instructions whatever the number of rows beside it (bitwise row-invariant, as exact speculation needs). With
AVX512-BF16 they multiply with ``vdpbf16ps``; without it (Intel Ice Lake) the same arithmetic runs as two FMAs. On
AVX2 + FMA (AMD EPYC without AVX-512, or ``QUANTSPEC_CPU_FEATURES=avx2``) bf16 runs those two FMAs on two 8-lane
halves, and int4 / int8 codes are widened to fp32 and multiplied in one FMA each.
Whether they beat torch's kernel is measured per machine (``packed_linear.gemv_missing``, ``quant.gemv``).

They are built with torch's C++ extension loader (ninja and the C++ compiler; seconds, once per machine and torch
version, under ``$QUANTSPEC_HOME/extensions``) the first time a machine asks for them, and
registered with fake implementations so that compiled steps call them as extern kernels. ``ops_missing`` says why
they cannot run here; callers then use torch's kernels. Weight layouts: ``pack_bf16`` here, the int formats in
``quant/gemv.py``.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from runtime.hardware import cpu_flag, probe, quantspec_home

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-Werror=infinite-recursion"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl"]
VARIANTS = {"avx512-bf16": _AVX512 + ["-mavx512bf16"],  # vdpbf16ps where the CPU has it
            "avx512": _AVX512, "avx2": ["-mavx2", "-mfma"]}  # the source's three builds, by instruction set
ROWS = 16  # output rows per block of the packed layouts


def isa() -> str | None:
    """The instruction set the ops are built for here: AVX-512 where the CPU has it and no smaller set is forced,
    else AVX2 (+ FMA) where it has that, else None."""
    if cpu_flag("avx512") and not probe().forced:
        return "avx512"
    return "avx2" if cpu_flag("avx2") else None


def variant() -> str | None:
    """Which of ``VARIANTS`` this machine builds (None: none can run here)."""
    which = isa()
    return "avx512-bf16" if which == "avx512" and cpu_flag("avx512_bf16") else which


def cflags() -> list[str]:
    return CFLAGS + VARIANTS.get(variant(), [])


def build_dir() -> Path:
    """Where this source, these flags and this torch build the ops (a change to any of them builds anew)."""
    return quantspec_home() / "extensions" / f"gemv-{_build_key(tuple(cflags()))}"


@functools.cache
def _build_key(flags: tuple[str, ...]) -> str:
    """The source hashed once per process and flag set: the kernel verdicts ask for the build on every layer."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:12]


_LOADED: list[Path] = []  # the build this process loaded (one a process: the ops' names are global)


@functools.cache
def _build(where: Path) -> str | None:
    """Build and load the ops in ``where`` once per process; why they cannot be used, or None."""
    if _LOADED:  # the same build (source, flags, torch) may sit under another home
        loaded = _LOADED[0].name
        return None if loaded == where.name else f"this process loaded another build of them ({loaded})"
    from torch.utils import cpp_extension

    where.mkdir(parents=True, exist_ok=True)
    if not any(where.glob("*.so")):
        log.warning("building quantspec's bf16/int4/int8 GEMV kernels (once per machine and torch version)")
    try:
        cpp_extension.load("quantspec_gemv", [str(SOURCE)], extra_cflags=cflags(), extra_ldflags=["-fopenmp"],
                           build_directory=str(where), is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001  (any build failure means: use torch's kernels)
        return f"its C++ build failed ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]})"
    torch.library.register_fake("quantspec::bf16_gemv")(
        lambda x, packed, out_features: x.new_empty(x.shape[0], out_features))
    torch.library.register_fake("quantspec::int4_gemv")(
        lambda x, packed, group_size, out_features: x.new_empty(x.shape[0], out_features))
    torch.library.register_fake("quantspec::int8_gemv")(
        lambda x, packed, scales: x.new_empty(x.shape[0], scales.shape[0]))
    _LOADED.append(where)
    return None


def ops_missing() -> str | None:
    """Why the ops cannot run on this machine (built here when they can), or None."""
    if isa() is None:
        return "needs AVX2 with FMA or AVX-512 (F, BW, VL), which this CPU lacks"
    return _build(build_dir())


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] -> ``bf16_gemv``'s layout: per block of 16 rows and pair of columns, the 16 rows' pairs."""
    n, k = weight.shape
    return weight.reshape(n // ROWS, ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous().reshape(-1)


def bf16_fits(weight: torch.Tensor) -> bool:
    """Whether ``bf16_gemv`` takes this weight's shape (rows in blocks of 16, columns in fours)."""
    return weight.dtype == torch.bfloat16 and weight.shape[0] % ROWS == 0 and weight.shape[1] % 4 == 0
