"""evaluate(): per-task results, reference comparison, fidelity and the on-disk cache (tiny random Llama)."""
import functools
import json

import pytest

from lm_eval.utils import make_table

from evals import cache
from evals.floor import Floor, check_floor
from evals.build import build_native
from evals.config import Config
from evals.harness import EvalConfig, evaluate
from runtime.errors import UserError


pytestmark = pytest.mark.isa


@pytest.fixture
def home(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("QUANTSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def _boom(config):
    raise AssertionError("cache hit must not build the model")


def test_quantized_eval_reports_and_caches(home, tiny_llama_dir, monkeypatch):
    config = EvalConfig(Config.parse(model=str(tiny_llama_dir), scheme="w4g32-sym", dtype="fp32"),
                        tasks=("arc_easy", "piqa"), limit=6, floor="0.5", fidelity_windows=1, fidelity_ctx=64)
    builds = []
    monkeypatch.setattr("evals.harness.build_native", lambda point, **kw: builds.append(point) or build_native(point, **kw))
    first = evaluate(config)
    assert builds == [config.config, config.reference_config().config]  # one build each: scoring and fidelity share it
    assert set(first.tasks) == {"arc_easy", "piqa"} and all(r.n == 6 for r in first.tasks.values())
    for task, comp in first.comparison.items():
        t, r = first.tasks[task], first.reference[task]
        assert comp.acc_test == pytest.approx(t.value("acc")[0]) and comp.acc_ref == pytest.approx(r.value("acc")[0])
        lost = sum(r.items[d] > t.items[d] for d in t.items)
        assert comp.flips.lost == lost
        docs = sorted(t.items)
        floor = check_floor([t.items[d] for d in docs], [r.items[d] for d in docs], Floor(0.5), config.confidence,
                            seed=config.seed)
        assert comp.passed == floor.passed == (comp.margin_ci[0] >= 0) and comp.margin_ci == floor.margin_ci
    assert first.fidelity.n_tokens == 63 and first.fidelity.mean_kl > 0 and first.fidelity.ppl_test > 1
    failed = [c for c in first.comparison.values() if not c.passed]
    assert first.verdict == ("pass" if not failed else "fail" if any(c.decidable for c in failed) else "undecidable")
    assert not any(r.cached for r in first.tasks.values())
    again = evaluate(config, lm_factory=_boom)
    assert all(r.cached for r in again.tasks.values()) and all(r.cached for r in again.reference.values())
    # the record names the kernels of the model that scored (none when every score came from the cache)
    assert first.record.hardware["kernels"]["q_proj"] and "kernels" not in again.record.hardware
    assert again.to_json()["results"] == first.to_json()["results"] and again.fidelity == first.fidelity
    out = json.loads(json.dumps(again.to_json(), default=str))
    assert out["quantspec"]["run_record"]["model"]["weights_hash"] and out["quantspec"]["verdict"] == first.verdict
    assert "arc_easy" in make_table(out) and out["configs"]["piqa"]["task"] == "piqa"  # an lm-eval results file
    for path in cache.cache_dir().glob("*.json"):  # entries as cached before lm-eval's task info was kept
        entry = json.loads(path.read_text())
        entry["value"].pop("task_info", None)
        path.write_text(json.dumps(entry))
    older = evaluate(config, lm_factory=_boom)  # lm-eval's task objects fill it in, as simple_evaluate wrote it
    lm_eval_keys = ("configs", "versions", "n-shot", "higher_is_better", "n-samples")
    assert {k: older.to_json()[k] for k in lm_eval_keys} == {k: first.to_json()[k] for k in lm_eval_keys}
    assert all(json.loads(p.read_text())["value"]["task_info"] for t in config.tasks
               for p in cache.cache_dir().glob(f"{t}-*.json"))  # and the entries keep it


def test_fidelity_ppl_matches_perplexity_module(home, tiny_llama_dir):
    from evals.fidelity import wikitext_fidelity
    from runtime.data import data_file
    from evals.perplexity import WIKITEXT2_TEST, perplexity_of_text
    from runtime.loading import load_model

    lm = load_model(tiny_llama_dir)
    stats = wikitext_fidelity(lm, lm, None, ctx=64, max_windows=2)
    head = data_file(WIKITEXT2_TEST).read_text()[:20_000]  # wikitext2_perplexity's windows, first 20k chars
    ppl = perplexity_of_text(lm, head, ctx=64, max_windows=2)
    assert stats.mean_kl < 1e-6 and stats.top1_agreement == 1.0
    assert stats.ppl_ref == pytest.approx(ppl.ppl, rel=1e-4) and stats.n_tokens == ppl.n_tokens


@pytest.mark.parametrize("point, run, match", [({}, {"limit": 0}, "limit"), ({}, {"floor": "1.5"}, "floor"),
                                               ({"backend": "tgi"}, {}, "backend"), ({}, {"tasks": ""}, "tasks")])
def test_bad_config(point, run, match):
    with pytest.raises(UserError, match=match):
        EvalConfig(Config.parse(**point), **run)


def _counting_builds(monkeypatch) -> list:
    """Every ``build_native`` the harness makes, in order (the points it built)."""
    builds = []

    def counting(point, **kw):
        builds.append(point)
        return build_native(point, **kw)

    monkeypatch.setattr("evals.harness.build_native", counting)
    return builds


EVAL_ARGS = ("--scheme", "w8ch-sym", "--kv", "k8tok-v8tok", "--tasks", "arc_easy", "--limit", "3",
             "--fidelity-windows", "1")


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_eval_cli_builds_the_parsed_config_once(home, tiny_llama_dir, monkeypatch, dtype):
    """`quantspec eval` options -> ``Config.parse`` -> the one build: the quantized point is built exactly once
    (scoring and fidelity share it), the reference once beside it, and what is built equals ``Config.parse`` of
    the options: bf16 unless --dtype says otherwise."""
    from test_cli_errors import run_main

    builds = _counting_builds(monkeypatch)
    proc = run_main("eval", str(tiny_llama_dir), *EVAL_ARGS, *(("--dtype", dtype) if dtype else ()))
    assert proc.returncode == 0, proc.stderr
    expected = Config.parse(model=str(tiny_llama_dir), scheme="w8ch-sym", kv="k8tok-v8tok",
                            **({"dtype": dtype} if dtype else {}))
    assert expected.dtype == (dtype or "bf16")
    assert builds == [expected, Config(model=str(tiny_llama_dir), dtype=expected.dtype)]
    assert builds.count(expected) == 1 and builds[0].kv_spec.label == expected.kv_spec.label


def test_build_counter_counts_every_build(home, tiny_llama_dir, monkeypatch):
    """Negative control of the test above: without the per-evaluate build cache, scoring, fidelity and the run
    record (the kernels the layers ran) each build the quantized point, and the counter sees all three (so
    "exactly once" there is a real measurement)."""
    import evals.harness as harness
    from test_cli_errors import run_main

    builds = _counting_builds(monkeypatch)
    monkeypatch.setattr(harness, "_built", functools.lru_cache(maxsize=0)(harness._built.__wrapped__))  # no reuse
    proc = run_main("eval", str(tiny_llama_dir), *EVAL_ARGS)
    assert proc.returncode == 0, proc.stderr
    assert builds.count(Config.parse(model=str(tiny_llama_dir), scheme="w8ch-sym", kv="k8tok-v8tok")) == 3
