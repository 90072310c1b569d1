"""Every bench/ script still parses its arguments: its imports resolve (they run when executed as a script)."""
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_help(script, monkeypatch, capsys):
    """Run as ``__main__`` in this process, as the interpreter runs a script (its folder first on sys.path): the
    interpreter's start-up per script took most of this test's time."""
    monkeypatch.chdir(BENCH.parent)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert done.value.code in (0, None) and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("script,flag", [("w8a8_decode.py", "--units"), ("quant_decode.py", "--new-tokens"),
                                         ("train_draft.py", "--context-prompts")])
def test_bench_counts_below_their_minimum_are_usage_errors(script, flag, monkeypatch, capsys):
    """A count of 0 (-1 where 0 is allowed) stops at argument parsing: exit 2 and one line naming the flag, not a
    traceback from inside the run. Negative control: plain ``int`` (what every script had) takes them."""
    from runtime.argtypes import nonnegative_int, positive_int

    value = "-1" if flag == "--context-prompts" else "0"
    monkeypatch.chdir(BENCH.parent)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), flag, value])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 2 and flag in err and "must be at least" in err, err
    assert nonnegative_int("0") == 0 and positive_int("3") == 3 and int(value) < 1


def test_a_bench_script_runs_as_a_script():
    done = subprocess.run([sys.executable, str(BENCH / "render_results.py"), "--help"], capture_output=True,
                          text=True, timeout=300, cwd=BENCH.parent)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_study_cost_timer_runs_a_search_without_failed_trials(tmp_path, tiny_llama_dir):
    """bench/study_cost.py's timing wrapper around an evaluator leaves every trial as the evaluator decides
    (it once failed every trial with a KeyError in its own bookkeeping), and counts compiled steps' builds apart."""
    from dataclasses import replace

    from optuna.trial import TrialState

    from studies.search import run_search
    from tests.test_search import ToyEvaluator, settings, toy_space

    sys.path.insert(0, str(BENCH))
    from study_cost import TimedEvaluator

    class Inner(ToyEvaluator):
        def speed(self, config):
            extra = {"reference_start_s": 0.0, "engine_start_s": 0.0, "bench_s": 0.0, "compile_s": 2.5}
            return replace(super().speed(config), extra=extra)

    timed = TimedEvaluator(Inner())
    outcome = run_search(settings(tmp_path, toy_space(tiny_llama_dir), n_trials=6), timed)
    states = [t.state for t in outcome.study.trials]
    assert TrialState.FAIL not in states and states.count(TrialState.COMPLETE) >= 3
    assert timed.counts["quality"] >= 1 and timed.counts["speed"] >= 3
    assert 1 <= timed.counts["length_run"] <= timed.counts["speed"]  # once per serving transformation
    assert timed.seconds["compile"] == 2.5 * timed.counts["speed"]  # builds apart from the speed runs


def test_llamacpp_bench_without_llama_cpp_names_the_install_step(monkeypatch, capsys):
    """bench/llamacpp.py where llama-cpp-python is not built (CI, a fresh setup): one line naming `make llamacpp`,
    exit 2; and its rounds time every engine once per round, in an order that changes between rounds."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    import llamacpp

    with pytest.raises(SystemExit) as done:
        llamacpp.llama_cpp_module()
    assert done.value.code == 2 and "make llamacpp" in capsys.readouterr().err

    calls = []

    def engine(label, seconds):
        def generate(ids, n):
            calls.append(label)
            return list(range(n)), seconds
        return llamacpp.Engine(label, label, generate, 1, "fake")

    out = llamacpp.decode_rounds([engine("a", 1.0), engine("b", 0.5), engine("c", 2.0)], [1], 11, rounds=6)
    assert out["rates"] == {"a": [10.0] * 6, "b": [20.0] * 6, "c": [5.0] * 6}
    orders = {tuple(calls[i:i + 3]) for i in range(0, 18, 3)}
    assert all(sorted(o) == ["a", "b", "c"] for o in orders) and len(orders) > 1
