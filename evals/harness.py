"""``evaluate(EvalConfig) -> EvalReport``: task accuracy through lm-eval, fidelity, and the quality floor.

Flow: resolve tasks (local YAMLs in ``evals/tasks`` reading the data dir, else lm-eval's upstream tasks) ->
score the configuration and the unquantized reference (native, same model and dtype) through lm-eval with
per-item logging, each (weights hash, scheme, method, KV spec, backend, dtype, task, limit, fewshot) cached on
disk -> paired bootstrap floor and flips per task -> KL / top-1 agreement / perplexity on WikiText-2 windows
-> a report carrying its RunRecord. Importing this module starts no engine.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
from datetime import datetime
from importlib import metadata
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

from evals import cache
from runtime.data import find_data_dir
from evals.fidelity import FidelityStats, wikitext_fidelity
from evals.floor import Floor, FloorResult, check_floor
from evals.vllm_shim import lm_eval_vllm
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.build import Built, build_native, model_weights_hash
from evals.config import DEFAULT_BACKEND, NONE, Config
from runtime.errors import UserError
from runtime.model_store import SMOLLM2, is_default_model, resolve_model
from runtime.registry import Registry
from quant.vllm_support import vllm_kv_cache_dtype

LOCAL_TASKS = Path(__file__).parent / "tasks"
# lm-eval model factories (``factory(EvalConfig) -> lm_eval LM``); serving engines are serving.backends.BACKENDS
LM_FACTORIES: Registry[Callable] = Registry("eval backend")


def register_lm_factory(name: str, scores_native_build: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: ``@register_lm_factory("name")`` makes ``factory(EvalConfig) -> lm_eval LM`` the eval backend
    ``name``. ``scores_native_build``: the factory scores the model ``build_native`` builds for the point (the
    one the WikiText-2 fidelity compares with its reference), so fidelity measures what the tasks scored; other
    engines get no fidelity (it would describe a model they did not run)."""
    def deco(factory: Callable) -> Callable:
        factory.scores_native_build = scores_native_build
        return LM_FACTORIES.add(name, factory)

    return deco


@dataclass(frozen=True)
class EvalConfig:
    """A configuration point (``evals.config.Config``, built by ``Config.parse`` from strings) plus the run-only
    scoring settings: ``EvalConfig(Config.parse(model=.., scheme=.., kv=..), tasks=.., limit=..)``. What is
    scored is read from ``config`` itself (``config.config.scheme_label``, ``.kv``, ``.dtype``, ...)."""

    config: Config
    reference_model: str | None = None  # unquantized model to compare with (default: the point's model itself)
    tasks: tuple[str, ...] = ("arc_easy",)
    limit: int | None = None  # first N docs per task
    fewshot: int = 0
    floor: str | float | None = None  # 0.99 (relative) or abs:0.40
    confidence: float = 0.95
    seed: int = 0
    data_dir: str | None = None
    include_path: tuple[str, ...] = ()
    metric: str = "acc"  # per-item metric the floor and flips use
    reference: bool = True  # score the unquantized reference too (needed for Δ, flips, relative floors)
    fidelity_windows: int = 4  # WikiText-2 windows for KL/agreement/PPL (0 = skip)
    fidelity_ctx: int = 512
    progress: bool = True
    floor_spec: Floor | None = field(init=False, repr=False, compare=False)  # ``floor``, parsed

    def __post_init__(self):
        if not isinstance(self.config, Config):
            raise TypeError(f"EvalConfig takes a Config (Config.parse(model=.., scheme=..)), got {self.config!r}")
        tasks = self.tasks.split(",") if isinstance(self.tasks, str) else self.tasks
        object.__setattr__(self, "tasks", tuple(t.strip() for t in tasks if t.strip()))
        object.__setattr__(self, "include_path", tuple(self.include_path))
        if not self.tasks:
            raise UserError("no tasks given: pass --tasks arc_easy,piqa (see `lm_eval ls tasks` for names)")
        if self.limit is not None and self.limit <= 0:
            raise UserError(f"--limit must be >= 1, got {self.limit}")
        if self.fewshot < 0:
            raise UserError(f"--num-fewshot must be >= 0, got {self.fewshot}")
        LM_FACTORIES.get(self.config.backend)
        if not 0 < self.confidence < 1:
            raise UserError(f"--confidence must be in (0, 1), got {self.confidence}")
        object.__setattr__(self, "floor_spec", Floor.parse(self.floor))

    def reference_config(self) -> "EvalConfig":
        """The unquantized reference scored beside it: the reference model (or the same one), same dtype, on the
        default backend (the reference runtime)."""
        ref = Config(model=self.reference_model or self.config.model, dtype=self.config.dtype, backend=DEFAULT_BACKEND)
        return replace(self, config=ref, reference_model=None, floor=None, reference=False, fidelity_windows=0)

    def run_fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "config"}


