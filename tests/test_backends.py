"""Serving backends behind one interface: the native backend on the tiny model (unit), the CLI's bad-input
handling, and the native backend end to end on the default model (integration). vLLM: test_backends_vllm.py."""
import socket
import sys

import pytest

from conftest import bf16_speculation_refusal
from serving.backends import BACKENDS, open_backend
from serving.backends.base import ServingConfig
from serving.requests import Request
from serving.bench_api import run_benchmark
from evals.config import Config
from serving.loadgen import LoadSpec
from runtime.loading import load_model
from runtime.errors import UserError
from quantspec.cli import main


pytestmark = [pytest.mark.isa, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def tiny_native(tiny_llama_dir):
    with open_backend(ServingConfig(Config.parse(model=str(tiny_llama_dir)), max_model_len=200)) as backend:
        yield backend


def _requests(n, max_tokens=4):
    return [Request(i, [3 + i, 4, 5, 6], max_tokens) for i in range(n)]


def test_registry():
    assert {"native", "vllm"} <= set(BACKENDS)
    with pytest.raises(UserError, match="unknown backend"):
        open_backend(ServingConfig(Config.parse(backend="tgi")))


def test_native_closed_loop_queues_behind_batch_1(tiny_native):
    results = tiny_native.closed_loop(_requests(4), concurrency=2)
    assert [r.index for r in results] == [0, 1, 2, 3] and all(r.output_tokens == 4 for r in results)
    first, second = results[0], results[1]
    assert first.sent == second.sent  # two clients send at once ...
    assert second.started >= first.end  # ... but the batch-1 engine serves them one after another
    assert second.first_token - second.sent > first.first_token - first.sent  # the wait is part of TTFT
    assert results[2].sent == pytest.approx(first.end)  # client 1 sends its next request when its reply is in


def test_native_open_loop_records_real_arrivals(tiny_native):
    results = tiny_native.open_loop(_requests(3), offsets=[0.0, 0.0, 0.05])
    assert all(r.scheduled == r.sent for r in results)  # the client sends at the planned time
    assert results[1].started >= results[0].end > results[1].sent  # arrived while busy: waited


def test_too_long_request_is_refused(tiny_native):
    with pytest.raises(UserError, match="max_model_len"):
        tiny_native.closed_loop([Request(0, [5] * 150, 100)], 1)


def test_run_benchmark_record_has_six_conditions(tiny_native, tiny_llama_dir):
    config = ServingConfig(Config.parse(model=str(tiny_llama_dir)), max_model_len=200)
    res = run_benchmark(config, "short-short", LoadSpec.closed(2), backend=tiny_native, num_prompts=3, output_len=5)
    rec = res.record
    assert rec.model.weights_hash and rec.hardware["libraries"]["torch"]
    assert rec.lengths.n_requests == 3 and rec.lengths.output_tokens["max"] == 5 and rec.lengths.fixed_output_length
    assert rec.arrival.kind == "closed-loop" and rec.arrival.concurrency == 2
    assert "batch-1" in rec.engine.config["batching"] and rec.engine.warmup and rec.engine.cache_warmth
    assert "effective_tok_s" in rec.metric.metrics and "greedy" in rec.metric.correctness
    assert res.summary["output_tokens"] == 15 == sum(r.output_tokens for r in res.results)
    assert res.effective_tok_s == pytest.approx(15 / res.summary["window_s"])
    assert res.alpha is None and res.summary["peak_rss_mib"] > 0
    for r in res.results:  # one chunk per token without speculation: first at TTFT, last at the end
        assert len(r.chunk_times) == r.output_tokens and r.chunk_times == sorted(r.chunk_times)
        assert r.chunk_times[0] == pytest.approx(r.first_token) and r.started < r.chunk_times[-1] <= r.end
    assert 0 < res.summary["itl_s"]["p50"] <= res.summary["e2e_s"]["p50"]


@pytest.mark.parametrize("spec", [None, "ngram:min=1,max=3"])
def test_compiled_steps_of_every_span_are_built_before_the_measured_requests(tiny_llama_dir, spec_dtype, spec,
                                                                             monkeypatch):
    """Requests reaching three cache spans (``SPAN_BLOCK`` 16 here): ``run_benchmark`` has the backend build every
    span's steps (and probe them, speculating) before the measured window, which then builds nothing. Negative
    control: without ``prepare`` the measured requests build them."""
    from runtime import compiled
    from serving.backends.base import Backend
    from serving.backends.native import NativeBackend

    if spec and spec_dtype == "fp32":
        pytest.skip("fp32 greedy speculation runs eager under --compile (its probe refuses it): nothing to build")
    monkeypatch.setattr(compiled, "SPAN_BLOCK", 16)
    requests = [Request(0, [3, 4, 5, 6], 8), Request(1, [5] * 20, 8), Request(2, [7] * 36, 8)]
    monkeypatch.setattr("serving.bench_api.build_requests", lambda *a: (requests, "three lengths"))
    built_while_measured = []
    closed_loop = NativeBackend.closed_loop

    def measured(backend, reqs, *args, **kwargs):
        before = backend.compile_s
        out = closed_loop(backend, reqs, *args, **kwargs)
        if reqs is requests:
            built_while_measured.append(backend.compile_s - before)
        return out

    monkeypatch.setattr(NativeBackend, "closed_loop", measured)
    point = Config.parse(model=str(tiny_llama_dir), dtype=spec_dtype, **({"spec": spec, "k": 3} if spec else {}))
    config = ServingConfig(point, max_model_len=64, compile="default")
    res = run_benchmark(config, "short-short", LoadSpec.closed(1), num_prompts=3, output_len=8)
    assert built_while_measured == [0.0] and "cache positions built in" in res.record.engine.warmup
    monkeypatch.setattr(NativeBackend, "prepare", Backend.prepare)
    run_benchmark(config, "short-short", LoadSpec.closed(1), num_prompts=3, output_len=8)
    assert built_while_measured[1] > 0


def test_native_speculation_is_lossless_and_reports_acceptance(tiny_llama_dir, spec_dtype):
    config = ServingConfig(Config.parse(model=str(tiny_llama_dir), dtype=spec_dtype), max_model_len=200)
    spec = ServingConfig(Config.parse(model=str(tiny_llama_dir), spec="ngram:min=1,max=3", k=3, dtype=spec_dtype),
                         max_model_len=200)
    kwargs = dict(num_prompts=3, output_len=24, seed=1)
    base = run_benchmark(config, "short-short", LoadSpec.closed(1), **kwargs)
    res = run_benchmark(spec, "short-short", LoadSpec.closed(1), baseline=base, **kwargs)
    assert res.summary["greedy_match_baseline"] == 1.0  # greedy speculation emits the plain decoder's tokens
    assert res.summary["spec"]["drafts"] > 0 and 0 <= res.alpha <= 1 and 1 <= res.tau <= 4
    assert res.speedup == pytest.approx(res.effective_tok_s / base.effective_tok_s)
    assert res.record.engine.config["spec"] == "ngram:min=1,max=3 K=3"
    steps = sum(len(r.chunk_times) - 1 for r in res.results)  # one chunk per verification step
    assert res.summary["spec"]["drafts"] <= steps < sum(r.output_tokens - 1 for r in res.results)


def test_repeats_report_mean_and_ci_with_engines_alternating(tiny_llama_dir, spec_dtype):
    """``benchmark(..., repeats=3)``: every metric's mean and CI over the repeats, the speculative config's
    speedup among them, its baseline run beside it in each repeat (both native engines resident), and the load."""
    from serving.bench_sweep import benchmark

    base = ServingConfig(Config.parse(model=str(tiny_llama_dir), dtype=spec_dtype), max_model_len=200)
    spec = ServingConfig(Config.parse(model=str(tiny_llama_dir), spec="ngram:min=1,max=3", k=3, dtype=spec_dtype),
                         max_model_len=200)
    labels = []
    runs = benchmark([base, spec], [LoadSpec.closed(1)], num_prompts=2, output_len=6, repeats=3,
                     progress=lambda label, _n: labels.append(label) or (lambda: None))
    assert len(runs) == 2 and all(not r.failed for r in runs)
    for run in runs:
        stats = run.summary["repeats"]
        assert stats["n"] == 3 and stats["granularity"].startswith("interleaved")
        tok = stats["effective_tok_s"]
        assert tok["n"] == 3 and tok["ci"][0] <= tok["value"] <= tok["ci"][1]
        assert "load_1m_before" in run.summary["load"]
    assert "speedup" in runs[1].summary["repeats"] and "speedup" not in runs[0].summary["repeats"]
    # runs alternate repeat by repeat, each speculative run right after a baseline run of the same repeat
    assert ["ngram" in label for label in labels] == [False, True] * 3
    assert [label.endswith(f"({i}/3)") for i, label in zip((1, 1, 2, 2, 3, 3), labels)] == [True] * 6
    with pytest.raises(UserError, match="--repeats must be >= 1"):
        benchmark([base], [LoadSpec.closed(1)], repeats=0)


@pytest.mark.parametrize("args, needle", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--request-rate", "-2"], "--request-rate must be > 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--max-concurrency", "1,x"], "comma-separated"),
    (["--request-rate", "1", "--max-concurrency", "2"], "either --max-concurrency"),
    (["--dataset-name", "nope"], "unknown workload"),
    (["--backend", "tgi"], "unknown backend"),
    (["--spec", "ngram:k=4", "--temperature", "0.8", "--backend", "vllm"], "temperature > 0"),
    (["--spec", "layerskip:8", "--backend", "vllm"], "vLLM cannot run proposer"),
    (["--scheme", "W8A16", "--backend", "vllm"], "cannot run on vllm-cpu"),
    (["--kv", "kivi4", "--backend", "vllm"], "no vLLM equivalent"),
])
def test_cli_bad_input_one_line_exit_2(tiny_llama_dir, capsys, args, needle):
    with pytest.raises(SystemExit) as exc:
        main(["bench", str(tiny_llama_dir), "-n", "2", "--output-len", "3", "--max-model-len", "200", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], err


def test_vllm_not_installed_is_one_line(monkeypatch, tiny_llama_dir):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(UserError, match="vLLM is not installed"):
        open_backend(ServingConfig(Config.parse(model=str(tiny_llama_dir), backend="vllm")))


def test_port_in_use_is_refused_before_starting():
    from serving.backends.vllm_server import VllmServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        server = VllmServer({"model": "unused"}, port=s.getsockname()[1])
        with pytest.raises(UserError, match="in use"):
            server.start()
    assert server.proc is None  # nothing was spawned


# a stand-in for `vllm serve`: answers /health on the port it is given
FAKE_SERVE = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.parametrize("dies", [False, True])
def test_server_log_is_removed_on_a_clean_stop_and_kept_where_it_died(monkeypatch, dies):
    """A clean stop leaves nothing in the temp dir; a server that exits on its own keeps its log, named in the
    error (control: the same start with the stand-in exiting before it answers)."""
    from serving.backends import vllm_server

    code = "print('no engine: out of memory', flush=True); raise SystemExit(1)" if dies else FAKE_SERVE
    monkeypatch.setattr(vllm_server, "serve_args", lambda _kwargs, port: [sys.executable, "-c", code, str(port)])
    server = vllm_server.VllmServer({"model": "unused"})
    if dies:
        with pytest.raises(UserError, match="out of memory") as exc:
            server.start()
        assert f"(log: {server.log_path})" in str(exc.value) and server.log_path.exists() and "out of memory" in server.log_path.read_text()
        server.log_path.unlink()
        return
    server.start()
    assert server.alive() and "fake server up" in server.log_tail()
    server.stop()
    assert not server.log_path.exists()


def _stream_with(chunks: list[dict]):
    """One request through VllmServer._stream against a fake /v1/completions streaming ``chunks``."""
    import asyncio
    import json

    import httpx

    from serving.backends.vllm_server import VllmServer

    body = "".join(f"data: {json.dumps({'choices': [c]})}\n\n" for c in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    async def run():
        async with httpx.AsyncClient(base_url="http://fake", transport=transport) as client:
            return await VllmServer({"model": "m"})._stream(client, Request(0, [5, 6], 3), None, 0.0)

    return asyncio.run(run())


@pytest.mark.parametrize("chunks,error", [
    ([{"text": "ab", "token_ids": [7, 8]}, {"text": "c", "token_ids": [9], "finish_reason": "length"}], None),
    ([{"text": "ab"}, {"text": "c", "finish_reason": "length"}], "without token_ids"),
    ([{"text": "", "finish_reason": "stop"}], "without any token_ids"),
    ([{"text": "ab", "token_ids": [7, 8]}], "without a finish reason"),
])
def test_vllm_stream_counts_only_token_ids(chunks, error):
    """A response the client cannot count tokens of is a failed request, not a success with 0 tokens."""
    result = _stream_with(chunks)
    if error is None:
        assert result.ok and result.token_ids == [7, 8, 9] and len(result.chunk_times) == 2
    else:
        assert not result.ok and error in result.error


def test_cli_bench_native_writes_records(tiny_llama_dir, tmp_path, capsys):
    import json

    out = tmp_path / "bench.json"
    main_args = ["bench", str(tiny_llama_dir), "-n", "2", "--output-len", "4", "--max-model-len", "200",
                 "--request-rate", "50", "--json", str(out)]
    try:
        main(main_args)
    except SystemExit as exc:  # typer exits 0 after a command
        assert exc.code in (0, None), capsys.readouterr().err
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1 and runs[0]["arrival"]["kind"] == "poisson" and runs[0]["arrival"]["rate_rps"] == 50
    assert runs[0]["results"]["output_tokens"] == 8
    assert "eff tok/s" in capsys.readouterr().out


@pytest.mark.integration
def test_native_end_to_end_default_model():
    """bf16 and ngram K=4 on the real model, short workload, one engine per config."""
    from quantspec import benchmark as run_sweep
    from serving.serving_metrics import SLO

    config = ServingConfig(Config.parse(spec="ngram:min=2,max=4", k=4))
    refusal = bf16_speculation_refusal(load_model("default", "bf16", attn_implementation="eager"))
    if refusal:  # the native backend serves bf16: where that is not token-exact, speculation is refused
        with pytest.raises(UserError, match="not be token-exact"):
            run_sweep([config], [LoadSpec.closed(1)], "short-short", 1, 4, True, None, SLO())
        return
    runs = run_sweep([config.without_spec(), config], [LoadSpec.closed(1)], "short-short", 2, 24, True, None, SLO())
    base, spec = runs
    assert not base.failed and base.summary["output_tokens"] == 48 and base.effective_tok_s > 1
    assert spec.summary["greedy_match_baseline"] == 1.0 and spec.alpha is not None and spec.speedup
    assert base.record.model.note  # the Q4_1 caveat travels with default-model results


def test_vllm_translation_and_serve_command(tiny_llama_dir):
    import json

    from serving.backends.vllm_engine import engine_kwargs
    from serving.backends.vllm_server import serve_args

    kwargs = engine_kwargs(ServingConfig(Config.parse(model=str(tiny_llama_dir), backend="vllm", kv="fp8",
                                                      spec="ngram:min=2,max=4", k=3), max_model_len=512))
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                            "prompt_lookup_min": 2}
    assert kwargs["kv_cache_dtype"] == "fp8" and kwargs["enforce_eager"] and kwargs["dtype"] == "bfloat16"
    cmd = serve_args(kwargs, 8123)
    assert cmd[cmd.index("--port") + 1] == "8123" and "--enforce-eager" in cmd and "--disable-log-stats" not in cmd
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["num_speculative_tokens"] == 3


def test_backends_answer_what_the_search_asks(tiny_llama_dir):
    """studies name no backend: how a point's quality is scored, its quality cache key and whether speculation
    is exact by construction are the Backend class's answers (nothing loads, nothing is exported)."""
    from dataclasses import replace

    from runtime.model_store import resolve_model

    native = Config.parse(model=str(tiny_llama_dir), spec="ngram", k=2, dtype="fp32")
    plan = BACKENDS["native"].quality_plan(native)  # the transformation on the reference runtime, as served
    assert plan.point == replace(native.transformation, dtype="bf16") and plan.reference_model is None and plan.fidelity
    vllm = replace(native, backend="vllm")
    plan = BACKENDS["vllm"].quality_plan(vllm)  # through vLLM itself, in its own dtype, against the source model
    assert plan.point.backend == "vllm" and not plan.point.speculative and plan.point.dtype == "fp32"
    assert plan.reference_model == str(resolve_model(str(tiny_llama_dir))) and not plan.fidelity
    assert BACKENDS["native"].quality_key(native) == native.transformation.quality_key
    assert BACKENDS["vllm"].quality_key(vllm) != BACKENDS["native"].quality_key(native)  # never borrowed
    assert BACKENDS["native"].exactness(replace(native, dtype="bf16"))["by_construction"]
    assert not BACKENDS["native"].exactness(native)["by_construction"]  # fp32 GEMMs
    assert not BACKENDS["vllm"].exactness(replace(vllm, dtype="bf16"))["by_construction"]


def test_points_of_one_build_share_it_and_its_compiled_steps(tiny_llama_dir, spec_dtype, monkeypatch):
    """``serve_also``: a speculative point of the plain point's transformation runs on its build and plain decoder,
    builds only its verification step (compile_s counts that alone) and decodes a fresh engine's tokens. Another
    transformation, a decoder a point sent back to eager, or a proposer that changes the target's decoder (the
    negative control: n-gram marked so) gets no share of it. ``plain_twin``: only a point sent back to eager has a
    plain reference of its own, decoded on its decoder's eager step."""
    from specdec.proposers.ngram import NgramProposer

    if spec_dtype == "fp32":
        pytest.skip("fp32 greedy speculation runs eager under --compile (its probe refuses it): nothing shared")

    def config(**kw):
        return ServingConfig(Config.parse(model=str(tiny_llama_dir), dtype=spec_dtype, **kw), max_model_len=64,
                             compile="default")

    def tokens(backend):
        return backend.closed_loop([Request(0, [3, 4, 5, 6, 3, 4, 5], 8)], 1)[0].token_ids

    plain = open_backend(config())
    plain_tokens = tokens(plain)
    spec = config(spec="ngram:min=1,max=3", k=3)
    shared = plain.serve_also(spec)
    assert shared.lm is plain.lm and shared.decoder.decoder is plain.plain and shared.plain is plain.plain
    assert tokens(shared) == tokens(open_backend(spec)) == plain_tokens
    steps = plain.plain.steps
    assert sorted(steps) == [1, 4] and shared.compile_s == pytest.approx(steps[4].compile_s)
    assert plain.serve_also(config(scheme="w8ch-sym", method="rtn")) is None  # another transformation
    monkeypatch.setattr(NgramProposer, "changes_target", True)
    own = plain.serve_also(spec)
    assert own.decoder.decoder is not plain.plain and own.plain is None and own.serve_also(config()) is None
    assert shared.plain_twin() is None and plain.plain_twin() is None  # the plain point's run is the reference
    plain.plain.fall_back("a point's verification probe differed")
    assert plain.serve_also(spec) is None
    twin = shared.plain_twin()  # plain decoding on the step that point's speculation ran on: the eager step
    assert twin.plain is plain.plain and not twin.config.config.speculative and "fallback" in twin.step_label
    assert tokens(twin) == tokens(shared)
    assert own.plain_twin() is None  # its own decoder stayed compiled
