"""What a search trial measures, behind a small interface: ``TrialEvaluator.quality/speed/greedy_tokens``.

Evaluators register by name (``real`` is the default and the only one shipped); tests register cheap ones.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Protocol

from runtime.errors import UserError
from runtime.registry import Registry
from studies.space import SearchSpace, serving_config
from evals.config import Config
from evals.floor import Floor
from runtime.data import find_data_dir
from runtime.loading import set_threads
from runtime.measure import PairedRatio, PairedRounds, SpeedProtocol
from runtime.model_store import resolve_model
from evals.harness import EvalConfig, evaluate
from serving.backends import BACKENDS, open_backend
from serving.bench_api import run_benchmark, warm_up
from serving.loadgen import LoadSpec
from serving.workloads import build_requests


@dataclass
class QualityResult:
    """Quality of one model transformation against the reference model, with the floor verdict."""

    value: float  # the statistic the floor is compared with (constraint: floor - value <= 0)
    passes: bool  # the statistical verdict of the quality API
    accuracy: float | None = None
    reference_accuracy: float | None = None
    delta: float | None = None  # accuracy - reference accuracy
    ci: tuple[float, float] | None = None  # CI of delta
    flips: int | None = None  # items whose correctness changed vs the reference
    kl: float | None = None  # mean token KL vs the reference
    perplexity: float | None = None
    task: str | None = None  # the task that decided the verdict (the worst one when several)
    record: dict | None = None  # the RunRecord that produced the numbers
    decidable: bool = True  # False: even the reference's own answers on these items could not pass the floor
    items_to_decide: int | None = None  # when not decidable: about how many items would decide it (None: no number)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci"] = list(self.ci) if self.ci else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QualityResult":
        d = dict(d)
        d["ci"] = tuple(d["ci"]) if d.get("ci") else None
        return cls(**d)


@dataclass
class SpeedResult:
    tok_s: float  # effective output tokens per second (median over rounds when paired)
    alpha: float | None = None  # proposer acceptance rate (speculative configs)
    tau: float | None = None  # mean tokens emitted per target forward
    record: dict | None = None
    extra: dict = field(default_factory=dict)
    tok_s_ci: tuple[float, float] | None = None
    speedup: float | None = None  # paired over the study's reference (runtime.measure.paired_ratio); None: unpaired
    speedup_ci: tuple[float, float] | None = None
    noisy: bool | None = None  # the speedup's CI stayed wider than the protocol's threshold
    measurement: dict | None = None  # how: rounds, blocks, load, steal, threads, granularity

    def to_dict(self) -> dict:
        return asdict(self)


class TrialEvaluator(Protocol):
    """Measures a ``Config``; the search caches ``quality`` per ``config.quality_key``."""

    default_floor: str  # the floor of a new study when --floor is not given

    def floor_value(self, floor: str) -> float:
        """The number ``QualityResult.value`` is compared with; a floor out of range is a UserError."""

    def describe(self) -> dict:
        """The settings that decide what a measurement means (stored in the study; joining workers must match)."""

    def prepare(self, space: SearchSpace, floor: str) -> None:
        """Check the environment (data, model, floor) once before the first trial; raise UserError."""

    def quality(self, config: Config) -> QualityResult: ...

    def speed(self, config: Config) -> SpeedResult: ...

    def greedy_tokens(self, config: Config) -> list[list[int]]:
        """Greedy output tokens on the evaluator's fixed prompts (checks that speculation leaves outputs unchanged)."""

    # optional (the search records "not measured"/"not by construction" without them):
    # exactness(config) -> {"by_construction": bool, "why": str}: does speculation on the kernels this point runs
    #     leave greedy outputs unchanged by construction?
    # output_length(config) -> {"counts": [int], "eot_rate": float}: output tokens per prompt with natural
    #     end-of-turn, the same prompts for every config (the length gate, ``studies.length_gate``)
    # plain_tokens(config) -> (tokens, step) | None: greedy outputs of ``config`` without speculation on the
    #     decoding step its speculation ran on, where that is not the plain point's own (the exactness reference)
    # settle(config, speed, hold=None) -> SpeedResult: with ``speed(config, settle=False)`` (paired rounds held at
    #     the protocol's minimum), the rest of the noise guard's rounds; ``hold`` (why not) keeps the minimum


