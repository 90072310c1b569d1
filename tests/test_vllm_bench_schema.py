"""`bench --save-result` writes `vllm bench serve`'s result file. The keys it must hold are read from the installed
vLLM's source (benchmarks/serve.py, parsed, not imported: importing vLLM costs ~20 s), so the check follows vLLM:
every key ``benchmark()`` puts in its result for a generation run, the per-metric stats it adds, the setup keys its
main writes, and the keys of each conditional branch that applies to a quantspec run (spec_decode_* when
speculating, client queue time under a concurrency cap). A branch this file has not classified fails the test."""
import ast
import importlib.util
import json
from pathlib import Path

import pytest

from serving.requests import RequestResult, SpecCounters
from serving.bench_api import BenchResult
from evals.record import ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition, RunRecord
from serving.serving_metrics import SLO, spec_summary, summarize
from serving.vllm_bench_schema import result_filename, save_results, vllm_result

SERVE = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "benchmarks" / "serve.py"

# each condition guarding result keys in vLLM's benchmark(): does it hold for a quantspec run (closed, speculative)?
APPLIES = {
    "spec_decode_stats is not None": lambda closed, spec: spec,
    "task_type == TaskType.GENERATION and tokenizer": lambda closed, spec: True,  # text generation, tokenized
    "queue_times is not None": lambda closed, spec: closed,  # vLLM: under --max-concurrency (our closed loop)
    "e2els_including_queue is not None": lambda closed, spec: False,  # a concurrency cap AND a finite rate
    "rps_change_events": lambda closed, spec: False,  # --ramp-up-strategy: quantspec's rates are fixed
    "diffusion_stats is not None": lambda closed, spec: False,  # diffusion LMs
}


def _functions(tree) -> dict:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _const_keys(statements, target: str) -> set[str]:
    """Keys of ``target["key"] = ...`` among ``statements`` (not inside nested blocks)."""
    return {t.slice.value for s in statements if isinstance(s, ast.Assign) for t in s.targets
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == target
            and isinstance(t.slice, ast.Constant)}


def vllm_result_keys(closed: bool, speculative: bool, applies: dict = APPLIES) -> set[str]:
    """The keys `vllm bench serve --save-result --save-detailed` writes for a generation run like ours."""
    tree = ast.parse(SERVE.read_text())
    funcs = _functions(tree)
    bench = funcs["benchmark"]
    literal = next(s.value for n in ast.walk(bench) if isinstance(n, ast.If) and "BenchmarkMetrics" in ast.unparse(n.test)
                   for s in n.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Dict)
                   and [ast.unparse(t) for t in s.targets] == ["result"])  # the generation branch's result
    keys = {k.value for k in literal.keys} | _const_keys(bench.body, "result")
    for node in bench.body:
        if isinstance(node, ast.If) and _const_keys(node.body, "result"):
            if applies[ast.unparse(node.test)](closed, speculative):
                keys |= _const_keys(node.body, "result")
    # per-metric stats: process_one_metric's f-string keys for each metric it is called with
    one = funcs["process_one_metric"]
    templates = [t.slice for n in ast.walk(one) if isinstance(n, ast.Assign) for t in n.targets
                 if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.JoinedStr)]
    default = next(kw.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
                   and isinstance(n.args[0], ast.Constant) and n.args[0].value == "--metric-percentiles"
                   for kw in n.keywords if kw.arg == "default")
    for node in bench.body:
        condition = ast.unparse(node.test) if isinstance(node, ast.If) else None
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "id", "") ==
                     "process_one_metric"):
            if condition is None or applies[condition](closed, speculative):
                for p in default.split(","):
                    names = {"metric_attribute_name": call.args[0].value, "p_word": p}
                    keys |= {"".join(v.value if isinstance(v, ast.Constant) else names[v.value.id]
                                     for v in t.values) for t in templates}
    main = next(f for f in funcs.values() if "date" in _const_keys(f.body, "result_json"))
    return keys | _const_keys(main.body, "result_json")


