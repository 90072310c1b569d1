"""quantspec's public Python API: everything the CLI does, as functions; and the registration calls an extension
needs. ``import quantspec`` and use these names; the packages below (runtime, quant, specdec, evals, studies)
are the implementation, layered in that order (docs/architecture.md).

    import quantspec
    lm = quantspec.load("default")                                    # runtime.loading.LoadedModel (bf16)
    q = quantspec.quantize("default", "w4g32-asym", method="gptq")    # report, fidelity, run record
    rec = quantspec.measure_acceptance(lm, "default", "ngram:min=2,max=4", [1, 2, 4], ["Hi"], "mine", 32)
"""
from __future__ import annotations

import importlib
from pathlib import Path

from evals.acceptance import LosslessReport, check_lossless, measure_acceptance
from evals.decode_speed import compare_decode
from evals.config import Config
from evals.harness import EvalConfig, EvalReport, evaluate
from evals.harness import register_lm_factory as register_eval_backend
from evals.quant_report import Quantized, quantize
from evals.record import write_json_atomic as write_json
from quant.actquant import Observer, register_observer
from quant.calibration import CalibConfig
from quant.methods import WeightMethod, register_method
from quant.qlinear import Kernel, register_kernel
from quant.scheme import PRESETS as SCHEME_PRESETS, QuantScheme, parse_scheme, register_preset
from quant.rotation import ROTATIONS
from quant.sizing import ModelInfo, model_info
from runtime.answer import Answer
from runtime.answer import answer as generate
from runtime.compiled import DEFAULT_MODE as DEFAULT_COMPILE_MODE, CompileChoice, resolve_compile
from runtime.data import load_prompts
from runtime.errors import UserError
from runtime.loading import DEFAULT_DTYPE, LoadedModel, load_model
from runtime.measure import SpeedProtocol
from runtime.model_store import fetch_default_model as fetch_model
from runtime.registry import Registry
from runtime.sampling import SamplingConfig
from serving.backends.base import Backend, ServingConfig, register_backend
from serving.bench_sweep import benchmark
from serving.compare_backends import BackendComparison, compare_backends
from serving.loadgen import LoadSpec
from serving.serving_metrics import SLO
from serving.vllm_bench_schema import save_results as save_vllm_bench_results
from specdec.lossless import ALPHA
from specdec.proposers import Proposal, Proposer, build_proposer, register_proposer
from specdec.sweep import parse_ks
from specdec.train_draft import TrainConfig, TrainResult, parse_layers
from specdec.train_draft import train_head as train_draft
from studies.defaults import DEFAULT_STUDY_DIR, GRACE_S, HEARTBEAT_S, require_optuna
from studies.objective import get_evaluator, register_evaluator
from studies.space import load_space

DEMO_DIR = Path("runs/demo")


def load(model: str | Path = "default", dtype: str = DEFAULT_DTYPE, threads: int | None = None,
         attention: str = "sdpa", device: str = "cpu") -> LoadedModel:
    """Load ``model`` (``default``, a local HF or compressed-tensors dir, a hub id) for native decoding on
    ``device`` (cpu, cuda, auto). ``attention="eager"`` is batch-invariant in bf16 (what speculation and lossless
    checks use)."""
    return load_model(model, dtype, threads, attention, device)


def search(settings: SearchSettings, evaluator, on_trial=None, on_wait=None) -> SearchOutcome:
    """An Optuna study of configurations under a quality floor (``quantspec search``); ``evaluator`` from
    ``get_evaluator`` or a registered one; ``on_trial(study, trial)`` after each trial, ``on_wait(line)`` while
    a joining worker waits for the study's creator."""
    require_optuna("quantspec.search")
    from studies.search import run_search

    return run_search(settings, evaluator, on_trial=on_trial, on_wait=on_wait)


DEMO_FLOOR = "0.7"  # the demo's quality floor (relative to the reference), see ``demo_settings``