EVALUATORS: Registry[Callable[..., TrialEvaluator]] = Registry("evaluator")
# candidate engines a search keeps between trials beside the reference (``Backend.reusable``, least recently used
# closed first): a point of a transformation already built runs on its build and compiled steps. Each holds its
# model's weights and compiled steps (the default model: 0.1-0.6 GB)
RESIDENT_ENGINES = 3
register_evaluator = EVALUATORS.register


def _compile_s(backend) -> float:
    """Seconds the engine spent building compiled steps (one-time; 0 for an eager or non-native engine)."""
    return backend.engine_config().get("compile_s") or 0.0


def _keep_recent(recent: dict, config: Config, value) -> None:
    """``recent[config] = value`` as the most recent entry, keeping the last ``RESIDENT_ENGINES`` points'."""
    recent.pop(config, None)
    recent[config] = value
    while len(recent) > RESIDENT_ENGINES:
        recent.pop(next(iter(recent)))


def _paired_speed(speed: SpeedResult, paired: PairedRatio, backend) -> SpeedResult:
    """``speed`` with the paired rounds' figures (tok/s, speedup, their CIs, the noise flag), the threads the
    candidate ran on (after any re-choice by the noise guard) and its record."""
    threads = backend.engine_config().get("thread_choice")
    speed.record["results"]["paired"] = paired.to_dict()
    return replace(speed, tok_s=paired.candidate.value, tok_s_ci=paired.candidate.ci, speedup=paired.ratio.value,
                   speedup_ci=paired.ratio.ci, noisy=paired.noisy, measurement=paired.to_dict() | {"threads": threads})


def get_evaluator(name: str, **settings) -> TrialEvaluator:
    return EVALUATORS.get(name)(**settings)


