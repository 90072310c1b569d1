"""Wall time of an N-trial search on the default model, and where it goes: quality evals, engine starts,
speed runs, greedy-equality checks, and the rest (Optuna, storage, pruned points).

Usage: flock /tmp/qs-bench.lock python bench/study_cost.py [--n-trials 30] [--space default] [--limit 200]
                                                             [--compile auto] [--cold] [--out FILE]
Quality is cached per model transformation inside the study and on disk by evals (a second run of this script
finds every eval and calibrated quantization cached; ``--cold`` gives the run empty eval, inductor and quantization
caches, what a first search pays); the record states how many quality evals were computed vs served from the cache.
Writes bench/results/study_cost.json (a full run record), keeps the study (SQLite, bench/results/study_cost/
study.db, a fresh study each run) and its table (bench/results/study_cost-pareto.json), so the search result
can be re-rendered: ``quantspec pareto --study-dir bench/results/study_cost --study-name study-cost``.
Prints the breakdown.
"""
import argparse
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime.model_store import SMOLLM2, resolve_model, weights_hash
from studies.objective import get_evaluator
from quantspec.report import footer_lines, rich_table
from studies.pareto import summarize, write_json
from studies.search import SearchSettings, finished_trials, run_search
from studies.space import load_space
from runtime.argtypes import positive_int
from runtime.compiled import SETTINGS
from quant.store import STORE_ENV


