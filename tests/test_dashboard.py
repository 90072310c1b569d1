"""``quantspec dashboard``: optuna-dashboard serves what the search stores. Its HTTP API (the JSON the page draws
from) names the objectives (``study.set_metric_names``) and carries the flat user attributes (``flat_attrs``);
a study stored without metric names shows none (negative control). Served in a thread and through the CLI in a
process of its own (SIGINT stops it); bad input is one ``error:`` line with exit code 2."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import optuna
import pytest
from optuna.trial import TrialState

from studies.dashboard import open_dashboard
from studies.search import METRIC_NAMES, run_search
from studies.storage import open_storage
from test_cli_errors import QUANTSPEC, assert_one_line_error, run_main
from test_search import ToyEvaluator, settings, toy_space

FLAT = ("tok_s", "speedup", "speedup_ci_low", "speedup_ci_high", "noisy", "alpha", "tau", "accuracy", "delta", "kl",
        "passes_floor")  # studies.search.flat_attrs, when measured
START_S = 120  # a CLI process imports torch before it listens: generous on a loaded 2-core machine


@pytest.fixture(scope="module")
def storage(tmp_path_factory, tiny_llama_dir) -> str:
    """One SQLite file: a small pareto search on the toy evaluator ("s"), and a study stored by plain Optuna
    without metric names ("plain", the negative control)."""
    folder = tmp_path_factory.mktemp("dash")
    space = toy_space(tiny_llama_dir, kv=["none"], weights=["none", "w8ch-sym", "w4g32-asym"])
    run_search(settings(folder, space, mode="pareto", sampler="random", seed=3, n_trials=6), ToyEvaluator())
    url = f"sqlite:///{folder / 'study.db'}"
    plain = optuna.create_study(study_name="plain", storage=url, directions=["maximize", "maximize"])
    plain.add_trial(optuna.trial.create_trial(values=[1.0, 2.0], user_attrs={"tok_s": 1.0}))
    return url


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def studies_by_name(base: str) -> dict[str, dict]:
    """``/api/studies``, then ``/api/studies/<id>`` of each: name -> detail."""
    summaries = get_json(f"{base}/api/studies")["study_summaries"]
    return {s["study_name"]: get_json(f"{base}/api/studies/{s['study_id']}") for s in summaries}


def attrs(trial: dict) -> dict[str, str]:
    return {a["key"]: a["value"] for a in trial["user_attrs"]}


@pytest.fixture(scope="module")
def served(storage) -> dict[str, dict]:
    with open_dashboard(storage, port=0) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.port != 0
        base = server.url.removesuffix("/dashboard/")
        page = urllib.request.urlopen(server.url, timeout=30).read().decode()
        assert "<html" in page.lower()  # the single-page app itself
        yield studies_by_name(base)


def test_metric_names_and_flat_attrs_are_served(served, storage):
    detail = served["s"]
    assert detail["objective_names"] == METRIC_NAMES["pareto"] == ["tok_s", "quality"]
    assert detail["directions"] == ["maximize", "maximize"]
    study = optuna.load_study(study_name="s", storage=storage)
    done = {t.number: t for t in study.trials if t.state == TrialState.COMPLETE}
    assert len(done) >= 3
    shown = {t["number"]: t for t in detail["trials"]}
    for number, trial in done.items():
        stored = {k: trial.user_attrs[k] for k in FLAT if k in trial.user_attrs}
        assert {"tok_s", "accuracy", "delta", "kl", "passes_floor"} <= set(stored)  # what the toy evaluator measures
        served_attrs = attrs(shown[number])
        assert {k: served_attrs[k] for k in stored} == {k: str(v) for k, v in stored.items()}
    # the columns the trial table offers (numbers sortable and charted; the floor verdict as a column)
    columns = {c["key"]: c["sortable"] for c in detail["union_user_attrs"]}
    assert {"tok_s", "accuracy", "delta", "kl"} <= {k for k, sortable in columns.items() if sortable}
    assert "passes_floor" in columns
    assert detail["best_trials"]  # the Pareto front the dashboard plots


def test_study_without_metric_names_shows_none(served):
    """Negative control: the same server, a study stored without ``set_metric_names``."""
    assert "objective_names" not in served["plain"]
    assert [attrs(t) for t in served["plain"]["trials"]] == [{"tok_s": "1.0"}]


@pytest.mark.xfail(strict=True, reason="optuna-dashboard 0.21 reads only the legacy `constraints` system attr; "
                                       "Optuna 5's Trial.set_constraint stores `constraints:<name>`")
def test_constraints_are_served(served, storage):
    trial = next(t for t in optuna.load_study(study_name="s", storage=storage).trials if t.state == TrialState.COMPLETE)
    assert trial.system_attrs["constraints:quality_floor"] is not None  # stored ...
    assert next(t for t in served["s"]["trials"] if t["number"] == trial.number)["constraints"]  # ... and shown


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_journal_storage(tmp_path):
    url = f"journal:///{tmp_path / 's.log'}"
    study = optuna.create_study(study_name="j", storage=open_storage(url), direction="maximize")
    study.set_metric_names(METRIC_NAMES["constrained"])
    study.add_trial(optuna.trial.create_trial(value=3.0, user_attrs={"tok_s": 3.0, "passes_floor": True}))
    with open_dashboard(url, port=0) as server:
        detail = studies_by_name(server.url.removesuffix("/dashboard/"))["j"]
    assert detail["objective_names"] == ["tok_s"]
    assert attrs(detail["trials"][0]) == {"tok_s": "3.0", "passes_floor": "True"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(proc: subprocess.Popen, deadline: float) -> str:
    """The process's next stdout line, waiting on the pipe (not a fixed sleep) until ``deadline``."""
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            assert line, proc.communicate()[1]  # end of output: the process ended
            return line
        assert proc.poll() is None, proc.stderr.read()
    pytest.fail(f"no line from the dashboard process within {START_S} s")


