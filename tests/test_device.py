"""The device field: resolution (cpu, cuda, auto), CUDA refused in one line where there is none, kernels picked
per device; the ``cuda``-marked tests run the runtime on a GPU (bench/gpu_check.py runs them) and skip here."""
import pytest
import torch

from evals.config import Config
from evals.record import hardware_info
from evals.roofline import measure_bandwidth
from quant.kvcache import make_cache_factory
from quant.qlinear import select_kernel
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
    """torch's packed int4/int8 CPU layouts never run on CUDA: the format falls back to the simulated kernel."""
    w4 = parse_scheme("w4g32-sym").weights
    assert select_kernel(w4, None, (64, 64), device="cpu").name == "int4pack"
    assert select_kernel(w4, None, (64, 64), device="cuda").name == "simulated"
    with pytest.raises(UserError, match="on cuda"):
        select_kernel(w4, None, (64, 64), kernel="int4pack", device="cuda")


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
    assert report.simulated and next(lm.model.parameters()).device.type == "cuda"
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

