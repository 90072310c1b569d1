"""The shipped evaluator end to end on the real default model (tiny settings): speed via the bench harness,
quality via evals.evaluate, the greedy-equality check of a speculative trial, and the table caveat."""
import pytest

from conftest import bf16_speculation_refusal
from runtime.loading import load_model
from runtime.measure import SpeedProtocol
from studies.objective import get_evaluator
from quantspec.report import footer_lines
from studies.pareto import summarize
from studies.search import SearchSettings, open_study, run_search
from evals.config import Config
from studies.space import SearchSpace

pytestmark = [pytest.mark.integration, pytest.mark.data]

# These tests check the search, not the noise guard (test_measure): a threshold no ratio exceeds keeps every
# paired speed measurement at its 3 rounds, also on a loaded CI machine.
FEW_ROUNDS = SpeedProtocol(threshold=0.99)


def test_real_search_on_default_model(tmp_path, default_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    space = SearchSpace(weights=["none", "w4g32-asym"], methods=["rtn"], proposers=["none", "ngram:min=2,max=4"],
                        k=(2, 2))
    settings = SearchSettings(space=space, floor="0.9", n_trials=2, study_name="real", create=True,
                              study_dir=tmp_path, sampler="random", exact_fraction=1.0)
    spec = Config(weights="w4g32-asym", method="rtn", proposer="ngram:min=2,max=4", k=2)
    open_study(settings).enqueue_trial(SearchSpace.params_of(spec))
    evaluator = get_evaluator("real", limit=12, num_prompts=1, output_len=24, fidelity_windows=1, length_tokens=48,
                              length_prompts=2, length_positions=256, protocol=FEW_ROUNDS)
    study = run_search(settings, evaluator).study
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert sorted(trials) == [0, 1]  # the reference and the enqueued point
    ref, spec_trial = trials[0], trials[1]
    refusal = bf16_speculation_refusal(load_model("default", "bf16", attn_implementation="eager"))
    assert ref.state.name == "COMPLETE" and spec_trial.state.name == ("PRUNED" if refusal else "COMPLETE")
    if refusal:  # this machine's bf16 kernels are not batch-invariant: the point is pruned with that reason
        assert "not be token-exact" in spec_trial.user_attrs["pruned_reason"]
        return
    quality = ref.user_attrs["quality"]
    assert quality["passes"] and quality["value"] >= 0.9 and quality["flips"] == 0 and quality["delta"] == 0
    assert quality["decidable"] is True and quality["items_to_decide"] is None  # the floor test's, carried along
    assert ref.user_attrs["quality_basis"]["kind"] == "measured"
    assert ref.constraints["quality_floor"] == pytest.approx(0.9 - quality["value"])
    assert ref.user_attrs["speed"]["tok_s"] > 0 and ref.user_attrs["record"]["engine"]["backend"] == "native"
    for trial in (ref, spec_trial):  # speed paired with the resident reference (the reference with itself)
        paired = trial.user_attrs["speed"]
        lo, hi = paired["speedup_ci"]
        assert lo <= paired["speedup"] <= hi and trial.user_attrs["speedup"] == paired["speedup"]
        assert paired["measurement"]["rounds"] >= 3 and isinstance(trial.user_attrs["noisy"], bool)
        assert paired["measurement"]["threads"]["threads"] >= 1
        # rounds past the minimum only for a point still feasible after quality and exactness (held: why not)
        held = paired["measurement"].get("held")
        assert (held is not None) == any(trial.constraints.get(c, 0) > 0 for c in ("quality_floor", "exactness"))
        assert trial.user_attrs["record"]["results"]["paired"].get("held") == held
    speed = spec_trial.user_attrs["speed"]
    assert 0 <= speed["alpha"] <= 1 and speed["tau"] >= 1
    check = spec_trial.user_attrs["exact_check"]  # exact_fraction 1: checked although exact by construction
    assert check["n_prompts"] == 1 and check["tokens_per_prompt"] == [24]
    assert check["equal"] == all(check["equal_per_prompt"]) and (check["first_divergence"] == [None]) == check["equal"]
    basis = spec_trial.user_attrs["quality_basis"]  # the rule: quality applies only to equal outputs
    if check["equal"]:
        assert basis["kind"] == "exact by construction" and spec_trial.constraints["exactness"] == 0
    else:
        assert basis["kind"] == "infeasible" and spec_trial.constraints["exactness"] == 1.0
        assert next(r for r in summarize(study).rows if r.number == 1).feasible is False
    length = spec_trial.user_attrs["length"]  # natural end-of-turn lengths beside the reference's, 2 prompts
    if spec_trial.constraints["quality_floor"] > 0 or basis["kind"] == "infeasible":  # no length could save it
        assert length["verdict"] == "not measured" and "length_band" not in spec_trial.constraints
    else:
        assert length["reference_mean_tokens"] > 0 and 0 <= length["eot_rate"] <= 1 and length["band"] == [0.9, 1.1]
        assert length["n"] == 2 and ("length_band" in spec_trial.constraints) == (length["verdict"] != "undecidable")
        assert "<= 256 tokens" in length["prompts"] and length["measured_on"] == spec_trial.user_attrs["label"]
    ref_length = ref.user_attrs["length"]  # measured on the model: 2 prompts, identical to itself
    assert ref_length["ratio"] == 1.0 and ref_length["verdict"] == "pass" and ref_length["reference_mean_tokens"] > 0
    assert "<= 256 tokens" in ref_length["prompts"]
    summary = summarize(study)
    assert summary.conditions.startswith("model default (SmolLM2-135M-Instruct), bf16, quality on arc_easy, ")  # subtitle
    row = next(r for r in summary.rows if r.number == 1)
    assert "q4_1" in row.notes and any("Q4_1" in line for line in footer_lines(summary))


@pytest.mark.postgres
def test_two_workers_on_postgres_match_one(tmp_path, default_model_dir, pg_url, monkeypatch, one_thread):
    """The demo space on the default model: two workers on PostgreSQL measure each transformation's quality once
    between them, and each stored quality (accuracy, flips, verdict at a floor 20 items decide; at 0.9 every
    verdict read "undecidable", so agreeing on it said nothing) equals the same evaluator's measurement of that
    transformation alone, in this process. Each side has its own eval cache, so neither reads the other's scores.
    (Before, a third worker ran the whole search on SQLite beside them for this, with one eval cache for all.)"""
    from studies.objective import QualityResult
    from studies.search import QUALITY_ATTR, study_quality_key
    from studies.space import load_space
    from test_search import load, measurements, start_workers, wait_ok

    log = tmp_path / "measured.jsonl"
    demo = ("search", "--evaluator", "real", "--space", "demo", "--floor", "0.5", "--limit", "20", "--num-prompts",
            "1", "--output-len", "8", "--length-tokens", "16", "--length-prompts", "1", "--threads", "1",
            "--n-trials", "3", "--noise-threshold", str(FEW_ROUNDS.threshold))
    env = {"HF_HUB_OFFLINE": "1", "QUALITY_LOG": str(log), "QUANTSPEC_EVAL_CACHE": str(tmp_path / "workers-cache")}
    hang_guard_s = 1200  # not a speed target: on a 2-core AVX2-only CPU (bf16 emulated) one worker took 570 s
    wait_ok(start_workers(tmp_path, demo, pg_url, 2, env=env), timeout_s=hang_guard_s)
    study = load(pg_url)
    assert len({t.user_attrs["worker"]["pid"] for t in study.trials}) == 2  # both workers ran trials
    stored = {k[len(QUALITY_ATTR):]: QualityResult.from_dict(v) for k, v in study.user_attrs.items()
              if k.startswith(QUALITY_ATTR)}
    assert measurements(log, "quality") == sorted(stored)  # each transformation measured once between the two
    configs = {study_quality_key(c): c.transformation
               for c in (Config(**t.user_attrs["config"]) for t in study.trials if "config" in t.user_attrs)}
    assert study_quality_key(Config(model="default")) in stored and stored.keys() <= configs.keys()

    monkeypatch.setenv("QUANTSPEC_EVAL_CACHE", str(tmp_path / "alone-cache"))
    alone = get_evaluator("real", limit=20, threads=1, fidelity_windows=0)  # no verdict reads the KL
    # (its prepare sets the workers' one torch thread in this process: one_thread restores the count)
    alone.prepare(load_space("demo"), "0.5")

    def verdict(q: QualityResult) -> tuple:
        return q.accuracy, q.flips, q.passes, q.decidable

    assert {k: verdict(q) for k, q in stored.items()} == {k: verdict(alone.quality(configs[k])) for k in stored}
    assert all(q.decidable for q in stored.values())


def test_the_demos_length_gate_reads_no_span_its_timed_runs_do_not(default_model_dir, data_dir):
    """Every cache span is a compiled step built again (minutes each on some CPUs): the demo's natural-length runs
    (its 4 length prompts within 256 positions) read only the span its timed runs read. Negative control: the
    same number of prompts without the position bound reaches another span (the 517-token prompt)."""
    import quantspec
    from runtime.compiled import cache_span
    from runtime.loading import load_tokenizer
    from serving.backends.base import ServingConfig
    from serving.workloads import build_requests

    _, evaluator = quantspec.demo_settings(data_dir=str(data_dir))
    tok = load_tokenizer(default_model_dir)

    def spans(num_prompts: int, output_len: int, bound: int | None = None) -> set[int]:
        requests, _ = build_requests(evaluator.workload, tok, num_prompts, output_len, True, data_dir,
                                     max_total_tokens=bound)
        return {cache_span(len(r.prompt_ids) + output_len, ServingConfig.max_model_len) for r in requests}

    timed = spans(evaluator.num_prompts, evaluator.output_len)
    assert spans(evaluator.length_prompts, evaluator.length_tokens, evaluator.length_positions) == timed
    assert evaluator.length_prompts == 4 and len(timed) == 1
    assert spans(evaluator.length_prompts, evaluator.length_tokens) - timed  # negative control: no bound