def test_cli_serves_until_sigint(storage):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    # SIGINT back to its default in the child: a suite started as a background job (`cmd &` in a script) passes
    # SIGINT on ignored, and Python then installs no KeyboardInterrupt handler (Ctrl-C would never arrive)
    proc = subprocess.Popen([*QUANTSPEC, "dashboard", "--storage", storage, "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + START_S
        line = read_line(proc, deadline)
        assert f"http://127.0.0.1:{port}/dashboard/" in line and "study.db" in line, line
        while True:  # printed just before serving: poll until the port answers
            try:
                summaries = get_json(f"http://127.0.0.1:{port}/api/studies")["study_summaries"]
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        assert sorted(s["study_name"] for s in summaries) == ["plain", "s"]
        sid = next(s["study_id"] for s in summaries if s["study_name"] == "s")
        assert get_json(f"http://127.0.0.1:{port}/api/studies/{sid}")["objective_names"] == ["tok_s", "quality"]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "Traceback" not in err, err
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---- bad input: one line naming the fix, exit 2 ----

def test_missing_storage(tmp_path):
    assert_one_line_error(run_main("dashboard", "--study-dir", str(tmp_path / "none")), "no study storage")
    assert_one_line_error(run_main("dashboard", "--storage", f"sqlite:///{tmp_path}/none.db"), "no SQLite study file")
    assert_one_line_error(run_main("dashboard", "--storage", f"journal:///{tmp_path}/none.log"), "no file")
    assert_one_line_error(run_main("dashboard", "--storage", "redis://x"), "unknown storage")
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_storage_without_studies(tmp_path):
    open_storage(f"sqlite:///{tmp_path}/e.db")  # Optuna's tables, no study
    assert_one_line_error(run_main("dashboard", "--storage", f"sqlite:///{tmp_path}/e.db"), "no studies in")


@pytest.mark.timeout(60)  # were the port taken anyway, the command would serve instead of failing
def test_busy_or_bad_port(storage):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert_one_line_error(run_main("dashboard", "--storage", storage, "--port", str(port)), f"port {port}")
    assert_one_line_error(run_main("dashboard", "--storage", storage, "--port", "70000"), "use 0..65535")

