"""``quantspec.benchmark``: every serving config at every load, speculative configs paired with the matching
no-speculation run as their speedup baseline; ``repeats`` > 1 repeats each load point and reports every metric's
mean and 95% CI across repeats (runtime.measure.mean_ci).

Engines of an interleavable backend (native) are all started first and alternate run by run within each repeat
(order reversed every other repeat), so a speculative config and its baseline see the same load; other backends
(a vLLM engine per config) run config after config, and the record says so (``repeats.granularity``).
"""
from __future__ import annotations

import functools
from contextlib import ExitStack
from typing import Callable

from serving.backends import backend_class, open_backend
from serving.bench_api import BenchResult, run_benchmark
from serving.serving_metrics import SLO
from runtime.errors import UserError
from runtime.measure import LoadWindow, mean_ci

# progress(label, total) -> advance(): one counter per (config, load), advanced once per finished request
ProgressFactory = Callable[[str, int], Callable[[], None]]
REPEATED = {"effective_tok_s": ("effective_tok_s",), "requests_s": ("requests_s",), "goodput_rps": ("goodput_rps",),
            "ttft_p50_s": ("ttft_s", "p50"), "tpot_p50_s": ("tpot_s", "p50"), "itl_p50_s": ("itl_s", "p50"),
            "e2e_p50_s": ("e2e_s", "p50"), "speedup": ("speedup",)}


def benchmark(configs: list, loads: list, workload: str = "short-short", num_prompts: int = 16,
              output_len: int | None = None, ignore_eos: bool = True, data_dir=None, slo: SLO = SLO(),
              progress: ProgressFactory = lambda _label, _total: (lambda: None), repeats: int = 1) -> list:
    """Runs (serving.bench_api.BenchResult) for ``configs`` x ``loads`` (serving.loadgen.LoadSpec), one per point, in
    order; with ``repeats`` > 1 each is the last repeat, its summary holding ``repeats`` (mean and CI per metric).
    A speculative config gets the matching no-speculation run at the same load as baseline (put it first, e.g.
    ``[config.without_spec(), config]``). Stops at the first failed measurement."""
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    classes = [backend_class(c) for c in configs]  # every refusal before any engine starts
    together = all(cls.interleavable for cls in classes)
    groups = [configs] if together else [[c] for c in configs]  # engines resident at once
    granularity = "interleaved: configs alternate run by run" if together else "config after config"
    measure = functools.partial(run_benchmark, workload=workload, num_prompts=num_prompts, output_len=output_len,
                                ignore_eos=ignore_eos, data_dir=data_dir, slo=slo)
    runs: list[BenchResult] = []
    baselines: dict = {}  # load -> {"base": the latest no-speculation run at it}
    for group in groups:
        with ExitStack() as stack:
            engines = {id(c): stack.enter_context(open_backend(c)) for c in group}
            for load in loads:
                if not _repeat(group, engines, load, repeats, runs, baselines.setdefault(load, {}), measure,
                               num_prompts, progress, granularity):
                    return runs
    return runs


def _repeat(group: list, engines: dict, load, repeats: int, runs: list, baseline: dict, measure, num_prompts: int,
            progress: ProgressFactory, granularity: str) -> bool:
    """Every config of ``group`` at ``load``, ``repeats`` times; appends one BenchResult per config to ``runs``.
    ``baseline["base"]``: the latest no-speculation run at this load (speculative configs' speedup baseline).
    False after a failed run."""
    samples: dict[int, list[BenchResult]] = {id(c): [] for c in group}
    window = LoadWindow.start()
    for r in range(repeats):
        order = group if r % 2 == 0 or len(group) == 1 else _reversed_keeping_baselines(group)
        for config in order:
            advance = progress(f"{config.config.label} {load.label}" + (f" ({r + 1}/{repeats})" if repeats > 1 else ""),
                               num_prompts)
            run = measure(config, load=load, backend=engines[id(config)], progress=lambda _r, a=advance: a(),
                          baseline=baseline.get("base") if config.config.speculative else None)
            if run.failed:
                runs.append(run)
                return False
            if not config.config.speculative:
                baseline["base"] = run
            samples[id(config)].append(run)
    window.stop()
    for config in group:
        last = samples[id(config)][-1]
        last.summary["load"] = window.to_dict()  # the machine's load and steal around this load point's runs
        if repeats > 1:
            last.summary["repeats"] = _stats(samples[id(config)]) | {"n": repeats, "granularity": granularity}
        runs.append(last)
    return True


def _reversed_keeping_baselines(group: list) -> list:
    """Reverse the run order, but keep each speculative config after its baseline (it needs one to compare)."""
    plain = [c for c in group if not c.config.speculative]
    spec = [c for c in group if c.config.speculative]
    return plain[::-1] + spec[::-1] if plain and spec else group[::-1]


def _stats(results: list[BenchResult]) -> dict:
    out = {}
    for name, path in REPEATED.items():
        values = []
        for res in results:
            value = res.summary
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                values.append(float(value))
        if len(values) == len(results):
            out[name] = mean_ci(values).to_dict()
    return out
