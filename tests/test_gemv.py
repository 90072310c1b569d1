"""runtime/cpu_ops.py, quant/gemv.py: the AVX-512 / AVX2 int4 / int8 GEMV kernels run their torch kernel's format
(same weights, same export), give the dequantized product, the bf16 one the plain product; a row's output does not
depend on the rows beside it; bf16 layers run ``bf16gemv`` for decode rows, eager and compiled; every kernel is left
out with the reason where it cannot run."""
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import quant.gemv
from quant.gemv import Int4GemvKernel, Int8GemvKernel, _example, cpu_kernel, gemv_missing, pack4, unpack4
from quant.qlinear import select_kernel
from quant.qmath import dequantize
from quant.scheme import parse_scheme
from runtime import packed_linear
from runtime.cpu_ops import ops_missing, pack_bf16
from runtime.errors import UserError
from runtime.hardware import EXACT_ROWS, row_invariance

pytestmark = pytest.mark.isa
RUNS = pytest.mark.skipif(ops_missing() is not None, reason=f"the GEMV ops cannot run here: {ops_missing()}")
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
@pytest.mark.parametrize("n,k", [(16, 4), (48, 64), (80, 576), (32, 1540)])
def test_bf16_gemv_is_the_plain_product(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    gemv = packed_linear.DENSE[torch.bfloat16]["bf16gemv"](w)
    for m in (1, 2, 5, 9, 40):
        x = heavy_rows(m, k)
        want = x.float() @ w.float().T
        got = gemv(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()
    # negative control: the packed layout with two columns of each pair swapped gives another product
    gemv.packed = pack_bf16(w.reshape(n, k // 2, 2).flip(2).reshape(n, k))
    x = heavy_rows(3, k)
    assert (gemv(x).float() - x.float() @ w.float().T).abs().max() > 0.1 * (x.float() @ w.float().T).abs().max()


@RUNS
def test_bf16_layers_run_bf16gemv_for_decode_rows_eager_and_compiled():
    """Where ``gemv_missing`` finds it right and faster here, a bf16 layer runs ``bf16gemv`` up to EXACT_ROWS rows
    and its usual kernel above (``bf16gemv`` too where it won the 128-row probe, ``gemv_wide``); a compiled step calls the op on the weight ``prepare`` packed (negative control:
    that packed weight zeroed, the compiled output is zero, the plain product of the weight not)."""
    layer = packed_linear.PackedLinear(576, 192, bias=False).to(torch.bfloat16)
    if packed_linear.gemv_missing():
        pytest.skip(f"bf16gemv not used here: {packed_linear.gemv_missing()}")
    x = heavy_rows(3, 576)
    with torch.no_grad():
        assert torch.equal(layer(x), packed_linear.DENSE[torch.bfloat16]["bf16gemv"](layer.weight)(x))
        wide = "bf16gemv" if packed_linear.gemv_wide() else f"bf16gemv up to {EXACT_ROWS} rows,"
        assert layer.kernel_detail.startswith(wide) and layer.batch_invariant
        packed_linear.prepare(layer)
        step = torch.compile(layer, fullgraph=True, dynamic=False)
        assert torch.equal(step(x), layer(x))
        layer._pack.gemv_weight.zero_()
        assert not step(x).any() and F.linear(x, layer.weight).any()


# The negative control's batches: a split-K product, each 64-column partial rounded to bf16 (torch's own kernels
# summed in our order on AVX2, AMD EPYC: bf16's F.linear and int4pack gave our kernels' bits; so did the exact
# product rounded once, where fp32 sums rarely cross a bf16 rounding boundary)
def split_k(w, block=64):
    w = w.float()
    return lambda rows: sum((rows[:, i:i + block].float() @ w[:, i:i + block].T).bfloat16().float()
                            for i in range(0, w.shape[1], block)).bfloat16()


def int_pair(cls, scheme):
    q, scale, zero, spec = _example(scheme, 64, 576)
    theirs = cls.replaces(q, scale, zero, spec)
    return cls.name, cls(q, scale, zero, spec), split_k(dequantize(*theirs.export(), spec, torch.float32))


def bf16_pair():
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    return "bf16gemv", packed_linear.DENSE[torch.bfloat16]["bf16gemv"](w), split_k(w)


@RUNS
@pytest.mark.parametrize("pair", [lambda: int_pair(Int4GemvKernel, "w4g32-sym"),
                                  lambda: int_pair(Int8GemvKernel, "w8ch-sym"), bf16_pair],
                         ids=["int4gemv", "int8gemv", "bf16gemv"])
def test_rows_are_bitwise_the_same_alone_and_in_a_batch(pair, monkeypatch):
    """The probe every layer runs (measured here, not read from the home's cache) finds the kernel row-invariant at
    1..33 rows; negative control: the same probe on a product whose batches go through another kernel (another
    summation order) finds lone rows differ."""
    from runtime import hardware

    monkeypatch.setattr(hardware, "probed_once", lambda key, measure: measure())
    name, ours, theirs = pair()
    x = heavy_rows(33, 576)
    assert torch.equal(torch.cat([ours(x[i:i + 1]) for i in range(33)]), ours(x))
    assert row_invariance(("test-" + name, 64), ours, 576) == "alone"

    def mixed(rows):
        return ours(rows) if rows.shape[0] == 1 else theirs(rows)

    # not "alone": "two-rows" where torch's batches agree among themselves (AMD EPYC), None where they too depend on
    # the batch (oneDNN's bf16 GEMM on an AMX Xeon)
    assert row_invariance(("test-" + name + "-mixed", 64), mixed, 576) in ("two-rows", None)


def test_built_for_avx2_under_the_override_and_left_out_on_a_cpu_without_avx2(monkeypatch):
    """Forced to AVX2 (as ``make test-avx2`` runs) the ops build from their AVX2 code (no AVX-512 flag, a build of
    its own); on a CPU with neither AVX2 nor AVX-512 every kernel is left out with the reason, layers run torch's
    kernels (bf16 ones too) and naming ours is refused."""
    from runtime import cpu_ops, hardware

    monkeypatch.setenv(hardware.OVERRIDE_ENV, "avx2")
    hardware.probe.cache_clear()
    try:
        assert cpu_ops.isa() == "avx2" and "-mavx2" in cpu_ops.cflags()
        assert not any("avx512" in flag for flag in cpu_ops.cflags())
        monkeypatch.setattr(cpu_ops, "cpu_flag", lambda name: False)
        assert "needs AVX2" in gemv_missing("int4gemv") and (cpu_kernel(4), cpu_kernel(8)) == ("int4pack",
                                                                                               "int8pack")
        assert "needs AVX2" in packed_linear.gemv_missing()
        assert "bf16gemv" not in packed_linear.candidates(torch.bfloat16)
        spec = parse_scheme("w4g32-sym").weights
        assert select_kernel(spec, None, (64, 64)).name == "int4pack"
        with pytest.raises(UserError, match="int4gemv"):
            select_kernel(spec, None, (64, 64), kernel="int4gemv")
    finally:
        monkeypatch.undo()
        hardware.probe.cache_clear()


@RUNS
def test_a_verdict_reached_under_another_build_is_not_kept_for_this_one(monkeypatch):
    """A process that forced another instruction set (``make test-avx2``'s override, in a worker that loaded this
    build) is told "another build loaded" for that build only; back on this one, the kernel's own verdict holds.
    Negative control: the verdict cached by kernel name, as it once was, keeps the other build's answer."""
    from runtime import cpu_ops

    here = gemv_missing("int8gemv")
    by_name = functools.cache(gemv_missing)
    other = cpu_ops.build_dir().with_name("gemv-another-build")
    for module in (cpu_ops, quant.gemv):
        monkeypatch.setattr(module, "build_dir", lambda: other)
    assert "another build" in gemv_missing("int8gemv") and "another build" in by_name("int8gemv")
    monkeypatch.undo()
    assert gemv_missing("int8gemv") == here
    assert "another build" in by_name("int8gemv")  # the hazard


@RUNS
@pytest.mark.parametrize("scheme,kernel", [(None, packed_linear.GEMV), ("W8A16", "int8gemv"),
                                           ("w4g32-sym", "int4gemv")])
def test_fused_linears_give_each_layers_own_rows(tiny_llama_dir, scheme, kernel):
    """``prepare`` fuses q/k/v and gate/up into one call per module for compiled steps (``bf16gemv``, or
    ``int8gemv`` / ``int4gemv`` for quantized layers): each output is bitwise the layer's own (the same 16-row
    blocks), biases added; the layers' buffers become views of the fused ones (no second copy). Negative control:
    the fused weight with two layers' blocks swapped gives other rows."""
    from quant.quantize import quantize_model
    from runtime.loading import load_model

    lm = load_model(tiny_llama_dir, "bf16", attn_implementation="eager")
    why = packed_linear.gemv_missing() if scheme is None else gemv_missing(kernel)
    if why:
        pytest.skip(f"{kernel} not used here: {why}")
    if scheme:
        quantize_model(lm, scheme, progress=False)
    attn = lm.model.layers[0].self_attn
    attn.k_proj.bias = torch.nn.Parameter(torch.randn(attn.k_proj.out_features).bfloat16())
    packed_linear.prepare(lm.model)
    names = attn.FUSE[0]
    fused = attn.fused[names]
    parts = [getattr(attn, n).gemv_part for n in names]
    assert fused is not None and all(fused.holds(part) for part in parts)
    assert all(m.fused[m.FUSE[0]] is not None for m in (lm.model.layers[1].self_attn, lm.model.layers[1].mlp))
    x = heavy_rows(5, attn.q_proj.in_features)[None]
    with torch.no_grad():
        own = [getattr(attn, n)(x) for n in names]
        step = torch.compile(lambda v: packed_linear.linears(attn, names, v), fullgraph=True, dynamic=False)
        assert all(torch.equal(a, b) for a, b in zip(step(x), own))
        q_size, k_size = (getattr(part, part.BUFFERS[0]).numel() for part in parts[:2])
        weight = fused.buffers[0]
        weight[:k_size] = weight[q_size:q_size + k_size].clone()  # k's blocks where q's first ones were
        assert not torch.equal(step(x)[0], own[0])


@RUNS
def test_the_speed_verdicts_follow_the_thread_count(monkeypatch):
    """Whether a GEMV kernel is used is decided from timings, which are kept per torch thread count
    (``hardware.json``), and so is the verdict: a process that asked on two threads and then runs on one (the
    suite's one-thread modules) gets the one-thread verdict (on an AMX Xeon bf16gemv lost to oneDNN on two threads:
    a step built on one thread was frozen for it). Negative control: the verdict cached once per process, as it was,
    keeps the first."""

    from runtime import hardware

    def timed(name, makers, n, k, **_):  # the kernel's own first on one thread, last on two
        mine, theirs = makers
        return {mine: 1.0, theirs: 2.0} if torch.get_num_threads() == 1 else {mine: 2.0, theirs: 1.0}

    monkeypatch.setattr(packed_linear, "streamed_decode_us", timed)
    monkeypatch.setattr(hardware, "streamed_decode_us", timed)
    verdicts = {"bf16gemv": lambda: packed_linear.gemv_missing(), "int8gemv": lambda: gemv_missing("int8gemv")}
    once = functools.cache(packed_linear._gemv_verdict.__wrapped__)
    threads = torch.get_num_threads()
    packed_linear._gemv_verdict.cache_clear()
    quant.gemv._verdict.cache_clear()
    try:
        answers = []
        for n in (2, 1):
            torch.set_num_threads(n)
            answers.append({name: verdict() for name, verdict in verdicts.items()} | {"once": once(Path())})
    finally:
        torch.set_num_threads(threads)
        packed_linear._gemv_verdict.cache_clear()
        quant.gemv._verdict.cache_clear()
    assert all("slower than" in why for why in answers[0].values())
    assert answers[1]["bf16gemv"] is None and answers[1]["int8gemv"] is None
    assert answers[1]["once"] == answers[0]["once"]  # negative control


@RUNS
def test_a_tie_on_the_probe_goes_to_our_kernel(monkeypatch):
    """``bf16gemv`` runs where the probe times it within ``hardware.TIE`` of the kernel it displaces (181 vs 178 us:
    one AMX Xeon ranked that pair both ways between runs) and not beyond it; negative control: the strict rule
    (ours must be faster) refused that tie, so which kernel ran, and the reference's greedy text, followed noise."""
    from runtime import hardware

    other = packed_linear.displaced()
    timings = {}
    monkeypatch.setattr(packed_linear, "streamed_decode_us", lambda *_, **__: timings)
    for tie, ours, verdict in ((hardware.TIE, 181.0, None), (hardware.TIE, 178.0 * (1 + hardware.TIE) + 1, "slower"),
                               (0.0, 181.0, "slower")):  # the last: the strict rule
        monkeypatch.setattr(hardware, "TIE", tie)
        timings.update({packed_linear.GEMV: ours, other: 178.0})
        packed_linear._gemv_verdict.cache_clear()
        try:
            got = packed_linear._gemv_verdict(Path("test-tie"))
        finally:
            packed_linear._gemv_verdict.cache_clear()
        assert got is None if verdict is None else got.startswith(f"slower than {other}")


def test_bf16gemv_runs_wide_products_only_where_it_won_the_128_row_probe(monkeypatch):
    """``gemv_wide``: on Intel Ice Lake (bf16 emulated) the probe's 128-row product took 2606 us on ``bf16gemv`` and
    4741 us on oneDNN's prepacked kernel, so prefill and evaluation run it too; within ``hardware.TIE``, or where the
    ops cannot run (negative controls), wide products stay on the kernel ranked fastest at 128 rows."""
    from runtime import hardware

    other = packed_linear.displaced()
    timings = {}
    monkeypatch.setattr(packed_linear, "gemv_missing", lambda: None)
    monkeypatch.setattr(packed_linear, "measured_speeds", lambda: {
        packed_linear._gemv_probe(packed_linear.build_dir()): {"us": {"batch": timings}}})
    timings.update({packed_linear.GEMV: 2606.0, other: 4741.0})
    assert packed_linear.gemv_wide()
    timings.update({packed_linear.GEMV: 2606.0, other: 2606.0 * (1 + hardware.TIE) * 0.99})
    assert not packed_linear.gemv_wide()
    timings.update({packed_linear.GEMV: 2606.0, other: 4741.0})
    monkeypatch.setattr(packed_linear, "gemv_missing", lambda: "needs AVX2 with FMA or AVX-512 (F, BW, VL), which this CPU lacks")
    assert not packed_linear.gemv_wide()