def differs_from_reference(config: EvalConfig) -> bool:
    """Whether ``config`` scores something other than its reference (quantized weights or KV, another backend,
    or another reference model): only then is the reference scored separately."""
    point = config.config
    return bool(point.quantized_weights or point.kv_spec is not None or point.backend != DEFAULT_BACKEND
                or config.reference_model)


def report_config(config: EvalConfig) -> dict:
    """The report's flat view (EvalReport.config, the JSON's ``quantspec.config`` and lm-eval ``model_args``):
    the point's fields (JSON null where the point says "none"; ``method`` as Config holds it, None without
    quantized weights), the run settings, and ``Config.to_dict`` under ``config``."""
    point = config.config
    scheme = point.scheme_label if point.quantized_weights else None
    return {"model": point.model, "scheme": scheme, "method": point.method, "rotate": point.rotate,
            "kv": None if point.kv == NONE else point.kv,
            "backend": point.backend, "dtype": point.dtype, "calib": str(point.calib) if point.calib else None,
            **config.run_fields(), "config": point.to_dict()}


@dataclass
class TaskResult:
    task: str
    metrics: dict  # lm-eval's "results" entry, e.g. {"acc,none": .., "acc_stderr,none": ..}
    n: int
    items: dict  # doc_id -> per-item metric value (the floor/flip metric)
    cached: bool = False
    output_type: str | None = None  # lm-eval's: multiple_choice, loglikelihood, generate_until, ...
    answers: dict = field(default_factory=dict)  # doc_id -> what the model answered (``ANSWERS``)
    # lm-eval's per-task entries of its results file (``TASK_INFO``): config (task.dump_config()), version,
    # n_shot, higher_is_better, n_original (docs in the split); {} where lm-eval could not load the task
    task_info: dict = field(default_factory=dict)

    def value(self, metric: str) -> tuple[float | None, float | None]:
        return self.metrics.get(f"{metric},none"), self.metrics.get(f"{metric}_stderr,none")


@dataclass
class EvalReport:
    config: dict
    tasks: dict[str, TaskResult]
    reference: dict[str, TaskResult]
    comparison: dict[str, FloorResult]  # per task: Δ with CI, flips, floor verdict
    fidelity: FidelityStats | None
    verdict: str  # "pass" | "fail" | "undecidable" (no outcome short of beating the reference passes here) | "no floor"
    record: RunRecord
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict:
        """An lm-eval results file, as ``lm_eval --output_path`` writes it for these tasks (``make_table``
        renders it): results, group_subtasks, configs, versions, n-shot, higher_is_better, n-samples, config,
        date and library versions; quantspec's fields (its config, comparison, fidelity, verdict, notes, the
        reference's results, the run record) under the one key ``quantspec``."""
        info = {t: r.task_info for t, r in self.tasks.items()}
        cfg = self.config
        return {
            "results": {t: {"name": t, "alias": info[t].get("config", {}).get("task_alias", t), **r.metrics}
                        for t, r in self.tasks.items()},
            "group_subtasks": {},  # quantspec scores leaf tasks (lm-eval lists groups only)
            "configs": {t: info[t].get("config", {}) for t in sorted(info)},
            "versions": {t: info[t].get("version") for t in sorted(info)},
            "n-shot": {t: info[t].get("n_shot", cfg.get("fewshot", 0)) for t in sorted(info)},
            "higher_is_better": {t: info[t].get("higher_is_better", {}) for t in sorted(info)},
            "n-samples": {t: {"original": info[t].get("n_original"), "effective": r.n} for t, r in self.tasks.items()},
            "config": {"model": f"quantspec-{cfg.get('backend')}", "model_args": {
                           k: cfg.get(k) for k in ("model", "scheme", "method", "rotate", "kv", "dtype", "calib")},
                       "batch_size": None, "batch_sizes": [], "device": None, "use_cache": None,
                       "limit": cfg.get("limit"), "bootstrap_iters": LM_EVAL_BOOTSTRAP_ITERS, "gen_kwargs": None,
                       "random_seed": cfg.get("seed"), "numpy_seed": cfg.get("seed"), "torch_seed": cfg.get("seed"),
                       "fewshot_seed": cfg.get("seed")},
            "date": _timestamp(self.record.created),
            "model_source": f"quantspec-{cfg.get('backend')}",
            "model_name": str(cfg.get("model")),
            "model_name_sanitized": re.sub(r"[\"<>:/|\\?*\[\]]+", "__", str(cfg.get("model"))),
            "lm_eval_version": _version("lm-eval"),
            "transformers_version": _version("transformers"),
            "quantspec": {
                "config": cfg,
                "comparison": {t: c.to_dict() for t, c in self.comparison.items()},
                "fidelity": self.fidelity.to_dict() if self.fidelity else None,
                "verdict": self.verdict,
                "notes": self.notes,
                "reference_results": {t: r.metrics for t, r in self.reference.items()},
                "run_record": self.record.to_dict(),
            },
        }


