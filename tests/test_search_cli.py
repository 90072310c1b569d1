"""`quantspec search` / `quantspec pareto` bad input: one `error:` line, exit code 2, no traceback."""
import pytest

from test_cli_errors import assert_one_line_error, run_cli


@pytest.mark.parametrize("args, needle", [
    (["--floor", "1.5"], "relative --floor must be in (0, 1]"),
    (["--floor", "abs:2"], "absolute --floor"),
    (["--weights", ""], "empty search space"),
    (["--backends", "tensorrt"], "unknown backend"),
    (["--k", "x"], "--k"),
    (["--space", "nope"], "search space 'nope' not found"),
    (["--storage", "redis://localhost/0"], "unknown storage"),
    (["--storage", "postgresql://127.0.0.1:1/x"], "cannot open storage"),
    (["--storage", "journal:///no/such/dir/s.log"], "does not exist"),
    (["--mode", "fastest"], "unknown mode"),
    (["--sampler", "cma"], "unknown sampler"),
    (["--n-trials", "0"], "--n-trials"),
])
def test_search_bad_input(tmp_path, args, needle):
    assert_one_line_error(run_cli("search", "--study-dir", str(tmp_path), *args), needle)


def test_study_must_exist_without_create(tmp_path):
    proc = run_cli("search", "--storage", f"sqlite:///{tmp_path}/s.db", "--study-name", "absent")
    assert_one_line_error(proc, "pass --create")


def test_pareto_bad_input(tmp_path):
    assert_one_line_error(run_cli("pareto", "--study-dir", str(tmp_path)), "no study storage")
    assert_one_line_error(run_cli("pareto", "--storage", "mongodb://x"), "unknown storage")
    assert_one_line_error(run_cli("pareto", "--storage", f"sqlite:///{tmp_path}/e.db", "--study-name", "x"),
                          "not found")