@register_evaluator("real")
class RealEvaluator:
    """The shipped evaluator. Speed: ``serving.bench_api.run_benchmark`` at batch 1 (closed loop, concurrency 1),
    greedy, fixed output length on the first ``num_prompts`` Spec-Bench prompts, one engine per trial (its start
    is timed separately and excluded from tok/s). Quality: ``evals.harness.evaluate`` (lm-eval tasks scored on
    the native runtime in bf16, as served, against the unquantized bf16 reference on the same items; paired
    floor test; WikiText-2 KL). A vLLM point's quality is measured through vLLM in its serving dtype on its
    compressed-tensors export (lm-eval's ``vllm`` model), against the same native bf16 reference as every other
    point of the table (so a backend's own drift counts against it; ``quantspec eval --compare-backends`` shows it);
    where that cannot run here the point is skipped with the reason. Output length: ``length_prompts`` prompts of
    the workload generated with natural end-of-turn up to ``length_tokens`` (only prompts that fit
    ``length_positions`` with them, where set), on the point's engine while it is open (right after the speed runs
    for an engine closed after its trial, on demand for a resident one).

    Floors are ``evals.floor.Floor`` texts: ``0.99`` (relative to the reference) or ``abs:0.40``. evals passes a
    configuration iff the lower CI bound of the margin m (acc - f * acc_ref, or acc - a) is >= 0. The quality
    value is ``f + lower bound of m / acc_ref`` (``a + lower bound of m`` for absolute floors; the worst task
    when several), so ``floor - value <= 0`` exactly when the verdict is pass. For a relative floor it reads as
    the share of reference accuracy kept at the CI's lower end (the reference itself scores a little below 1,
    because the bootstrap of m = (1 - f) * acc has width)."""

    default_floor = "0.98"

    def __init__(self, data_dir: str | None = None, limit: int | None = None, tasks: str = "arc_easy",
                 workload: str = "spec_bench", num_prompts: int = 4, output_len: int = 64,
                 fidelity_windows: int = 2, floor: str | None = None, threads: int | None = None,
                 length_tokens: int = 256, length_prompts: int = 8, length_positions: int | None = None,
                 protocol: SpeedProtocol | None = None, compile: str = "auto", **_):
        self.data_dir, self.limit, self.tasks, self.fidelity_windows = data_dir, limit or 200, tasks, fidelity_windows
        self.workload, self.num_prompts, self.output_len = workload, num_prompts, output_len
        self.floor, self.threads, self.compile = floor, threads, compile
        if length_tokens < 1:
            raise UserError(f"--length-tokens must be >= 1, got {length_tokens}")
        if length_prompts < 1:
            raise UserError(f"--length-prompts must be >= 1, got {length_prompts}")
        self.length_tokens, self.length_prompts, self.length_positions = length_tokens, length_prompts, length_positions
        self.protocol = protocol or SpeedProtocol()
        self.reference: Config | None = None
        self._reference = None  # the resident reference engine
        self._engines: list = []  # resident candidate engines, least recently used first
        self._tokens: dict[Config, list[list[int]]] = {}
        self._plain_tokens: dict[tuple[Config, str], list[list[int]]] = {}  # (transformation, step): plain_tokens
        self._lengths: dict[Config, dict] = {}
        self._served: dict[Config, object] = {}  # the last points' open engines, most recent last
        self._unsettled: dict[Config, tuple[PairedRounds, object]] = {}  # rounds held at the minimum, engine (settle)

    def floor_value(self, floor: str) -> float:
        return Floor.parse(floor).value

    def describe(self) -> dict:
        return {"evaluator": "real", "tasks": self.tasks, "limit": self.limit, "fidelity_windows": self.fidelity_windows,
                "workload": self.workload, "num_prompts": self.num_prompts, "output_len": self.output_len,
                "quality_dtype": "bf16 (native), serving dtype (vllm)",
                "length_tokens": self.length_tokens, "length_prompts": self.length_prompts,
                "length_positions": self.length_positions, "load": "closed loop, concurrency 1", "threads": self.threads,
                "compile": self.compile,
                "speed_protocol": asdict(self.protocol)}

    def prepare(self, space: SearchSpace, floor: str) -> None:
        self.floor_value(floor)
        self.floor = floor
        self.data_dir = str(find_data_dir(self.data_dir))
        set_threads(self.threads)  # quality runs in this process too
        resolve_model(space.model)
        self.reference = space.reference()

    def quality(self, config: Config) -> QualityResult:
        report = self._report(config)
        floor = Floor.parse(self.floor)

        def value(c) -> float:
            return floor.value + c.margin_ci[0] / (c.acc_ref if floor.relative and c.acc_ref else 1.0)

        task, worst = min(report.comparison.items(), key=lambda kv: value(kv[1]))
        fid = report.fidelity
        return QualityResult(
            value=value(worst), passes=report.passed, accuracy=worst.acc_test, reference_accuracy=worst.acc_ref,
            delta=worst.delta, ci=tuple(worst.delta_ci), flips=worst.flips.total,
            kl=fid.mean_kl if fid else (0.0 if not config.quantized_weights and config.kv == "none" else None),
            perplexity=fid.ppl_test if fid else None, task=task, record=report.record.to_dict(),
            decidable=worst.decidable, items_to_decide=worst.items_to_decide)

    def _report(self, config: Config):
        """lm-eval on what the point's backend says its quality is (``Backend.quality_plan``: the transformation
        on the reference runtime, or the engine itself on its export; the harness caches per scored point)."""
        backend = BACKENDS.get(config.backend)
        try:
            plan = backend.quality_plan(config)
            return evaluate(EvalConfig(plan.point, tasks=self.tasks, limit=self.limit, floor=self.floor,
                                       data_dir=self.data_dir, reference_model=plan.reference_model,
                                       fidelity_windows=self.fidelity_windows if plan.fidelity else 0, progress=False))
        except UserError:
            raise
        except Exception as exc:  # e.g. no vLLM here, or it cannot load the export: the point cannot be scored
            if not backend.scores_own_quality:
                raise
            raise UserError(f"{backend.name} quality could not be measured here ({type(exc).__name__}: {exc}); a "
                            f"{backend.name} point never borrows the reference runtime's quality, so it is skipped"
                            ) from exc

    def exactness(self, config: Config) -> dict:
        return BACKENDS.get(config.backend).exactness(config)

    def output_length(self, config: Config) -> dict:
        if config not in self._tokens:
            self.speed(config, settle=False)
        if config not in self._lengths:  # its engine stayed open (the reference, or a reusable candidate)
            backend = self._served[config] if config in self._served else self._backend_for(config)
            self._remember(config, backend)
            self._lengths[config] = self._natural(backend.config, backend)
        if "error" in self._lengths[config]:
            raise UserError(f"the natural end-of-turn run (length gate) failed: {self._lengths[config]['error']}")
        return self._lengths[config]

    def _natural(self, serving, backend) -> dict:
        """Output tokens per prompt with natural end-of-turn (the length gate's run, untimed)."""
        t0 = time.perf_counter()
        natural = run_benchmark(serving, self.workload, LoadSpec.closed(1), backend=backend,
                                num_prompts=self.length_prompts, output_len=self.length_tokens, ignore_eos=False,
                                data_dir=self.data_dir, max_total_tokens=self.length_positions)
        if natural.failed:
            return {"error": str(natural.summary.get("error"))}
        counts = [len(r.token_ids) for r in natural.results]
        return {"counts": counts, "max_tokens": self.length_tokens, "prompts": natural.record.lengths.source,
                "eot_rate": sum(c < self.length_tokens for c in counts) / len(counts),
                "run_s": time.perf_counter() - t0}

    def _fixed_length(self, serving, backend):
        """The speed workload's fixed-length greedy run (ignore_eos) on ``backend``; raises where it failed."""
        result = run_benchmark(serving, self.workload, LoadSpec.closed(1), backend=backend,
                               num_prompts=self.num_prompts, output_len=self.output_len, data_dir=self.data_dir)
        if result.failed:
            raise RuntimeError(f"benchmark failed: {result.summary.get('error')}")
        return result

    def _remember(self, config: Config, backend) -> None:
        """Keep the engine a point ran on for its later runs (the length gate's comes after its twin's, when the
        search checks exactness), the last ``RESIDENT_ENGINES`` points'."""
        _keep_recent(self._served, config, backend)

    def _backend_for(self, config: Config):
        """The engine a point runs on: the resident reference for the reference point where points are paired with
        it, else its own (``_engine``)."""
        if config == self.reference and not self._unpaired_reason(config):
            return self._reference_backend()
        return self._engine(serving_config(config, threads=self.threads, compile=self.compile))

    def speed(self, config: Config, settle: bool = True) -> SpeedResult:
        """Tokens/s of the fixed-length runs, paired with the resident reference; ``settle=False`` holds the paired
        rounds at the protocol's minimum until ``settle`` (the search: the noise guard only where it can matter)."""
        serving = serving_config(config, threads=self.threads, compile=self.compile)
        t0 = time.perf_counter()
        # the resident reference engine, opened (and built, when compiled) once, before this point's own engine; its
        # steps of spans this point's requests reach first are built in this point's runs: all are compile_s
        built_before = _compile_s(self._reference) if self._reference is not None else 0.0
        reference = None if self._unpaired_reason(config) else self._reference_backend()
        opening_build_s = _compile_s(reference) - built_before if reference is not None else 0.0
        t_reference = time.perf_counter()
        backend = self._backend_for(config)
        own = backend is not reference
        t1 = time.perf_counter()
        try:
            result = self._fixed_length(serving, backend)
            t_paired = time.perf_counter()
            rounds = self._paired(backend, config, [r.index for r in result.results])
            hold = not settle and (not own or backend.reusable)  # only an engine that stays open can go on
            paired = rounds.measure(self.protocol.min_rounds if hold else None) if rounds else None
            t_natural = time.perf_counter()
            if own and not backend.reusable:  # closed below: its length run now (else on demand, ``output_length``)
                self._lengths[config] = self._natural(serving, backend)
        finally:
            if own and not backend.reusable:
                backend.close()
        if not own or backend.reusable:
            self._remember(config, backend)
        self._tokens[config] = [r.token_ids for r in result.results]
        record = result.record.to_dict()
        own_build_s = _compile_s(backend) if own else 0.0  # built in its warm-up, inside bench_s
        reference_build_s = _compile_s(reference) - built_before if reference is not None else 0.0
        extra = {"reference_start_s": t_reference - t0 - opening_build_s, "engine_start_s": t1 - t_reference,
                 "bench_s": t_paired - t1 - own_build_s - (reference_build_s - opening_build_s),
                 "compile_s": own_build_s + reference_build_s, "paired_s": t_natural - t_paired}
        if paired is None:
            record["results"]["paired"] = {"granularity": self._unpaired_reason(config)}
            return SpeedResult(result.effective_tok_s, result.alpha, result.tau, record=record, extra=extra,
                               measurement={"granularity": self._unpaired_reason(config)})
        if hold:
            _keep_recent(self._unsettled, config, (rounds, backend))  # a twin measured for its tokens is never settled
        return _paired_speed(SpeedResult(0.0, result.alpha, result.tau, record=record, extra=extra), paired, backend)

    def settle(self, config: Config, speed: SpeedResult, hold: str | None = None) -> SpeedResult:
        """``speed`` (from ``speed(config, settle=False)``) with the rest of its paired rounds, or, given ``hold``
        (why they cannot matter), as it is with the reason recorded."""
        held = self._unsettled.pop(config, None)
        if held is None:  # settled already, or unpaired
            return speed
        if hold is not None:
            speed.measurement["held"] = speed.record["results"]["paired"]["held"] = hold
            return speed
        rounds, backend = held
        before = rounds.elapsed_s
        paired = rounds.measure()
        speed.extra["paired_s"] += paired.elapsed_s - before
        return _paired_speed(speed, paired, backend)

    def _engine(self, serving):
        """The point's engine: a resident engine's build where it serves the point (``Backend.serve_also``: another
        proposer or K of a transformation measured before), else a new engine, kept resident when reusable."""
        for engine in self._engines:
            shared = engine.serve_also(serving)
            if shared is not None:
                self._engines.remove(engine)
                self._engines.append(engine)
                return shared
        backend = open_backend(serving)
        if backend.reusable:
            self._engines.append(backend)
            while len(self._engines) > RESIDENT_ENGINES:
                self._engines.pop(0).close()
        return backend

    def _reference_backend(self):
        """The reference engine, opened once and kept resident beside every candidate (interleavable backends)."""
        if self._reference is None:
            self._reference = open_backend(serving_config(self.reference, threads=self.threads, compile=self.compile))
            warm_up(self._reference, LoadSpec.closed(1).kind)  # a compiled step builds here, in no timed sample
        return self._reference

    def _unpaired_reason(self, config: Config) -> str | None:
        if self.reference is None:
            return "unpaired: no reference point (prepare() was not called)"
        backends = {BACKENDS.get(c.backend) for c in (config, self.reference)}
        if all(b.interleavable for b in backends):
            return None
        return (f"unpaired: {' and '.join(sorted(b.name for b in backends if not b.interleavable))} engines cannot "
                "stay resident beside the reference, so the speedup divides two separate runs (no CI)")

    def _paired(self, backend, config: Config, indices: list[int]) -> PairedRounds | None:
        """Candidate vs the resident reference, request by request in interleaved blocks (the reference against
        itself for the reference point: its CI is the noise floor); no round run yet."""
        if self._unpaired_reason(config):
            return None
        reference = self._reference_backend()
        requests, _ = build_requests(self.workload, backend.tokenizer(), self.num_prompts, self.output_len, True,
                                     self.data_dir)
        requests = [r for r in requests if r.index in indices]
        for engine in (reference, backend):
            engine.prepare(requests)  # built where the runs before did not reach these requests' shapes
        # torch threads are per process: the reference's re-choice (noise guard) serves both engines
        return PairedRounds(lambda u: reference.sample(requests[u]), lambda u: backend.sample(requests[u]),
                            len(requests), self.protocol, "one request (batch 1, greedy, fixed length)",
                            reference.retune)

    def close(self) -> None:
        for engine in self._engines:
            engine.close()
        self._engines = []
        if self._reference is not None:
            self._reference.close()
            self._reference = None
        self._served = {}
        self._unsettled = {}
        self._plain_tokens = {}

    def greedy_tokens(self, config: Config) -> list[list[int]]:
        """Greedy outputs of the speed workload (ignore_eos, fixed length); measured here when not yet seen."""
        if config not in self._tokens:
            self.speed(config, settle=False)  # its tokens are what is wanted here, not a tight speed
        return self._tokens[config]

    def plain_tokens(self, config: Config) -> tuple[list[list[int]], str] | None:
        """Greedy outputs of the speed workload without speculation, decoded on the engine and step ``config``'s
        speculation ran on, and that step, where it is not the plain point's own (``Backend.plain_twin``: e.g. a
        compiled verification probed inexact sent it eager); None where the plain point's run is the reference."""
        self.greedy_tokens(config)
        backend = self._served.get(config)
        twin = backend.plain_twin() if backend is not None else None
        if twin is None:
            return None
        step = twin.engine_config().get("step") or "?"
        key = (config.transformation, step)
        if key not in self._plain_tokens:
            self._plain_tokens[key] = [r.token_ids for r in self._fixed_length(twin.config, twin).results]
        return self._plain_tokens[key], step
