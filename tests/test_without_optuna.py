"""The CLI and the Python API on a machine without optuna (and the other packages the lent GPU machine lacks):
everything but the search runs, and the search commands answer one line (before, the CLI died at import)."""
import os
import subprocess
import sys

from test_gpu_check import ROOT, WRAPPER

MAIN = str(ROOT / "quantspec" / "cli" / "__main__.py")


def run_blocked(*argv: str) -> subprocess.CompletedProcess:
    """``argv`` (a script and its arguments) run with the GPU machine's missing packages unimportable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_generate_runs_without_optuna(tiny_llama_dir):
    proc = run_blocked(MAIN, "generate", str(tiny_llama_dir), "-p", "hi", "--max-new-tokens", "4", "--dtype", "fp32", "--no-chat")
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stdout


def test_search_commands_refuse_in_one_line_without_optuna(tmp_path):
    for argv in (("search", "--evaluator", "toy"), ("pareto", "--storage", f"sqlite:///{tmp_path}/s.db"), ("demo",),
                 ("dashboard",)):
        proc = run_blocked(MAIN, *argv)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert "needs optuna" in line and "pip install optuna" in line


def test_api_imports_without_optuna(tmp_path):
    script = tmp_path / "api.py"
    script.write_text("import quantspec\nfrom runtime.errors import UserError\n"
                      "assert callable(quantspec.load) and quantspec.DEFAULT_STUDY_DIR\n"
                      "try:\n    quantspec.SearchSettings\nexcept UserError as exc:\n    print(exc)\n")
    proc = run_blocked(str(script))
    assert proc.returncode == 0, proc.stderr
    assert "quantspec.SearchSettings needs optuna" in proc.stdout