class TimedEvaluator:
    """Delegates to the real evaluator and accumulates seconds per kind of work."""

    def __init__(self, inner):
        self.inner = inner
        self.default_floor = inner.default_floor
        self.seconds = {"quality": 0.0, "engine_start": 0.0, "compile": 0.0, "speed_run": 0.0, "paired_rounds": 0.0,
                        "length_run": 0.0, "greedy_check": 0.0}
        self.counts = Counter()  # calls per kind of work (speed: engine start + run)

    def floor_value(self, floor):
        return self.inner.floor_value(floor)

    def describe(self):
        return self.inner.describe()

    def prepare(self, space, floor):
        self.inner.prepare(space, floor)

    def _timed(self, kind: str, fn, config):
        t = time.perf_counter()
        try:
            return fn(config)
        finally:
            self.seconds[kind] += time.perf_counter() - t
            self.counts[kind] += 1

    def quality(self, config):
        return self._timed("quality", self.inner.quality, config)

    def speed(self, config, settle: bool = True):
        t = time.perf_counter()
        try:
            result = self.inner.speed(config, settle) if hasattr(self.inner, "settle") else self.inner.speed(config)
        except Exception:
            self.seconds["engine_start"] += time.perf_counter() - t  # refused at engine start (pruned/failed)
            raise
        self.seconds["engine_start"] += result.extra["reference_start_s"] + result.extra["engine_start_s"]
        self.seconds["compile"] += result.extra["compile_s"]  # one-time builds of compiled steps (--compile)
        self.seconds["speed_run"] += result.extra["bench_s"]
        self.seconds["paired_rounds"] += result.extra.get("paired_s", 0.0)  # interleaved rounds with the reference
        self.counts["speed"] += 1
        return result

    def settle(self, config, speed, hold=None):
        """The noise guard's rounds after the minimum (feasible points only) count as paired rounds too."""
        if not hasattr(self.inner, "settle"):
            return speed
        before = speed.extra.get("paired_s", 0.0)
        result = self.inner.settle(config, speed, hold)
        self.seconds["paired_rounds"] += result.extra.get("paired_s", 0.0) - before
        return result

    def exactness(self, config):
        return self.inner.exactness(config)

    def output_length(self, config):
        """The natural end-of-turn runs of the length gate (once per serving transformation)."""
        return self._timed("length_run", self.inner.output_length, config)

    def greedy_tokens(self, config):
        """Inner calls (the non-speculative twin's run when not yet measured) count here, not under speed."""
        return self._timed("greedy_check", self.inner.greedy_tokens, config)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-trials", type=positive_int, default=30)
    parser.add_argument("--space", default="default")
    parser.add_argument("--limit", type=positive_int, default=200)
    parser.add_argument("--prompts", type=positive_int, default=4)
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--compile", default="auto", choices=SETTINGS,
                        help="decode step of every speed run (runtime/compiled.py); builds counted apart")
    parser.add_argument("--cold", action="store_true",
                        help="empty eval, inductor and calibrated-quantization caches (temporary directories)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "study_cost.json"))
    parser.add_argument("--study-dir", default=str(Path(__file__).parent / "results" / "study_cost"),
                        help="where the study's SQLite file is kept (replaced by each run)")
    args = parser.parse_args()
    if args.cold:
        os.environ["QUANTSPEC_EVAL_CACHE"] = tempfile.mkdtemp(prefix="qs-eval-cache-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="qs-inductor-")
        os.environ[STORE_ENV] = tempfile.mkdtemp(prefix="qs-quant-store-")

    evaluator = TimedEvaluator(get_evaluator("real", limit=args.limit, num_prompts=args.prompts,
                                             output_len=args.new_tokens, threads=args.threads,
                                             compile=args.compile))
    space = load_space(args.space)
    study_dir = Path(args.study_dir)
    (study_dir / "study.db").unlink(missing_ok=True)  # this run's study only
    settings = SearchSettings(space=space, n_trials=args.n_trials, study_dir=study_dir, seed=args.seed,
                              study_name="study-cost", create=True)
    t0 = time.perf_counter()
    outcome = run_search(settings, evaluator, on_trial=lambda study, trial: print(
        f"[{time.perf_counter() - t0:7.0f} s] #{trial.number} {trial.state.name:8s} "
        f"{trial.user_attrs.get('label', '')}: {({k: round(v) for k, v in evaluator.seconds.items()})}",
        flush=True))
    wall = time.perf_counter() - t0
    summary = summarize(outcome.study)
    states = [t.state.name for t in outcome.study.get_trials(deepcopy=False)]
    n_finished = len(finished_trials(outcome.study))
    table_path = write_json(summary, Path(args.out).with_name(Path(args.out).stem + "-pareto.json"))
    seconds = dict(evaluator.seconds)
    seconds["other"] = wall - sum(seconds.values())
    console = Console(width=200)
    console.print(rich_table(summary))
    for line in footer_lines(summary):
        console.print(line)
    table = Table(title=f"{args.n_trials}-trial search on the default model: {wall / 60:.1f} min wall (target <= 20)")
    for col in ("where", "seconds", "share", "calls"):
        table.add_column(col, justify="right")
    calls = {"quality": evaluator.counts["quality"], "engine_start": evaluator.counts["speed"],
             "compile": evaluator.counts["speed"],
             "speed_run": evaluator.counts["speed"], "paired_rounds": evaluator.counts["speed"],
             "length_run": evaluator.counts["length_run"],
             "greedy_check": evaluator.counts["greedy_check"]}
    for name, sec in seconds.items():
        table.add_row(name, f"{sec:.0f}", f"{100 * sec / wall:.0f}%", str(calls.get(name, "")))
    console.print(table)
    cache_hits = sum(1 for r in summary.rows if r.duplicate_of is not None)
    measured = [t.user_attrs["speed"].get("measurement") or {} for t in outcome.study.get_trials(deepcopy=False)
                if "speed" in t.user_attrs and "duplicate_of" not in t.user_attrs]
    rounds = {kind: [m["rounds"] for m in measured if "rounds" in m and ("held" in m) == (kind == "held")]
              for kind in ("held", "settled")}  # infeasible points keep the minimum rounds (studies.search._settle)
    record = RunRecord(
        name="study-cost",
        model=ModelCondition("default", weights_hash(resolve_model("default")), "bf16 runtime (native backend)",
                             note=SMOLLM2.note),
        hardware=hardware_info(),
        lengths=LengthDistribution(args.prompts, {"source": "first Spec-Bench prompts, chat template"},
                                   {"fixed": args.new_tokens}, "spec_bench (speed) + arc_easy "
                                   f"limit {args.limit} (quality)", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native (per trial: load + quantize + bench)", {
            "space": space.to_dict(), "sampler": settings.sampler, "seed": args.seed,
            "storage": f"sqlite ({study_dir / 'study.db'}, study 'study-cost')", "table": str(table_path),
            "length_band": settings.length_band, "compile": args.compile},
            warmup="run_benchmark warms each engine on a non-workload prompt",
            cache_warmth="empty eval, inductor and calibrated-quantization caches (--cold)" if args.cold else
            "eval results and calibrated quantizations cached on disk (warm: quality and GPTQ nearly free), "
            "inductor's cache as found"),
        metric=MetricCondition(
            {"wall_s": "time.perf_counter around run_search (study open to last trial)",
             "quality": "seconds inside evaluator.quality (lm-eval + fidelity), distinct transformations only",
             "engine_start": "open_backend: model load + quantization (+ pruned points refused at start)",
             "compile": "one-time builds of compiled decode steps (the records' compile_s; none with --compile eager)",
             "speed_run": "run_benchmark on an open engine (warm-up + measured requests, builds excluded)",
             "paired_rounds": "the speed runs' interleaved rounds with the resident reference (the paired ratio)",
             "length_run": "the length gate's natural end-of-turn runs (one per serving transformation)",
             "greedy_check": "greedy-equality checks of sampled speculative trials (their non-spec twin runs)",
             "other": "wall minus the above: Optuna sampling, storage, invalid-point checks"},
            "trials counted when complete, pruned or failed by their own error"),
        results={"wall_s": wall, "seconds": seconds, "calls": calls, "n_finished": n_finished,
                 "states": {s: states.count(s) for s in set(states)}, "duplicates_reused": cache_hits,
                 "paired_rounds_per_point": rounds,
                 "target_wall_s": 1200, "within_target": wall <= 1200},
    )
    print(f"wrote {record.write(args.out)}")