def _run(closed: bool, speculative: bool) -> BenchResult:
    """Two requests by hand: 5 tokens in 3 chunks, then 3 tokens in 2 (closed loop: one client, back to back)."""
    second = 0.3 if closed else 0.25
    results = [RequestResult(0, 10, sent=0.0, scheduled=None if closed else 0.0, first_token=0.1, end=0.3,
                             token_ids=[5, 6, 7, 8, 9], chunk_times=[0.1, 0.15, 0.3], finish_reason="length"),
               RequestResult(1, 12, sent=second, scheduled=None if closed else 0.24, first_token=second + 0.05,
                             end=second + 0.1, token_ids=[5, 6, 7], chunk_times=[second + 0.05, second + 0.1],
                             finish_reason="length")]
    summary = summarize(results, SLO())
    if speculative:
        summary["spec"] = spec_summary(SpecCounters(drafts=3, draft_tokens=12, accepted=5, accepted_per_pos=[3, 1, 1, 0]))
    spec = "ngram:min=2,max=4" if speculative else None
    record = RunRecord(
        "bench", ModelCondition("/models/SmolLM2-135M/", "abc", "bf16"), {},
        LengthDistribution(2, {}, {}, "short-short", True),
        ArrivalProcess("closed-loop", 1) if closed else ArrivalProcess("poisson", 0, 8.0, 1.0),
        EngineCondition("native", {"serving_config": {"spec": spec, "k": 4}}), MetricCondition({}, ""), summary)
    return BenchResult(record, results)


@pytest.mark.parametrize("closed, speculative", [(True, True), (False, False)])
def test_result_has_every_key_vllm_writes(closed, speculative):
    result = json.loads(json.dumps(vllm_result(_run(closed, speculative), decode=lambda ids: "x" * len(ids))))
    wanted = vllm_result_keys(closed, speculative)
    assert {"duration", "ttfts", "itls", "mean_ttft_ms", "p99_e2el_ms", "model_id", "request_rate"} <= wanted
    assert ("spec_decode_acceptance_rate" in wanted) == speculative
    assert ("p99_client_queue_time_ms" in wanted) == closed
    assert wanted - set(result) == set()
    assert set(result) - wanted <= {"quantspec", "p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms",
                                    "p50_itl_ms", "p90_itl_ms", "p50_e2el_ms", "p90_e2el_ms", "p50_client_queue_time_ms",
                                    "p90_client_queue_time_ms"}  # only extra percentiles and quantspec's own


def test_values_follow_vllm_definitions():
    result = vllm_result(_run(closed=True, speculative=True), decode=lambda ids: "x" * len(ids))
    approx = pytest.approx
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 1 and result["burstiness"] == 1.0
    assert result["duration"] == approx(0.4) and result["completed"] == 2 and result["failed"] == 0
    assert result["total_input_tokens"] == 22 and result["total_output_tokens"] == 8
    assert result["output_throughput"] == approx(20.0) == result["quantspec"]["effective_tok_s"]
    assert result["total_token_throughput"] == approx(30 / 0.4) and result["request_throughput"] == approx(5.0)
    assert result["ttfts"] == approx([0.1, 0.05]) and result["itls"] == [approx([0.05, 0.15]), approx([0.05])]
    assert result["mean_ttft_ms"] == approx(75) and result["median_e2el_ms"] == approx(200)
    assert result["mean_tpot_ms"] == approx((50 + 25) / 2) and result["mean_itl_ms"] == approx(250 / 3)
    assert result["std_e2el_ms"] == approx(100) and result["p99_e2el_ms"] == approx(298)
    assert result["queue_times"] == approx([0.0, 0.3])  # closed loop: both arrive at the start, one client
    assert result["max_output_tokens_per_s"] == 5 and result["max_concurrent_requests"] == 2  # 1 s buckets, as vLLM
    assert result["spec_decode_acceptance_rate"] == approx(100 * 5 / 12)
    assert result["spec_decode_acceptance_length"] == approx(1 + 5 / 3) == result["quantspec"]["tau"]
    assert result["spec_decode_per_position_acceptance_rates"] == approx([1, 1 / 3, 1 / 3, 0])
    assert result["generated_texts"] == ["xxxxx", "xxx"] and result["errors"] == ["", ""]
    assert result["quantspec"]["run_record"]["model"]["weights_hash"] == "abc"
    name = result_filename(result)
    assert name == f"native-ngram_min=2_max=4-k4-infqps-concurrency1-SmolLM2-135M-{result['date']}.json"
    opened = vllm_result(_run(closed=False, speculative=False), date="20250101-000000")
    assert result_filename(opened) == "native-8.0qps-SmolLM2-135M-20250101-000000.json"
    assert opened["queue_times"] == approx([0.0, 0.01]) and opened["max_concurrency"] is None