def demo_settings(n_trials: int = 8, data_dir: str | None = None, threads: int | None = None):
    """(SearchSettings, evaluator) of the small search ``quantspec demo`` runs: studies/spaces/demo.yaml on the
    default model, floor ``DEMO_FLOOR`` (0.7) of the reference's arc_easy accuracy on 50 items, a fresh study in
    runs/demo. The floor is what 50 items can decide: at the reference's ~45% there, 0.9 could be shown for no
    configuration (even the reference's own answers fell short of it: about 100 items would decide it), so every
    quantized point read infeasible whatever its flips; 0.8 failed a point that lost one item and gained none (its
    score interval's lower bound -0.001 at the reference's 48%: w8ch-sym in CI on an AVX2 EPYC), and 0.7 passes
    up to two lost items there. Speed is
    one Spec-Bench prompt (95 tokens) x 64 tokens: one cache span (256) per configuration, where the second prompt
    (517 tokens x 32) built every step again over 768 positions and its prefill outweighed the decode being ranked
    (a search of 12 min in CI on an AMX Xeon, 7.9 min after this). Its length gate runs 4 prompts to 128 tokens,
    each within those 256 positions (prompts longer are skipped), so it reads the timed runs' span; one prompt
    decided nothing (``studies.length_gate``). Its steps compile in inductor's ``default`` mode, chosen by cost: on
    an AMX Xeon max-autotune's frozen bf16 steps build unrolled (no GEMM template inside a region), 127-143 s per
    span against default's 14-18 s, and its reference trial took 316 s against 110 s."""
    require_optuna("quantspec.demo_settings")
    from studies.search import SearchSettings

    settings = SearchSettings(space=load_space("demo"), floor=DEMO_FLOOR, n_trials=n_trials, study_dir=DEMO_DIR, seed=0)
    return settings, get_evaluator("real", data_dir=data_dir, limit=50, num_prompts=1, output_len=64, threads=threads,
                                    length_tokens=128, length_prompts=4, length_positions=256, compile="default")


def summarize(study) -> StudySummary:
    """The speed/quality table of a study object (``SearchOutcome.study``)."""
    require_optuna("quantspec.summarize")
    from studies.pareto import summarize as summarize_study

    return summarize_study(study)


def study_url(storage: str | None = None, study_dir: Path = DEFAULT_STUDY_DIR) -> str:
    """Where a study lives, as shown to users (passwords masked)."""
    require_optuna("quantspec.study_url")
    from studies.storage import shown_url, storage_url

    return shown_url(storage_url(storage, study_dir))


def pareto(storage: str | None = None, study_name: str | None = None,
           study_dir: Path = DEFAULT_STUDY_DIR) -> StudySummary:
    """The speed/quality table of a stored study, Pareto-optimal rows marked (``quantspec pareto``)."""
    require_optuna("quantspec.pareto")
    from studies.pareto import load_summary
    from studies.storage import storage_url

    if storage is None and not (Path(study_dir) / "study.db").exists():
        raise UserError(f"no study storage at {Path(study_dir) / 'study.db'}: pass --storage URL or run "
                        "`quantspec search`")
    return load_summary(storage_url(storage, study_dir), study_name)


def dashboard(storage: str | None = None, study_dir: Path = DEFAULT_STUDY_DIR, host: str = "127.0.0.1",
              port: int = 8080) -> DashboardServer:
    """optuna-dashboard on a stored study, bound and not yet serving (``quantspec dashboard``): call
    ``serve_forever()`` on it, or use it as a context manager to serve from a background thread; ``.url``."""
    require_optuna("quantspec.dashboard")
    from studies.dashboard import open_dashboard

    return open_dashboard(storage, study_dir, host, port)


_NEED_OPTUNA = {"SearchSettings": "studies.search", "SearchOutcome": "studies.search", "StudySummary": "studies.pareto",
                "DashboardServer": "studies.dashboard"}


def __getattr__(name: str):
    """The search's types, imported on first use (they need optuna; the rest of the API does not)."""
    if name not in _NEED_OPTUNA:
        raise AttributeError(f"module 'quantspec' has no attribute {name!r}")
    require_optuna(f"quantspec.{name}")
    return getattr(importlib.import_module(_NEED_OPTUNA[name]), name)


__all__ = [
    # run things
    "load", "generate", "quantize", "evaluate", "compare_backends", "benchmark", "compare_decode", "measure_acceptance",
    "check_lossless", "search", "demo_settings", "summarize", "pareto", "dashboard", "build_proposer", "parse_scheme",
    "train_draft", "model_info", "fetch_model",
    # parse and read what they take
    "parse_ks", "parse_layers", "load_prompts", "load_space", "get_evaluator", "write_json", "save_vllm_bench_results", "study_url",
    # their inputs and results
    "Config", "LoadedModel", "Quantized", "EvalConfig", "EvalReport", "BackendComparison", "ServingConfig", "LoadSpec", "SLO", "SamplingConfig",
    "LosslessReport", "SearchSettings", "SearchOutcome", "StudySummary", "DashboardServer", "QuantScheme", "UserError",
    "DEFAULT_DTYPE", "SCHEME_PRESETS", "ROTATIONS",
    "TrainConfig", "TrainResult", "Answer", "ModelInfo", "CalibConfig", "SpeedProtocol",
    "DEFAULT_COMPILE_MODE", "CompileChoice", "resolve_compile", "DEFAULT_STUDY_DIR", "DEMO_DIR", "GRACE_S", "HEARTBEAT_S", "ALPHA", "require_optuna",
    # extend: subclass, then register
    "WeightMethod", "register_method", "register_preset", "Observer", "register_observer", "Kernel",
    "register_kernel", "Proposer", "Proposal", "register_proposer", "Backend", "register_backend",
    "register_eval_backend", "register_evaluator", "Registry",
]
