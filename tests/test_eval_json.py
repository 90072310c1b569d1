"""`eval --json` / ``EvalReport.to_json`` is an lm-eval results file: lm-eval's own ``make_table`` renders it, it
has every key lm-eval's ``evaluate()`` returns (read from the installed lm-eval, so the check follows it) and no
top-level key lm-eval does not know, quantspec's fields all under ``quantspec``."""
import json

import pytest
from lm_eval.evaluator_utils import EvalAcc
from lm_eval.result_schema import EvalResults
from lm_eval.utils import make_table

from evals.harness import EvalReport, TaskResult
from evals.record import ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition, RunRecord

CORE = set(EvalAcc()._to_eval_results())  # what lm-eval's evaluate() always returns (results, configs, versions, ...)
KNOWN = set(EvalResults.__annotations__)  # every key an lm-eval results file may hold


def results_file_problems(d: dict) -> list[str]:
    """Why ``d`` is not a complete lm-eval results file for its tasks (empty: it is)."""
    problems = [f"missing {k}" for k in sorted(CORE - set(d))]
    problems += [f"top-level key lm-eval does not know: {k}" for k in sorted(set(d) - KNOWN - {"quantspec"})]
    for task in d.get("results", {}):
        for key in ("configs", "versions", "n-shot", "higher_is_better", "n-samples"):
            if task not in d.get(key, {}):
                problems.append(f"{key} lacks {task}")
        samples = d.get("n-samples", {}).get(task, {})
        if not (isinstance(samples.get("original"), int) and isinstance(samples.get("effective"), int)):
            problems.append(f"n-samples of {task} is not {{original, effective}}: {samples}")
        if d.get("configs", {}).get(task, {}).get("task") != task:
            problems.append(f"configs[{task}] is not its task config")
    return problems


def fake_report() -> EvalReport:
    info = {"config": {"task": "arc_easy", "output_type": "multiple_choice", "num_fewshot": 0,
                       "metadata": {"version": 1.0}},
            "version": 1.0, "n_shot": 0, "higher_is_better": {"acc": True, "acc_norm": True}, "n_original": 2376}
    metrics = {"name": "arc_easy", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": 0.25,
               "acc_norm,none": 0.75, "acc_norm_stderr,none": 0.2}
    test = TaskResult("arc_easy", metrics, 4, {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}, task_info=info)
    ref = TaskResult("arc_easy", {**metrics, "acc,none": 0.75}, 4, {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0}, task_info=info)
    record = RunRecord("eval tiny", ModelCondition("tiny", "abc", "fp32"), {}, LengthDistribution(4, {}, {}, "t", True),
                       ArrivalProcess("offline scoring"), EngineCondition("native"), MetricCondition({}, "none"))
    return EvalReport({"model": "tiny", "backend": "native", "limit": 4, "fewshot": 0, "seed": 0},
                      {"arc_easy": test}, {"arc_easy": ref}, {}, None, "no floor", record, ["a note"])


def test_report_json_is_an_lm_eval_results_file():
    d = json.loads(json.dumps(fake_report().to_json()))
    assert results_file_problems(d) == []
    table = make_table(d)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    # Tasks, Version, Filter, n-shot, Metric, ↑, Value, ±, Stderr
    assert rows[0][:6] == ["arc_easy", "1", "none", "0", "acc", "↑"] and rows[1][4] == "acc_norm"
    assert (float(rows[0][6]), float(rows[0][8]), float(rows[1][6])) == (0.5, 0.25, 0.75)
    assert d["n-samples"]["arc_easy"] == {"original": 2376, "effective": 4} and d["n-shot"] == {"arc_easy": 0}
    q = d["quantspec"]
    assert set(q) == {"config", "comparison", "fidelity", "verdict", "notes", "reference_results", "run_record"}
    assert q["reference_results"]["arc_easy"]["acc,none"] == 0.75 and q["run_record"]["model"]["weights_hash"] == "abc"


def test_negative_controls_incomplete_or_old_layout_is_caught():
    good = json.loads(json.dumps(fake_report().to_json()))
    no_versions = {k: v for k, v in good.items() if k != "versions"}
    with pytest.raises(KeyError, match="versions"):
        make_table(no_versions)  # lm-eval's table needs versions
    no_nshot = {k: v for k, v in good.items() if k != "n-shot"}
    assert results_file_problems(no_nshot) == ["missing n-shot", "n-shot lacks arc_easy"]
    old = {"results": good["results"], "n-samples": {"arc_easy": {"effective": 4}},
           "reference_results": good["quantspec"]["reference_results"], "quantspec": {},
           "run_record": good["quantspec"]["run_record"]}  # the layout before: lm-eval could not read it whole
    problems = results_file_problems(old)
    assert "missing configs" in problems and "top-level key lm-eval does not know: run_record" in problems
    assert "top-level key lm-eval does not know: reference_results" in problems
    assert any(p.startswith("n-samples of arc_easy") for p in problems)


@pytest.mark.isa
@pytest.mark.data
def test_cli_eval_json_renders_with_make_table(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """`quantspec eval --json` on the tiny model: the file make_table renders, with the task config lm-eval built."""
    from quantspec.cli import main

    monkeypatch.setenv("QUANTSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("QUANTSPEC_EVAL_CACHE", raising=False)
    out = tmp_path / "eval.json"
    try:
        main(["eval", str(tiny_llama_dir), "--tasks", "arc_easy", "--limit", "3", "--fidelity-windows", "0",
              "--no-reference", "--dtype", "fp32", "--json", str(out)])
    except SystemExit as exc:  # typer exits 0 after a command
        assert exc.code in (0, None), capsys.readouterr().err
    d = json.loads(out.read_text())
    assert results_file_problems(d) == []
    assert "arc_easy" in make_table(d)
    assert d["configs"]["arc_easy"]["output_type"] == "multiple_choice" and d["versions"]["arc_easy"] == 1.0
    assert d["higher_is_better"]["arc_easy"] == {"acc": True, "acc_norm": True}
    assert d["n-samples"]["arc_easy"]["effective"] == 3 and d["n-samples"]["arc_easy"]["original"] > 3
    assert d["quantspec"]["run_record"]["model"]["weights_hash"] and d["quantspec"]["verdict"] == "no floor"