def test_negative_control_a_missing_key_fails_the_check():
    result = vllm_result(_run(closed=True, speculative=True))
    wanted = vllm_result_keys(True, True)
    for key in ("p99_itl_ms", "total_output_tokens", "spec_decode_num_drafts", "tokenizer_id"):
        assert wanted - set({k: v for k, v in result.items() if k != key}) == {key}
    unclassified = {k: v for k, v in APPLIES.items() if k != "spec_decode_stats is not None"}
    with pytest.raises(KeyError, match="spec_decode_stats"):  # a branch of vLLM's result not classified here fails
        vllm_result_keys(True, True, unclassified)


def test_save_results_names_files_as_vllm(tmp_path):
    runs = [_run(True, False), _run(True, True)]
    paths = save_results(runs, str(tmp_path), decode=str)
    assert len(paths) == 2 and all(p.parent == tmp_path for p in paths)
    assert paths[0].name.startswith("native-infqps-concurrency1-SmolLM2-135M-")
    assert json.loads(paths[1].read_text())["label"] == "native-ngram_min=2_max=4-k4"
    one = save_results(runs[:1], str(tmp_path / "d"), "mine.json", decode=str)
    assert one == [tmp_path / "d" / "mine.json"]
    two = save_results(runs, str(tmp_path / "e"), "mine.json", decode=str)
    assert [p.name for p in two] == ["mine-native-infqps-concurrency1.json",
                                     "mine-native-ngram_min=2_max=4-k4-infqps-concurrency1.json"]


@pytest.mark.isa
def test_cli_bench_save_result(tiny_llama_dir, tmp_path, capsys, one_thread):
    """`quantspec bench --save-result --result-dir` on the tiny model: one vLLM-named file per load point."""
    from quantspec.cli import main

    try:
        main(["bench", str(tiny_llama_dir), "-n", "2", "--output-len", "4", "--max-model-len", "200",
              "--max-concurrency", "1,2", "--save-result", "--result-dir", str(tmp_path / "out")])
    except SystemExit as exc:  # typer exits 0 after a command
        assert exc.code in (0, None), capsys.readouterr().err
    files = sorted((tmp_path / "out").glob("*.json"))
    assert [f.name.split(f"-{tiny_llama_dir.name}-")[0] for f in files] == ["native-infqps-concurrency1",
                                                                          "native-infqps-concurrency2"]
    for f, concurrency in zip(files, (1, 2)):
        result = json.loads(f.read_text())
        assert vllm_result_keys(True, False) - set(result) == set()
        assert result["max_concurrency"] == concurrency and result["completed"] == 2 and result["failed"] == 0
        assert result["total_output_tokens"] == 8 and result["output_lens"] == [4, 4]
        assert all(isinstance(t, str) for t in result["generated_texts"])  # decoded by the model's tokenizer
        assert result["output_throughput"] == pytest.approx(result["quantspec"]["effective_tok_s"])
        assert result["quantspec"]["run_record"]["arrival"]["concurrency"] == concurrency
    assert "vllm bench serve result:" in capsys.readouterr().out
