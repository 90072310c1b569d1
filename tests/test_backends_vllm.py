"""The vLLM backend end to end on the default model: a W8A8 checkpoint exported by quant/ with n-gram
speculation (in-process engine, closed loop), then bf16 behind ``vllm serve`` (open loop), whose server is
killed mid-run: a failed measurement with its log tail, and no process left behind. One engine each."""
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from serving.backends import open_backend
from serving.backends.base import ServingConfig
from evals.config import Config
from serving.bench_api import run_benchmark
from serving.loadgen import LoadSpec

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def w8a8_ngram(default_model_dir):
    config = ServingConfig(Config.parse(backend="vllm", scheme="W8A8", spec="ngram:min=2,max=4", k=4),
                           max_model_len=512)
    with open_backend(config) as backend:
        yield backend


def test_w8a8_export_with_ngram_closed_loop(w8a8_ngram):
    export = w8a8_ngram.kwargs["model"]
    qconfig = json.loads(open(os.path.join(export, "config.json")).read())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and w8a8_ngram.kwargs["quantization"] == "compressed-tensors"
    res = run_benchmark(w8a8_ngram.config, "short-short", LoadSpec.closed(2), backend=w8a8_ngram, num_prompts=4,
                        output_len=16)
    s = res.summary
    assert not res.failed and s["n_failed"] == 0
    assert s["output_tokens"] == 64 == sum(len(r.token_ids) for r in res.results)  # counted from real outputs
    assert all(r.finish_reason == "length" and r.first_token <= r.end for r in res.results)
    assert s["spec"]["drafts"] > 0 and 0 <= res.alpha <= 1 and 1 <= res.tau <= 5
    assert len(s["spec"]["accepted_per_pos"]) == 4
    assert s["itl_s"] and s["ttft_s"]["p50"] > 0 and s["peak_rss_mib"] > 100
    assert res.record.engine.config["kernel"].startswith("W8A8")
    # a second run on the same engine: counters are deltas, the engine is already warm
    again = run_benchmark(w8a8_ngram.config, "short-short", LoadSpec.closed(1), backend=w8a8_ngram, num_prompts=1,
                          output_len=8)
    assert "already warm" in again.record.engine.warmup
    assert again.summary["spec"]["draft_tokens"] <= 4 * 8
    # close() waits on the engine's own processes only: Python's resource tracker (spawned with the engine core,
    # alive until this process exits) cost every close a 15 s wait and a kill
    assert w8a8_ngram._engine_procs and all("VLLM::" in p.name() for p in w8a8_ngram._engine_procs)


def test_server_open_loop_then_crash_mid_run(default_model_dir):
    backend = open_backend(ServingConfig(Config.parse(backend="vllm"), max_model_len=512))
    ok = run_benchmark(backend.config, "short-short", LoadSpec.open(4.0), backend=backend, num_prompts=3,
                       output_len=8)
    assert not ok.failed and ok.summary["output_tokens"] == 24
    assert ok.record.arrival.kind == "poisson" and "send_lag_s" in ok.summary and ok.summary["itl_s"]
    server = backend.server
    group = server.pid
    assert backend._llm is None  # open loop never started the in-process engine

    def kill_on_first_reply(_result):
        if server.alive():
            os.killpg(group, signal.SIGKILL)

    # planned sends at 0, 4.08, 4.16 and 4.17 s (seed 0): the first request finishes alone and the kill lands
    # before the other three are sent. At 1 req/s (sends at 0 and ~1.03 s) a loaded server delayed the first
    # request's prefill, batched all four, finished them in one step, and the kill came after the run.
    crashed = run_benchmark(backend.config, "short-long", LoadSpec.open(0.25), backend=backend, num_prompts=4,
                            output_len=48, progress=kill_on_first_reply)
    assert crashed.failed and "died mid-run" in crashed.summary["error"]
    assert crashed.summary["log_tail"]  # the server's last log lines travel with the failed record
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)  # nothing of the server's process group is left
    # no server process escaped its group (the in-process engine of another fixture may still run: not ours)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                   for p in psutil.Process().children(recursive=True) if "vllm_server" in " ".join(p.cmdline()))


def test_engine_start_failure_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "quantspec.cli", "bench", "--backend", "vllm", "-n", "1",
                           "--max-model-len", "10000000"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "failed to start" in errors[0] and "Traceback" not in proc.stderr
