"""``quantspec.benchmark``: every serving config at every load, one engine per config reused across loads,
speculative configs paired with the matching no-speculation run as their speedup baseline."""
from __future__ import annotations

from typing import Callable

from evals.backends import open_backend
from evals.bench_api import run_benchmark
from evals.serving_metrics import SLO

# progress(label, total) -> advance(): one counter per (config, load), advanced once per finished request
ProgressFactory = Callable[[str, int], Callable[[], None]]


def benchmark(configs: list, loads: list, workload: str = "short-short", num_prompts: int = 16,
              output_len: int | None = None, ignore_eos: bool = True, data_dir=None, slo: SLO = SLO(),
              progress: ProgressFactory = lambda _label, _total: (lambda: None)) -> list:
    """Runs (evals.bench_api.BenchmarkRun) for ``configs`` x ``loads`` (evals.loadgen.LoadSpec), in order.
    A speculative config gets the matching no-speculation run at the same load as baseline (put it first, e.g.
    ``[config.without_spec(), config]``). Stops at the first failed measurement."""
    runs, baselines = [], {}
    for config in configs:
        with open_backend(config) as engine:
            for load in loads:
                advance = progress(f"{config.label} {load.label}", num_prompts)
                run = run_benchmark(config, workload, load, backend=engine, num_prompts=num_prompts,
                                    output_len=output_len, ignore_eos=ignore_eos, data_dir=data_dir, slo=slo,
                                    baseline=baselines.get(load) if config.speculative else None,
                                    progress=lambda _r, a=advance: a())
                runs.append(run)
                baselines[load] = run
                if run.failed:
                    return runs
    return runs
