"""``compare_backends(EvalConfig) -> BackendComparison``: one configuration scored by two backends on the same
items, and where their answers differ.

Both backends load the same weights: a quantized scheme is exported once as a compressed-tensors checkpoint
(``evals.build.as_checkpoint``) and that export is what each backend scores, in the same dtype, through lm-eval
with per-item logging (cached like every eval). Per task: accuracy on each backend, the items whose answers
differ (the chosen choice, the greedy flag, or the generated text), the discordant pairs with McNemar's exact
test of "same accuracy", and for generation tasks the first token where the two outputs diverge.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from evals.build import as_checkpoint, model_weights_hash
from evals.harness import EvalConfig, TaskResult, score_tasks, task_manager
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime.data import find_data_dir
from runtime.errors import UserError
from runtime.loading import load_tokenizer
from runtime.model_store import resolve_model
from serving.backends import BACKENDS


@dataclass
class ItemDiff:
    """One item the two backends answered differently."""

    doc_id: int
    answers: tuple  # (first backend's, second backend's)
    correct: tuple  # per-item metric on each
    diverge_at: int | None = None  # generation: index of the first differing token
    diverging_tokens: tuple | None = None  # generation: the two tokens at that index ("" = output ended)


@dataclass
class TaskDiff:
    task: str
    output_type: str | None
    n: int  # items scored by both
    accuracy: tuple  # (first, second)
    only_first: int  # items only the first backend got right
    only_second: int
    mcnemar_p: float  # exact two-sided test that both have the same accuracy (discordant pairs)
    diffs: list[ItemDiff] = field(default_factory=list)

    @property
    def disagree(self) -> int:
        return len(self.diffs)


@dataclass
class BackendComparison:
    backends: tuple[str, str]
    config: dict  # the configuration (Config.to_dict) + ``checkpoint``: the weights both backends loaded
    tasks: dict[str, TaskDiff]
    record: RunRecord

    def to_json(self) -> dict:
        return {"backends": list(self.backends), "config": self.config,
                "tasks": {t: asdict(d) for t, d in self.tasks.items()}, "run_record": self.record.to_dict()}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (a prefix differs at the shorter length)."""
    n = min(len(a), len(b))
    i = next((i for i in range(n) if a[i] != b[i]), n)
    return None if i == n and len(a) == len(b) else i


def _diff_task(task: str, a: TaskResult, b: TaskResult, tokenizer) -> TaskDiff:
    shared = sorted(set(a.answers) & set(b.answers) & set(a.items) & set(b.items))
    if not shared:
        raise UserError(f"{task}: no per-item answers on both backends (output type {a.output_type}); "
                        "compare tasks scored per item, e.g. arc_easy, piqa, lambada_openai")
    diffs = []
    for doc in shared:
        if a.answers[doc] == b.answers[doc]:
            continue
        diff = ItemDiff(doc, (a.answers[doc], b.answers[doc]), (a.items[doc], b.items[doc]))
        if a.output_type == "generate_until":
            tokens = [tokenizer.encode(x, add_special_tokens=False) for x in diff.answers]
            at = diff.diverge_at = first_divergence(*tokens)
            if at is not None:
                diff.diverging_tokens = tuple(tokenizer.decode(t[at:at + 1]) for t in tokens)
        diffs.append(diff)
    only_a = sum(a.items[d] > b.items[d] for d in shared)
    only_b = sum(b.items[d] > a.items[d] for d in shared)
    from scipy.stats import binomtest  # here: scipy.stats costs every CLI start 0.7 s

    p = binomtest(only_a, only_a + only_b).pvalue if only_a + only_b else 1.0
    return TaskDiff(task, a.output_type, len(shared),
                    (sum(a.items[d] for d in shared) / len(shared), sum(b.items[d] for d in shared) / len(shared)),
                    only_a, only_b, float(p), diffs)


def compare_backends(config: EvalConfig, backends: tuple[str, str] = ("native", "vllm")) -> BackendComparison:
    """Score ``config`` on both ``backends`` (same export, same dtype, same items) and diff them per item."""
    for backend in backends:  # what each serving backend can run, in one line, before anything loads
        reason = backend in BACKENDS and BACKENDS[backend].check(replace(config.config, backend=backend))
        if reason:
            raise UserError(f"--compare-backends: {backend} cannot run this configuration here: {reason}")
    point = as_checkpoint(config.config)
    data_dir = find_data_dir(config.data_dir, required=False)
    manager = task_manager(config.tasks, data_dir, config.include_path)
    scored = [score_tasks(replace(config, config=replace(point, backend=b), reference=False), manager)
              for b in backends]
    path = resolve_model(point.model)
    tokenizer = load_tokenizer(path)
    tasks = {t: _diff_task(t, scored[0][t], scored[1][t], tokenizer) for t in config.tasks}
    scored_config = {k: v for k, v in config.config.to_dict().items() if k != "backend"} | {"checkpoint": str(path)}
    return BackendComparison(tuple(backends), scored_config, tasks, _record(config, point, path, backends, tasks))


def _record(config: EvalConfig, point, path: Path, backends, tasks: dict[str, TaskDiff]) -> RunRecord:
    return RunRecord(
        name=f"compare-backends {Path(path).name} {' vs '.join(backends)}",
        model=ModelCondition(str(point.model), model_weights_hash(point.model), point.dtype,
                             scheme=config.config.scheme_label),
        hardware=hardware_info(),
        lengths=LengthDistribution(sum(d.n for d in tasks.values()), {"tasks": list(config.tasks)},
                                   {"scored": {t: d.output_type for t, d in tasks.items()}},
                                   source=f"lm-eval tasks, limit={config.limit}, fewshot={config.fewshot}",
                                   fixed_output_length=False),
        arrival=ArrivalProcess(kind="offline scoring"),
        engine=EngineCondition(" vs ".join(backends), {"dtype": point.dtype, "kv": point.kv},
                               warmup="none (answers, not speed)", cache_warmth="n/a"),
        metric=MetricCondition(
            {"accuracy": f"lm-eval {config.metric} per backend on the items both scored",
             "disagree": "items whose answer differs: chosen choice (multiple_choice), greedy flag (loglikelihood), "
                         "generated text (generate_until)",
             "mcnemar_p": "exact binomial test on the discordant pairs (only-first vs only-second correct)",
             "diverge_at": "generation: first token index where the two outputs differ"},
            correctness="none: a report of differences, no verdict"),
        results={t: {"accuracy": list(d.accuracy), "disagree": d.disagree, "only_first": d.only_first,
                     "only_second": d.only_second, "mcnemar_p": d.mcnemar_p} for t, d in tasks.items()},
    )
