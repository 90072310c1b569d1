"""`quantspec eval` end to end on the real default model, offline."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _run(args, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "QUANTSPEC_EVAL_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "quantspec.cli", "eval", *args], capture_output=True, text=True,
                          env=env, timeout=900)


@pytest.mark.data
def test_eval_default_arc_easy_offline(default_model_dir, tmp_path):
    out = tmp_path / "eval.json"
    proc = _run(["default", "--tasks", "arc_easy", "--limit", "20", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    acc = data["results"]["arc_easy"]["acc,none"]
    assert 0.25 < acc <= 1 and data["n-samples"]["arc_easy"]["effective"] == 20  # far above chance (~0.25)
    record = data["quantspec"]["run_record"]
    assert record["model"]["weights_hash"] and "Q4_1" in record["model"]["note"]
    assert "arc_easy" in proc.stdout and "verdict" in proc.stdout


def test_unknown_task_exits_2_on_one_line(tmp_path):
    proc = _run(["default", "--tasks", "arc_easy,not_a_task", "--limit", "2"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown task(s) not_a_task")
