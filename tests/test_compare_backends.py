"""``quantspec eval --compare-backends``: per-item answers from lm-eval's samples, items whose answers differ, the
first diverging token of a generation, and the McNemar test; end to end through lm-eval on the tiny model (a
perturbed second backend registered here) and, with vLLM, native vs vLLM on the default model."""
from __future__ import annotations

import json
import textwrap
from dataclasses import replace

import pytest

from serving.compare_backends import _diff_task, compare_backends, first_divergence
from evals.config import Config
from evals.harness import ANSWERS, LM_FACTORIES, EvalConfig, TaskResult, native_lm, register_lm_factory
from runtime.loading import load_tokenizer


def test_answers_read_from_lm_eval_samples():
    mc = {"filtered_resps": [(-3.0, False), (-1.0, True), (-2.0, False)]}
    assert ANSWERS["multiple_choice"](mc) == 1
    assert ANSWERS["loglikelihood"]({"filtered_resps": [(-0.5, True)]}) is True
    gen = {"resps": [["raw text"]], "filtered_resps": ["filtered"]}
    assert ANSWERS["generate_until"](gen) == "raw text"  # the raw output, before answer-extraction filters


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one output is a prefix of the other
    assert first_divergence([], [4]) == 0


def _result(answers: dict, items: dict, output_type: str) -> TaskResult:
    return TaskResult("t", {}, len(items), items, output_type=output_type, answers=answers)


def test_diff_lists_every_differing_answer_even_when_both_are_wrong():
    a = _result({0: 1, 1: 2, 2: 0, 3: 3}, {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}, "multiple_choice")
    b = _result({0: 1, 1: 3, 2: 2, 3: 3}, {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0}, "multiple_choice")
    d = _diff_task("t", a, b, tokenizer=None)
    # doc 1: both wrong with different choices (a correctness-only diff would miss it); doc 2: only a right
    assert [x.doc_id for x in d.diffs] == [1, 2] and (d.only_first, d.only_second) == (1, 0)
    assert d.accuracy == (0.5, 0.25) and d.n == 4 and d.mcnemar_p == 1.0


def test_diff_finds_the_first_diverging_token_of_a_generation(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)  # character-level
    a = _result({0: "abcd", 1: "same"}, {0: 1.0, 1: 0.0}, "generate_until")
    b = _result({0: "abxd", 1: "same"}, {0: 0.0, 1: 0.0}, "generate_until")
    (diff,) = _diff_task("t", a, b, tok).diffs
    assert diff.doc_id == 0 and diff.diverge_at == 2 and diff.diverging_tokens == ("c", "x")


GEN_TASK = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture
def perturbed_backend():
    """A second eval backend: the native model with its weights rounded to int4 (outputs differ from native)."""
    @register_lm_factory("native-w4-test")
    def perturbed(config: EvalConfig):
        return native_lm(EvalConfig(replace(config.config, backend="native", weights="w4g32-asym", method="rtn"),
                                    progress=False))

    yield "native-w4-test"
    del LM_FACTORIES["native-w4-test"]


def test_compare_two_backends_through_lm_eval(tmp_path, tiny_llama_dir, perturbed_backend, monkeypatch):
    monkeypatch.setenv("QUANTSPEC_EVAL_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in ("abc", "hello", "zz top", "qq")))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_gen.yaml").write_text(textwrap.dedent(GEN_TASK.format(data=data)))
    config = EvalConfig(Config.parse(model=str(tiny_llama_dir), dtype="fp32"), tasks="tiny_gen",
                        include_path=(str(tasks),), metric="exact_match", progress=False, fidelity_windows=0)
    same = compare_backends(config, ("native", "native"))
    assert same.tasks["tiny_gen"].n == 4 and same.tasks["tiny_gen"].disagree == 0  # a backend agrees with itself
    diff = compare_backends(config, ("native", perturbed_backend)).tasks["tiny_gen"]
    assert diff.output_type == "generate_until" and diff.disagree >= 1
    tok = load_tokenizer(tiny_llama_dir)
    for item in diff.diffs:  # the reported token is where the two generations really part
        ids = [tok.encode(t, add_special_tokens=False) for t in item.answers]
        at = item.diverge_at
        assert ids[0][:at] == ids[1][:at] and ids[0][at:at + 1] != ids[1][at:at + 1]


@pytest.mark.vllm
@pytest.mark.data
@pytest.mark.integration
def test_native_vs_vllm_and_the_search_scores_vllm_points_through_vllm(default_model_dir, tmp_path, monkeypatch):
    """A W8A8 point: the search's quality comes from vLLM's own answers (not native), and --compare-backends
    shows, on the same export and items, where native and vLLM answer differently."""
    from quantspec.cli import main
    from studies.objective import get_evaluator
    from studies.space import SearchSpace

    monkeypatch.setenv("QUANTSPEC_EVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    evaluator = get_evaluator("real", limit=12, fidelity_windows=0, floor="0.5")
    evaluator.prepare(SearchSpace(), "0.5")
    quality = evaluator.quality(Config(weights="w8ch-sym", activations="a8tok-dyn", method="rtn", backend="vllm"))
    record = quality.record
    assert record["engine"]["backend"] == "vllm" and "exports" in record["model"]["model_id"]

    out = tmp_path / "cmp.json"
    with pytest.raises(SystemExit) as done:
        main(["eval", "default", "--scheme", "w8ch-sym_a8tok-dyn", "--compare-backends", "--tasks", "arc_easy",
              "--limit", "12", "--dtype", "bf16", "--output-path", str(out)])
    assert done.value.code in (0, None)
    cmp = json.loads(out.read_text())["tasks"]["arc_easy"]
    assert cmp["n"] == 12
    # the search's vLLM accuracy is the vLLM side of the comparison (same export, dtype, items: one cached eval)
    assert cmp["accuracy"][1] == pytest.approx(quality.accuracy)
    assert cmp["accuracy"][0] - cmp["accuracy"][1] == pytest.approx((cmp["only_first"] - cmp["only_second"]) / 12)
    assert len(cmp["diffs"]) <= 4  # same weights: only near-ties may flip between the two kernels


def test_a_configuration_vllm_cannot_run_is_refused_in_one_line_before_loading(tiny_llama_dir, capsys):
    from quantspec.cli import main

    with pytest.raises(SystemExit) as done:
        main(["eval", str(tiny_llama_dir), "--scheme", "W8A16", "--compare-backends", "--limit", "2"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and err.startswith("error: --compare-backends: vllm cannot run") and "\n" not in err
