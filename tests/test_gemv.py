"""quant/gemv.py: the AVX512-BF16 int4 / int8 GEMV kernels run their torch kernel's format (same weights, same
export), give the dequantized product, a row's output does not depend on the rows beside it, and they are left
out with the reason where they cannot run."""
import pytest
import torch

from quant.gemv import (Int4GemvKernel, Int8GemvKernel, _example, _runnable, cpu_kernel, gemv_missing, pack4,
                        unpack4)
from quant.qlinear import select_kernel
from quant.qmath import dequantize
from quant.scheme import parse_scheme
from runtime.errors import UserError
from runtime.hardware import row_invariance

pytestmark = pytest.mark.isa
RUNS = pytest.mark.skipif(_runnable() is not None, reason=f"the GEMV ops cannot run here: {_runnable()}")
FORMATS = [(Int4GemvKernel, "w4g32-asym", 48, 64), (Int4GemvKernel, "w4g32-sym", 192, 576),
           (Int4GemvKernel, "w4g64-asym", 80, 128), (Int4GemvKernel, "w4g128-asym", 64, 256),
           (Int4GemvKernel, "w4g256-sym", 16, 512), (Int8GemvKernel, "w8ch-sym", 48, 64),
           (Int8GemvKernel, "w8ch-sym", 80, 1536)]


def heavy_rows(m, k, seed=1):  # heavy-tailed rows expose a different summation order
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.randn(m, k, generator=g).exp()).bfloat16()


@RUNS
@pytest.mark.parametrize("cls,scheme,n,k", FORMATS)
def test_same_weights_as_the_torch_kernel_and_the_dequantized_product(cls, scheme, n, k):
    """48 and 80 rows: three and five blocks of 16, so the one-row path's four-block tiles leave a remainder."""
    q, scale, zero, spec = _example(scheme, n, k)
    ours, theirs = cls(q, scale, zero, spec), cls.replaces(q, scale, zero, spec)
    assert all(torch.equal(a, b) for a, b in zip(ours.export(), theirs.export()))
    assert sum(b.numel() * b.element_size() for b in ours.buffers()) == sum(
        b.numel() * b.element_size() for b in theirs.buffers())  # the same bytes stream
    w = dequantize(*theirs.export(), spec, torch.float32)
    for m in (1, 2, 5, 9, 40):
        x = heavy_rows(m, k)
        want = x.float() @ w.T
        got = ours(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()


@RUNS
def test_a_broken_layout_is_caught():
    """Negative control for the test above: two columns swapped in the packed bytes give a wrong product."""
    q, scale, zero, spec = _example("w4g32-sym", 32, 64)
    kernel = Int4GemvKernel(q, scale, zero, spec)
    x = heavy_rows(3, 64)
    good = kernel(x).float()
    u, s, t = unpack4(kernel.weight, 32, 64, 32)
    swapped = u.reshape(32, 2, 8, 2, 2).flip(3).reshape(32, 64)  # k + 2 <-> k within each piece
    kernel.weight = pack4(swapped, s, t, 32)
    assert (kernel(x).float() - good).abs().max() > 0.1 * good.abs().max()


@RUNS
@pytest.mark.parametrize("cls,scheme", [(Int4GemvKernel, "w4g32-sym"), (Int8GemvKernel, "w8ch-sym")])
def test_rows_are_bitwise_the_same_alone_and_in_a_batch(cls, scheme):
    """The probe every layer runs finds the kernel row-invariant at 1..33 rows; negative control: the same probe
    on a product whose batches go through the torch kernel (another summation order) finds lone rows differ."""
    args = _example(scheme, 64, 576)
    ours, theirs = cls(*args), cls.replaces(*args)
    x = heavy_rows(33, 576)
    assert torch.equal(torch.cat([ours(x[i:i + 1]) for i in range(33)]), ours(x))
    assert row_invariance(("test-" + cls.name, 64), ours, 576) == "alone"

    def mixed(rows):
        return ours(rows) if rows.shape[0] == 1 else theirs(rows)

    assert row_invariance(("test-" + cls.name + "-mixed", 64), mixed, 576) == "two-rows"


def test_not_used_under_the_avx2_override(monkeypatch):
    """Forced to AVX2 (as ``make test-avx2`` runs), layers run torch's kernels and naming ours is refused."""
    from runtime import hardware

    monkeypatch.setenv(hardware.OVERRIDE_ENV, "avx2")
    hardware.probe.cache_clear()
    gemv_missing.cache_clear()
    try:
        assert "not used under" in gemv_missing("int4gemv") and (cpu_kernel(4), cpu_kernel(8)) == ("int4pack",
                                                                                                    "int8pack")
        spec = parse_scheme("w4g32-sym").weights
        assert select_kernel(spec, None, (64, 64)).name == "int4pack"
        with pytest.raises(UserError, match="int4gemv"):
            select_kernel(spec, None, (64, 64), kernel="int4gemv")
    finally:
        monkeypatch.undo()
        hardware.probe.cache_clear()
        gemv_missing.cache_clear()
