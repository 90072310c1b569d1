"""bench/gpu_check.py end to end on CPU (``--device cpu --tiny``), with the packages the GPU machine lacks made
unimportable, so the check is not broken when a GPU finally runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant.gemv import cpu_kernel

# one xdist worker runs the whole module: its module fixture runs the check (~20 s) once, not once per worker
pytestmark = pytest.mark.xdist_group("gpu_check")
ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("vllm", "lm_eval", "optuna", "compressed_tensors", "datasets", "gguf")
# Every import finder answers "not installed" for the blocked packages (as on the GPU machine: find_spec gives
# None, import raises ModuleNotFoundError), checked on optuna, which this environment has; then the script runs.
WRAPPER = f"""
import importlib.util, runpy, sys
BLOCKED = {BLOCKED!r}
class Hide:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
assert importlib.util.find_spec("optuna") is None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_check(*args, out_dir: Path):
    cmd = [sys.executable, "-c", WRAPPER, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--tiny",
           "--out-dir", str(out_dir), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    path = out_dir / "gpu-check.tiny.json"
    return proc, json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_check(out_dir=tmp_path_factory.mktemp("gpu-check"))


def test_every_stage_ok(full_run):
    proc, record = full_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record["ok"] and "random weights" in record["note"]
    assert list(record["stages"]) == ["bandwidth", "kernels", "cuda_tests", "decode", "speculative"]
    assert all(s["status"] == "ok" for s in record["stages"].values()), record["stages"]
    assert record["stages"]["bandwidth"]["bandwidth_gb_s"] > 0
    assert "tests/test_device.py" in record["stages"]["cuda_tests"]["files"]
    assert record["hardware"]["libraries"]["torch"]


def test_decode_rows(full_run):
    rows = full_run[1]["stages"]["decode"]["rows"]
    assert {(r["format"], r["engine"]) for r in rows} == {
        ("bf16", "eager"), ("bf16", "compiled"), ("bf16", "hf"), ("w8ch-sym", "eager"), ("w4g32-sym", "eager")}
    for r in rows:
        assert r["status"] == "ok" and r["decode_tok_s"] > 0 and r["roofline_pct"] > 0 and r["kernels"], r
        if r["engine"] == "compiled" and not torch.cuda.is_available():  # CPU steps attend with another attention:
            assert r["tokens_equal_to_eager"] is not None, r  # bf16 tokens may part from eager SDPA's (recorded)
        else:
            assert r["tokens_equal_to_eager"], r
    quantized = {r["format"]: r for r in rows if r["format"] != "bf16"}
    assert all("simulated" in r and r["quantized_kernels"] for r in quantized.values())
    dense = next(r for r in rows if r["format"] == "bf16")
    assert quantized["w4g32-sym"]["bytes_per_token"] < quantized["w8ch-sym"]["bytes_per_token"] < dense["bytes_per_token"]


def test_kernel_rows(full_run):
    """One product per format at both MLP shapes, each by the kernel the registry picks here, close to the bf16
    product of its dequantized weight."""
    rows = full_run[1]["stages"]["kernels"]["rows"]
    assert {(r["format"], tuple(r["shape"])) for r in rows} == {
        (f, s) for f in ("bf16", "w8ch-sym", "w4g32-sym", "fp8-e4m3 _scaled_mm") for s in ((128, 64), (64, 128))}
    assert all(r["status"] == "ok" and r["us"] > 0 and r["max_rel_error"] < 0.1 for r in rows), rows
    assert {r["kernel"] for r in rows if r["format"] == "w4g32-sym"} == {cpu_kernel(4)}


def test_targets_derived_and_rendered(full_run):
    """The targets are read off the rows (ratio to bf16 on the same engine) and the results page renders them."""
    sys.path.insert(0, str(ROOT / "bench"))
    from render_results import render_gpu_check

    record = full_run[1]
    rows = {(r["format"], r["engine"]): r for r in record["stages"]["decode"]["rows"]}
    assert rows[("w4g32-sym", "eager")]["vs_bf16_same_engine"] == round(
        rows[("w4g32-sym", "eager")]["decode_tok_s"] / rows[("bf16", "eager")]["decode_tok_s"], 2)
    target = record["targets"]["bf16_compiled_roofline_pct"]
    assert target["value"] == rows[("bf16", "compiled")]["roofline_pct"] and target["met"] == (target["value"] >= 60)
    page = render_gpu_check(record)
    assert "int4_over_bf16_compiled" in page and cpu_kernel(4) in page and "**Conditions**" in page


def test_speculation_rows(full_run):
    stage = full_run[1]["stages"]["speculative"]
    fp32 = [r for r in stage["rows"] if r["dtype"] == "fp32"]
    assert {r["proposer"].split(":")[0] for r in fp32} == {"ngram", "selfquant"}
    assert all(r["exact"] and r["decode_tok_s"] > 0 and r["alpha"] is not None for r in fp32), fp32
    assert stage["all_fp32_exact"] and stage["plain_tok_s"] > 0
    bf16 = next(r for r in stage["rows"] if r["dtype"] == "bf16")
    assert bf16["exact"] if bf16["status"] == "ok" else bf16["status"] == "refused" and bf16["reason"]


def test_failed_stage_recorded_and_rest_run(tmp_path):
    """Negative control: the first stage forced to fail is recorded as failed, the next still runs, exit 1."""
    proc, record = run_check("--stages", "bandwidth,speculative", "--fail-stage", "bandwidth", out_dir=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    stages = record["stages"]
    assert stages["bandwidth"]["status"] == "failed" and "forced to fail" in stages["bandwidth"]["error"]
    assert stages["speculative"]["status"] == "ok" and not record["ok"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: device 'cuda' is not available here") and "--device cpu" in proc.stderr


def test_derive_refuses_a_file_it_cannot_read(tmp_path):
    """--derive on a missing file or another bench's JSON: one error line, exit 2, the file untouched."""
    other = tmp_path / "other.json"
    other.write_text('{"name": "decode"}')
    for path in (tmp_path / "absent.json", other):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--derive", str(path)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.startswith("error: --derive")
    assert other.read_text() == '{"name": "decode"}'