LM_EVAL_BOOTSTRAP_ITERS = 100_000  # lm-eval's default, which run_lm_eval keeps
# the per-task entries of lm-eval's results file kept in TaskResult.task_info: (our key, lm-eval's key)
TASK_INFO = (("config", "configs"), ("version", "versions"), ("n_shot", "n-shot"),
             ("higher_is_better", "higher_is_better"))


def _timestamp(created: str) -> float | None:
    """lm-eval's ``date`` (UNIX time) from the run record's ``created``."""
    try:
        return datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _jsonable(value):
    """What lm-eval's results file holds for ``value`` (its ``handle_non_serializable``: functions as source,
    numpy numbers as numbers, sets as lists)."""
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(value, default=handle_non_serializable))


# ------------------------------------------------------------------------------------------------ tasks


def task_manager(tasks: tuple[str, ...], data_dir: Path | None, include_path: tuple[str, ...] = ()):
    """lm-eval TaskManager: local task YAMLs (reading ``data_dir``) override upstream names when a data dir
    exists; user folders come last. Upstream tasks are indexed only when a requested name needs them."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # overrides of upstream names are intended
    for p in include_path:
        if not Path(p).is_dir():
            raise UserError(f"--include-path {p} is not a directory of lm-eval task YAMLs")
    paths = ([str(LOCAL_TASKS)] if data_dir else []) + [str(p) for p in include_path]
    metadata = {"data_dir": str(data_dir)} if data_dir else None
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=paths or None, metadata=metadata)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"local tasks in {LOCAL_TASKS}" if data_dir else "no data dir (upstream tasks only)"
        raise UserError(f"unknown task(s) {', '.join(unknown)} ({where}); local tasks: "
                        f"{', '.join(sorted(p.stem for p in LOCAL_TASKS.glob('*.yaml')))}")
    return manager


# --------------------------------------------------------------------------------------------- backends


@functools.lru_cache(maxsize=2)
def _built(point: Config, progress: bool = False) -> Built:
    """One build per configuration point (the test one and its reference) within an ``evaluate`` call: scoring
    and fidelity share it; ``evaluate`` clears this when it returns."""
    return build_native(point, progress=progress)


@register_lm_factory("native", scores_native_build=True)
def native_lm(config: EvalConfig):
    from evals.lm_native import NativeLM  # imports lm-eval

    built = _built(config.config, config.progress)
    return NativeLM(loaded=built.lm, cache_factory=built.cache_factory)


@register_lm_factory("vllm")
def vllm_lm(config: EvalConfig):
    """lm-eval's own ``vllm`` model over the checkpoint dir (schemes must be exported as compressed-tensors)."""
    point = config.config
    if point.quantized_weights:
        raise UserError("the vllm backend evaluates checkpoints: export the scheme as a compressed-tensors dir "
                        "first and pass that dir as MODEL")
    kwargs = {"kv_cache_dtype": vllm_kv_cache_dtype(point.kv_spec)} if point.kv_spec is not None else {}
    return lm_eval_vllm(str(resolve_model(point.model)), dtype={"fp32": "float32", "bf16": "bfloat16"}[point.dtype],
                        seed=config.seed, **kwargs)


