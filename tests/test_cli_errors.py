"""User mistakes: one line naming the fix, exit code 2, no traceback."""
import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

QUANTSPEC = [sys.executable, "-m", "quantspec.cli"]


def run_cli(*args, env=None):
    """The console script in a process of its own, as a user runs it (environment read at start-up)."""
    return subprocess.run([*QUANTSPEC, *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=300)


def run_main(*args) -> subprocess.CompletedProcess:
    """``quantspec.cli.main`` in this process, answered as ``run_cli`` answers (exit code, stdout, stderr) without
    an interpreter's start-up; torch's thread count is restored after it."""
    from quantspec.cli import main

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    torch.set_num_threads(threads)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_missing_model_path(tmp_path):
    assert_one_line_error(run_main("generate", str(tmp_path / "nope"), "-p", "hi"), "not found")


def test_dir_without_config(tmp_path):
    assert_one_line_error(run_main("generate", str(tmp_path), "-p", "hi"), "no config.json")


def test_unknown_model_name():
    assert_one_line_error(run_main("generate", "not-a-model", "-p", "hi"), "not found")


def test_bad_dtype(tiny_llama_dir):
    assert_one_line_error(run_main("generate", str(tiny_llama_dir), "-p", "hi", "--dtype", "fp7"), "unknown dtype")


def test_bad_attention(tiny_llama_dir):
    assert_one_line_error(run_main("generate", str(tiny_llama_dir), "-p", "hi", "--attention", "flash"),
                          "unknown attention")


def test_default_model_not_fetched(tmp_path):
    proc = run_cli("generate", "-p", "hi", env={"QUANTSPEC_HOME": str(tmp_path)})
    assert_one_line_error(proc, "quantspec model fetch")


def test_hub_id_offline(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    assert_one_line_error(run_cli("generate", "someorg/somemodel", "-p", "hi", env=env), "offline")


def test_bad_temperature(tiny_llama_dir):
    assert_one_line_error(run_main("generate", str(tiny_llama_dir), "-p", "hi", "--temperature", "-1"), "temperature")


def test_missing_data_dir(tmp_path):
    from runtime.data import find_data_dir
    from runtime.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        find_data_dir(tmp_path / "absent")


def test_data_dir_found_beside_or_inside_the_checkout(tmp_path, monkeypatch):
    """``shared/data`` beside the checkout (CI) or a ``shared`` linked into it (a clone made by hand) is found;
    with neither there is none (the negative control)."""
    from runtime import data

    repo = tmp_path / "repo"
    monkeypatch.delenv("QUANTSPEC_DATA_DIR", raising=False)
    monkeypatch.setattr(data, "REPO_ROOT", repo)
    monkeypatch.chdir(tmp_path)
    assert data.find_data_dir(required=False) is None
    (repo / "shared" / "data").mkdir(parents=True)
    assert data.find_data_dir() == repo / "shared" / "data"
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert data.find_data_dir() == tmp_path / "shared" / "data"


def test_generate_on_tiny_model(tiny_llama_dir):
    proc = run_cli("generate", str(tiny_llama_dir), "-p", "abc", "--max-new-tokens", "5", "--no-chat")
    assert proc.returncode == 0, proc.stderr
    assert "decode" in proc.stdout and "tok/s" in proc.stdout


def test_version():
    from importlib.metadata import version

    proc = run_main("--version")
    assert proc.returncode == 0 and proc.stdout.startswith(f"quantspec {version('quantspec')} (torch ")


def test_model_info_on_tiny_model(tiny_llama_dir):
    proc = run_main("model", "info", str(tiny_llama_dir))
    assert proc.returncode == 0, proc.stderr
    assert "LlamaForCausalLM" in proc.stdout and "int4 (g32 asym)" in proc.stdout
    assert "Q4_1" not in proc.stdout  # the caveat belongs to the default model only


def test_bad_repeats(tiny_llama_dir):
    assert_one_line_error(run_main("bench", str(tiny_llama_dir), "--repeats", "0"), "--repeats must be >= 1")


def test_search_k_above_the_limit_refused_before_any_trial(tmp_path):
    proc = run_main("search", "--k", "40-48", "--study-dir", str(tmp_path), "--study-name", "s", "--create")
    assert_one_line_error(proc, "must be in 1..32, got 40")
    assert not list(tmp_path.iterdir())  # no study (and no reference trial) was made


def test_bad_noise_threshold(tmp_path):
    assert_one_line_error(run_main("search", "--noise-threshold", "0", "--study-dir", str(tmp_path)),
                          "--noise-threshold must be in (0, 1)")


@pytest.mark.parametrize("content, needle", [("", "holds no prompts"), ("\n\n", "holds no prompts"),
                                             ('{"prompt": "hi"}\n{oops\n', ":2: not JSON"),
                                             ('["hi"]\n', "expected a JSON object")])
def test_bad_prompts_file(tiny_llama_dir, tmp_path, content, needle):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert_one_line_error(run_main("accept", str(tiny_llama_dir), "--spec", "ngram:min=1,max=2", "--k", "1",
                                  "--dataset-name", str(path), "--num-prompts", "2"), needle)
