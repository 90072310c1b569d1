"""The device field: resolution (cpu, cuda, auto), CUDA refused in one line where there is none, kernels picked
per device; the ``cuda``-marked tests run the runtime on a GPU (bench/gpu_check.py runs them) and skip here."""
import pytest
import torch

from evals.config import Config
from evals.record import hardware_info
from evals.roofline import measure_bandwidth
from quant.gemv import cpu_kernel
from quant.kvcache import make_cache_factory
from quant.qlinear import QuantizedLinear, cuda_op_missing, select_kernel
from quant.qmath import compute_qparams, dequantize, quantize
from quant.quantize import quantize_model
from quant.scheme import parse_scheme
from runtime.errors import UserError
from runtime.generate import Decoder, encode_prompt
from runtime.hardware import resolve_device, sync
from runtime.loading import load_model
from runtime.sampling import SamplingConfig
from specdec.speculative import SpeculativeDecoder
from test_cli_errors import assert_one_line_error, run_cli

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    auto = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == resolve_device(None) == auto
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    sync("cpu")  # a no-op off CUDA


def test_unknown_device():
    with pytest.raises(UserError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(UserError, match="unknown device 'tpu'"):
        Config(device="tpu")
    assert Config.from_dict(Config(device="cuda").to_dict()).device == "cuda"


@NO_CUDA
def test_cuda_refused_without_gpu():
    with pytest.raises(UserError, match="--device cpu"):
        resolve_device("cuda")


@NO_CUDA
def test_generate_cli_refuses_cuda(tiny_llama_dir):
    proc = run_cli("generate", str(tiny_llama_dir), "-p", "hi", "--device", "cuda", "--max-new-tokens", "2")
    assert_one_line_error(proc, "use --device cpu")


def test_load_model_on_cpu(tiny_llama_dir, one_thread):
    lm = load_model(tiny_llama_dir, "fp32", device="cpu")
    assert lm.device == torch.device("cpu")
    decoder = Decoder(lm, max_len=32)
    assert decoder.model.layers[0].self_attn.kv_cache.k.device == lm.device
    assert "cuda" not in hardware_info(lm.model)  # GPU fields only when the run used CUDA


def test_kernels_picked_per_device():
    """torch's packed int4/int8 CPU layouts never run on CUDA, nor the CUDA kernels on CPU."""
    w4 = parse_scheme("w4g32-sym").weights
    assert select_kernel(w4, None, (64, 64), device="cpu").name == cpu_kernel(4)
    with pytest.raises(UserError, match="on cuda"):
        select_kernel(w4, None, (64, 64), kernel="int4pack", device="cuda")
    with pytest.raises(UserError, match="on cpu"):
        select_kernel(w4, None, (64, 64), kernel="int4pack-cuda", device="cpu")


@NO_CUDA
def test_cuda_kernels_probed_without_gpu():
    """Without a GPU the CUDA kernels' probe says why, and a format asked for on cuda runs simulated."""
    assert cuda_op_missing("int4pack-cuda") and cuda_op_missing("int8-dequant-cuda")
    assert select_kernel(parse_scheme("w4g32-sym").weights, None, (64, 64), device="cuda").name == "simulated"


# ---- on a GPU ----

def _greedy(lm, n=24):
    ids = encode_prompt(lm.tokenizer, "the quick brown fox", chat=False)
    return Decoder(lm, max_len=len(ids) + n + 8).generate(ids, n, ignore_eos=True).tokens


@pytest.mark.cuda
def test_cuda_greedy_equals_cpu_fp32(tiny_llama_dir):
    cpu = load_model(tiny_llama_dir, "fp32", device="cpu")
    gpu = load_model(tiny_llama_dir, "fp32", device="cuda")
    assert gpu.device.type == "cuda"
    assert _greedy(gpu) == _greedy(cpu)


@pytest.mark.cuda
def test_cuda_sampling_is_seeded(tiny_llama_dir):
    lm = load_model(tiny_llama_dir, "fp32", device="cuda")
    ids = encode_prompt(lm.tokenizer, "hello", chat=False)
    sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    runs = [Decoder(lm, max_len=64).generate(ids, 16, sampling, ignore_eos=True).tokens for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.cuda
@pytest.mark.parametrize("proposer", ["ngram:min=1,max=3", "selfquant:w4g32-sym", "layerskip:1"])
def test_cuda_speculation_equals_plain(tiny_llama_dir, proposer):
    lm = load_model(tiny_llama_dir, "fp32", device="cuda")
    ids = encode_prompt(lm.tokenizer, "abcabcabc abcabc", chat=False)
    plain = Decoder(lm, max_len=64).generate(ids, 24, ignore_eos=True).tokens
    spec = SpeculativeDecoder(lm, proposer, 4, max_len=64).generate(ids, 24, ignore_eos=True)
    assert spec.tokens == plain


@pytest.mark.cuda
def test_cuda_quantized_weights_and_kv(tiny_llama_dir):
    lm = load_model(tiny_llama_dir, "bf16", device="cuda")
    report = quantize_model(lm, "w4g32-sym", "rtn", progress=False)
    assert report.kernels == {"int4pack-cuda": 14} and next(lm.model.parameters()).device.type == "cuda"
    ids = encode_prompt(lm.tokenizer, "hello", chat=False)
    out = Decoder(lm, max_len=64, cache_factory=make_cache_factory("k8tok-v8tok")).generate(ids, 8, ignore_eos=True)
    assert len(out.tokens) == 8


@pytest.mark.cuda
def test_cuda_record_and_bandwidth(tiny_llama_dir):
    lm = load_model(tiny_llama_dir, "bf16", device="cuda")
    _greedy(lm, 4)
    info = hardware_info(lm.model)["cuda"]
    assert info["gpu"] and info["cuda"] and info["peak_allocated_gib"] > 0
    assert measure_bandwidth(0.25, device="cuda") > 1e11  # HBM: far above 100 GB/s



def _cuda_layer(label: str, shape=(256, 512)):
    spec = parse_scheme(label).weights
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).cuda()
    scale, zero = compute_qparams(w, spec)
    q = quantize(w, scale, zero, spec)
    return QuantizedLinear(q, scale, zero, spec, shape[1], dtype=torch.bfloat16), q, scale, zero, spec


@pytest.mark.cuda
@pytest.mark.parametrize("label,kernel", [("w4g32-sym", "int4pack-cuda"), ("w4g128-asym", "int4pack-cuda"),
                                          ("w8ch-sym", "int8-dequant-cuda")])
def test_cuda_kernels_compute_their_format(label, kernel):
    """The CUDA kernels give the dequantized weight's product and export their codes exactly; negative control: the
    same comparison against a wrong weight (zero points negated, codes shifted) fails."""
    layer, q, scale, zero, spec = _cuda_layer(label)
    assert layer.kernel_name == kernel and not layer.simulated
    x = torch.randn(5, 512, device="cuda")
    got = layer(x.bfloat16()).float()

    def close(weight):
        want = x.bfloat16().float() @ weight.T
        return float((got - want).abs().max() / want.abs().max()) < 2e-2

    assert close(dequantize(q, scale, zero, spec, torch.float32))
    assert not close(dequantize((q + 1).clamp(max=2 ** (spec.bits - 1) - 1), scale, -zero, spec, torch.float32))
    codes, s, z = layer.export()
    assert torch.equal(codes.cpu(), q.cpu()) and torch.equal(z.cpu().flatten(), zero.to(torch.int8).cpu().flatten())


@pytest.mark.cuda
def test_cuda_compiled_step_equals_eager(tiny_llama_dir):
    """The compiled one-token step with CUDA graphs gives the eager step's greedy tokens (fp32)."""
    lm = load_model(tiny_llama_dir, "fp32", device="cuda")
    ids = encode_prompt(lm.tokenizer, "the quick brown fox", chat=False)
    eager = Decoder(lm, max_len=64).generate(ids, 16, ignore_eos=True).tokens
    compiled = Decoder(lm, max_len=64, compile_mode="reduce-overhead")
    assert compiled.generate(ids, 16, ignore_eos=True).tokens == eager
    assert compiled.step.fallback is None