# ------------------------------------------------------------------------------------------------ scoring


def _items(samples: list[dict], metric: str) -> dict:
    return {int(s["doc_id"]): s[metric] for s in samples if isinstance(s.get(metric), (int, float))}


# per lm-eval output type, what the model answered on one logged sample: the chosen choice (argmax summed
# loglikelihood), whether the target is the greedy continuation, or the raw generated text (before filters)
ANSWERS: dict[str, Callable[[dict], object]] = {
    "multiple_choice": lambda s: max(range(len(s["filtered_resps"])), key=lambda i: s["filtered_resps"][i][0]),
    "loglikelihood": lambda s: bool(s["filtered_resps"][0][1]),
    "generate_until": lambda s: s["resps"][0][0],
}


def _answers(samples: list[dict], output_type: str | None) -> dict:
    answer = ANSWERS.get(output_type)
    return {int(s["doc_id"]): answer(s) for s in samples} if answer else {}


def run_lm_eval(lm, tasks: list[str], manager, limit: int | None, fewshot: int = 0, seed: int = 0) -> dict:
    """lm-eval's ``simple_evaluate`` with per-item samples, all seeds set to ``seed``."""
    import lm_eval

    verbose = logging.getLogger().isEnabledFor(logging.INFO)  # quantspec -v, or the caller's logging config
    logging.getLogger("lm_eval").setLevel(logging.INFO if verbose else logging.ERROR)
    with contextlib.nullcontext() if verbose else quiet_lm_eval():
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=fewshot or None, limit=limit,
                                       task_manager=manager, log_samples=True, random_seed=seed,
                                       numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                       verbosity="INFO" if verbose else "ERROR")


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval without its tqdm bars (request building, tokenizing: our rich bar shows the scoring) and without
    git's "fatal: not a git repository" on stderr when run outside a clone (its results file keeps the hash)."""
    import subprocess
    from unittest import mock

    from tqdm import tqdm

    def silent_bar(*args, **kwargs):
        return tqdm(*args, **{**kwargs, "disable": True})

    def git_hash() -> str | None:
        proc = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
        return proc.stdout.strip() or None

    with mock.patch("lm_eval.api.model.tqdm", silent_bar), mock.patch("lm_eval.api.task.tqdm", silent_bar), \
            mock.patch("lm_eval.evaluator.get_git_commit_hash", git_hash):
        yield


def _cache_key(config: EvalConfig, task: str, limit: int | None, fewshot: int) -> cache.CacheKey:
    """The point's cache key: weights hash, scheme, method key (all that changes the weights), KV, backend, dtype."""
    point = config.config
    return cache.CacheKey(model_weights_hash(point.model), point.scheme_label, point.method_key, point.kv,
                          point.backend, point.dtype, task, limit, fewshot)


def score_tasks(config: EvalConfig, manager, lm_factory: Callable | None = None) -> dict[str, TaskResult]:
    """Per-task results for ``config``, from the cache where present; the model is built only on a miss."""
    keys = {t: _cache_key(config, t, config.limit, config.fewshot) for t in config.tasks}
    out: dict[str, TaskResult] = {}
    for task, key in keys.items():
        hit = cache.load(key)
        if hit is not None:
            out[task] = TaskResult(**{**hit, "items": {int(k): v for k, v in hit["items"].items()},
                                      "answers": {int(k): v for k, v in hit["answers"].items()}, "cached": True})
    missing = [t for t in config.tasks if t not in out]
    if missing:
        lm = (lm_factory or LM_FACTORIES.get(config.config.backend))(config)
        res = run_lm_eval(lm, missing, manager, config.limit, config.fewshot, config.seed)
        for task in missing:
            metrics = {k: v for k, v in res["results"][task].items() if k != "alias"}
            samples = res["samples"][task]
            output_type = res["configs"][task].get("output_type")
            info = {ours: res[theirs][task] for ours, theirs in TASK_INFO}
            info["n_original"] = res["n-samples"][task]["original"]
            result = TaskResult(task, metrics, len(samples), _items(samples, config.metric),
                                output_type=output_type, answers=_answers(samples, output_type),
                                task_info=_jsonable(info))
            cache.store(keys[task], asdict(result))
            out[task] = result
    older = [t for t in config.tasks if out[t].cached and not out[t].task_info]
    if older:  # cached before task_info was stored: lm-eval's task objects give it, the entry keeps it
        for task, info in task_info(manager, older, config.fewshot, config.seed).items():
            out[task].task_info = info
            if info:
                cache.store(keys[task], {**asdict(out[task]), "cached": False})
    return {t: out[t] for t in config.tasks}


