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
from studies.defaults import DEFAULT_STUDY_DIR, require_optuna


def load(model: str | Path = "default", dtype: str = DEFAULT_DTYPE, threads: int | None = None,
         attention: str = "sdpa", device: str = "cpu") -> LoadedModel:
    """Load ``model`` (``default``, a local HF or compressed-tensors dir, a hub id) for native decoding on
    ``device`` (cpu, cuda, auto). ``attention="eager"`` is batch-invariant in bf16 (what speculation and lossless
    checks use)."""
    return load_model(model, dtype, threads, attention, device)


def search(settings: SearchSettings, evaluator, on_trial=None) -> SearchOutcome:
    """An Optuna study of configurations under a quality floor (``quantspec search``); ``evaluator`` from
    ``studies.objective.get_evaluator`` or a registered one."""
    require_optuna("quantspec.search")
    from studies.search import run_search

    return run_search(settings, evaluator, on_trial=on_trial)


def pareto(storage: str | None = None, study_name: str | None = None,
           study_dir: Path = DEFAULT_STUDY_DIR) -> StudySummary:
    """The speed/quality table of a stored study, Pareto-optimal rows marked (``quantspec pareto``)."""
    require_optuna("quantspec.pareto")
    from studies.pareto import load_summary
    from studies.storage import storage_url

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
    "load", "quantize", "evaluate", "compare_backends", "benchmark", "measure_acceptance", "check_lossless", "search", "pareto",
    "dashboard", "build_proposer", "parse_scheme", "train_draft",
    # their inputs and results
    "Config", "LoadedModel", "Quantized", "EvalConfig", "EvalReport", "BackendComparison", "ServingConfig", "LoadSpec", "SLO", "SamplingConfig",
    "LosslessReport", "SearchSettings", "SearchOutcome", "StudySummary", "DashboardServer", "QuantScheme", "UserError",
    "DEFAULT_DTYPE", "TrainConfig", "TrainResult",
    # extend: subclass, then register
    "WeightMethod", "register_method", "register_preset", "Observer", "register_observer", "Kernel",
    "register_kernel", "Proposer", "Proposal", "register_proposer", "Backend", "register_backend",
    "register_eval_backend", "register_evaluator", "Registry",
]
