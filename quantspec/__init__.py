"""quantspec's public Python API: everything the CLI does, as functions; and the registration calls an extension
needs. ``import quantspec`` and use these names; the packages below (runtime, quant, specdec, evals, studies)
are the implementation, layered in that order (docs/architecture.md).

    import quantspec
    lm = quantspec.load("default")                                    # runtime.loading.LoadedModel (bf16)
    q = quantspec.quantize("default", "w4g32-asym", method="gptq")    # report, fidelity, run record
    rec = quantspec.measure_acceptance(lm, "default", "ngram:min=2,max=4", [1, 2, 4], ["Hi"], "mine", 32)
"""
from __future__ import annotations

from pathlib import Path

from evals.acceptance import LosslessReport, check_lossless, measure_acceptance
from evals.backends.base import Backend, ServingConfig, register_backend
from evals.bench_sweep import benchmark
from evals.compare_backends import BackendComparison, compare_backends
from evals.config import Config
from evals.harness import EvalConfig, EvalReport, evaluate
from evals.harness import register_lm_factory as register_eval_backend
from evals.loadgen import LoadSpec
from evals.quant_report import Quantized, quantize
from evals.serving_metrics import SLO
from quant.actquant import Observer, register_observer
from quant.methods import WeightMethod, register_method
from quant.qlinear import Kernel, register_kernel
from quant.scheme import QuantScheme, parse_scheme, register_preset
from runtime.errors import UserError
from runtime.loading import DEFAULT_DTYPE, LoadedModel, load_model
from runtime.registry import Registry
from runtime.sampling import SamplingConfig
from specdec.proposers import Proposal, Proposer, build_proposer, register_proposer
from specdec.train_draft import TrainConfig, TrainResult
from specdec.train_draft import train_head as train_draft
from studies.objective import register_evaluator
from studies.pareto import StudySummary, load_summary
from studies.search import DEFAULT_STUDY_DIR, SearchOutcome, SearchSettings, run_search
from studies.storage import storage_url


def load(model: str | Path = "default", dtype: str = DEFAULT_DTYPE, threads: int | None = None,
         attention: str = "sdpa", device: str = "cpu") -> LoadedModel:
    """Load ``model`` (``default``, a local HF or compressed-tensors dir, a hub id) for native decoding on
    ``device`` (cpu, cuda, auto). ``attention="eager"`` is batch-invariant in bf16 (what speculation and lossless
    checks use)."""
    return load_model(model, dtype, threads, attention, device)


def search(settings: SearchSettings, evaluator, on_trial=None) -> SearchOutcome:
    """An Optuna study of configurations under a quality floor (``quantspec search``); ``evaluator`` from
    ``studies.objective.get_evaluator`` or a registered one."""
    return run_search(settings, evaluator, on_trial=on_trial)


def pareto(storage: str | None = None, study_name: str | None = None,
           study_dir: Path = DEFAULT_STUDY_DIR) -> StudySummary:
    """The speed/quality table of a stored study, Pareto-optimal rows marked (``quantspec pareto``)."""
    return load_summary(storage_url(storage, study_dir), study_name)


__all__ = [
    # run things
    "load", "quantize", "evaluate", "compare_backends", "benchmark", "measure_acceptance", "check_lossless", "search", "pareto",
    "build_proposer", "parse_scheme", "train_draft",
    # their inputs and results
    "Config", "LoadedModel", "Quantized", "EvalConfig", "EvalReport", "BackendComparison", "ServingConfig", "LoadSpec", "SLO", "SamplingConfig",
    "LosslessReport", "SearchSettings", "SearchOutcome", "StudySummary", "QuantScheme", "UserError",
    "DEFAULT_DTYPE", "TrainConfig", "TrainResult",
    # extend: subclass, then register
    "WeightMethod", "register_method", "register_preset", "Observer", "register_observer", "Kernel",
    "register_kernel", "Proposer", "Proposal", "register_proposer", "Backend", "register_backend",
    "register_eval_backend", "register_evaluator", "Registry",
]