def task_info(manager, tasks: list[str], fewshot: int = 0, seed: int = 0) -> dict[str, dict]:
    """``TaskResult.task_info`` of ``tasks`` from lm-eval's task objects (no model), configured as
    ``simple_evaluate`` configures them (num_fewshot, fewshot seed); a task lm-eval cannot load (e.g. an upstream
    dataset offline) gets {} and a results file with its version and config left empty."""
    out = {}
    for name in tasks:
        try:
            task = manager.load([name])["tasks"][name]
        except Exception:  # noqa: BLE001 - the scores are cached; only the metadata is missing
            out[name] = {}
            continue
        default = task.get_config("num_fewshot")
        if fewshot and default != 0:
            task.set_config(key="num_fewshot", value=fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
        config = dict(task.dump_config())
        out[name] = _jsonable({"config": config, "version": task.VERSION, "n_shot": config.get("num_fewshot", 0),
                               "higher_is_better": task.higher_is_better(), "n_original": len(task.eval_docs)})
    return out


def _paired(test: TaskResult, ref: TaskResult) -> tuple[list[float], list[float]]:
    shared = sorted(set(test.items) & set(ref.items))
    return [test.items[d] for d in shared], [ref.items[d] for d in shared]


def compare(config: EvalConfig, tests: dict[str, TaskResult], refs: dict[str, TaskResult]) -> dict[str, FloorResult]:
    floor = config.floor_spec or Floor(1.0)  # without a floor: Δ/flips are still reported, the verdict is not
    out = {}
    for task, test in tests.items():
        if task in refs:
            t, r = _paired(test, refs[task])
            if t:
                out[task] = check_floor(t, r, floor, config.confidence, seed=config.seed,
                                        identical=not differs_from_reference(config))
    return out


def _verdict(config: EvalConfig, tests: dict[str, TaskResult], comparison: dict[str, FloorResult]) -> str:
    floor = config.floor_spec
    if floor is None:
        return "no floor"
    scored = [t for t, r in tests.items() if r.items]  # tasks with a per-item metric (not e.g. wikitext)
    if not scored:
        raise UserError(f"--floor needs a task with a per-item '{config.metric}' metric (e.g. arc_easy, piqa)")
    if floor.relative:
        if any(t not in comparison for t in scored):
            raise UserError("a relative floor needs the reference: drop --no-reference or use abs:<accuracy>")
        results = [comparison[t] for t in scored]
    else:
        results = [check_floor(list(tests[t].items.values()), [0.0] * len(tests[t].items), floor, config.confidence,
                               seed=config.seed) for t in scored]
    if all(r.passed for r in results):
        return "pass"
    return "fail" if any(r.decidable for r in results if not r.passed) else "undecidable"


def _fidelity(config: EvalConfig, data_dir: Path) -> FidelityStats:
    ref = _built(config.reference_config().config, config.progress).lm
    test = _built(config.config, config.progress)
    ctx = min(config.fidelity_ctx, ref.model.args.max_seq_len)
    return wikitext_fidelity(ref, test.lm, data_dir, ctx, config.fidelity_windows,
                             test_cache_factory=test.cache_factory)


def _cached_fidelity(config: EvalConfig, data_dir: Path | None) -> FidelityStats | None:
    scores_native_build = getattr(LM_FACTORIES.get(config.config.backend), "scores_native_build", False)
    if not (differs_from_reference(config) and scores_native_build and config.fidelity_windows and data_dir):
        return None
    reference = f"_ref{model_weights_hash(config.reference_model)}" if config.reference_model else ""
    key = _cache_key(config, f"_fidelity_wikitext2_ctx{config.fidelity_ctx}{reference}", config.fidelity_windows, 0)
    hit = cache.load(key)
    if hit is not None:
        return FidelityStats(**hit)
    stats = _fidelity(config, data_dir)
    cache.store(key, stats.to_dict())
    return stats


def evaluate(config: EvalConfig, lm_factory: Callable | None = None) -> EvalReport:
    """Score ``config`` (and its unquantized reference) on ``config.tasks``; see the module docstring."""
    try:
        return _evaluate(config, lm_factory)
    finally:
        _built.cache_clear()  # the models are not kept past the call


def _evaluate(config: EvalConfig, lm_factory: Callable | None) -> EvalReport:
    data_dir = find_data_dir(config.data_dir, required=False)
    manager = task_manager(config.tasks, data_dir, config.include_path)
    path = resolve_model(config.config.model)
    model_hash = model_weights_hash(config.config.model)
    tests = score_tasks(config, manager, lm_factory)
    separate = differs_from_reference(config)
    refs = score_tasks(config.reference_config(), manager) if config.reference and separate else {}
    if config.reference and not separate:
        refs = tests  # the configuration is the reference
    comparison = compare(config, tests, refs)
    fidelity = _cached_fidelity(config, data_dir)
    notes = [f"default model: {SMOLLM2.note}"] if is_default_model(path) else []
    if not data_dir:
        notes.append("no data dir: upstream lm-eval tasks from the hub")
    verdict = _verdict(config, tests, comparison)
    record = _record(config, path, model_hash, tests, comparison, fidelity, verdict, notes)
    return EvalReport(report_config(config), tests, refs,
                      comparison, fidelity, verdict, record, notes)


def _record(config, path, model_hash, tests, comparison, fidelity, verdict, notes) -> RunRecord:
    point = config.config
    scheme = point.scheme_label if point.quantized_weights else "dense"
    # the kernels each quantized layer kind ran (``simulated`` ...), when this call built the model to score it
    native = getattr(LM_FACTORIES.get(point.backend), "scores_native_build", False)
    scored = native and point.quantized_weights and any(not r.cached for r in tests.values())
    model = _built(point, config.progress).lm.model if scored else None
    return RunRecord(
        name=f"eval {Path(path).name} {scheme} kv={'dense' if point.kv == NONE else point.kv} {point.backend}",
        model=ModelCondition(str(point.model), model_hash, point.dtype, scheme=point.scheme_label,
                             note="; ".join(notes)),
        hardware=hardware_info(model),
        lengths=LengthDistribution(sum(r.n for r in tests.values()), {"tasks": list(config.tasks)},
                                   {"scored": "loglikelihood of choices (no generation)"},
                                   source=f"lm-eval tasks, limit={config.limit}, fewshot={config.fewshot}",
                                   fixed_output_length=True),
        arrival=ArrivalProcess(kind="offline scoring"),
        engine=EngineCondition(point.backend, {"method": point.method, "rotate": point.rotate, "kv": point.kv,
                                               "dtype": point.dtype},
                               warmup="none (accuracy, not speed)", cache_warmth="n/a"),
        metric=MetricCondition(
            {"acc": "lm-eval acc (argmax of summed loglikelihood over choices)",
             "delta": "acc_test - acc_ref on the same items, paired bootstrap percentile CI (floor: score interval of the margin)",
             "flips": "items whose correctness differs from the unquantized reference (lost/gained)",
             "kl": "mean/p99 over WikiText-2 tokens of KL(p_ref || p_test), nats",
             "floor": "pass iff lower CI bound of acc_test - f*acc_ref (relative) or acc_test - a (absolute) >= 0"},
            correctness=f"floor {config.floor_spec.label if config.floor_spec else 'none'} at confidence "
                        f"{config.confidence}, seed {config.seed}"),
        results={"tasks": {t: r.metrics for t, r in tests.items()},
                 "comparison": {t: c.to_dict() for t, c in comparison.items()},
                 "fidelity": fidelity.to_dict() if fidelity else None, "verdict": verdict},
    )
