"""`quantspec search` / `quantspec pareto` bad input: one `error:` line, exit code 2, no traceback."""
import pytest

from quantspec.cli import main
from studies.storage import open_storage
from test_cli_errors import assert_one_line_error, run_cli


def cli_error(capsys, *args) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one `error:` line."""
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--floor", "1.5"], "relative --floor must be in (0, 1]"),
    (["--floor", "abs:2"], "absolute --floor"),
    (["--scheme", ""], "empty search space"),
    (["--backend", "tensorrt"], "unknown backend"),
    (["--k", "x"], "--k"),
    (["--k", "2,,4"], "--k"),
    (["--space", "nope"], "search space 'nope' not found"),
    (["--storage", "redis://localhost/0"], "unknown storage"),
    (["--storage", "postgresql://127.0.0.1:1/x"], "cannot open storage"),
    (["--storage", "journal:///no/such/dir/s.log"], "does not exist"),
    (["--mode", "fastest"], "unknown mode"),
    (["--sampler", "cma"], "unknown sampler"),
    (["--n-trials", "0"], "--n-trials"),
    (["--heartbeat", "5", "--grace", "5"], "--heartbeat < --grace"),
    (["--length-band", "1.2,0.8"], "--length-band needs 0 < LO <= 1 <= HI"),
    (["--length-band", "wide"], "--length-band 'wide'"),
    (["--length-tokens", "0"], "--length-tokens must be >= 1"),
])
def test_search_bad_input(tmp_path, capsys, args, needle):
    assert needle in cli_error(capsys, "search", "--study-dir", str(tmp_path), *args)


def test_study_must_exist_without_create(tmp_path, capsys):
    line = cli_error(capsys, "search", "--storage", f"sqlite:///{tmp_path}/s.db", "--study-name", "absent")
    assert "pass --create" in line


def test_pareto_bad_input(tmp_path, capsys):
    assert "no study storage" in cli_error(capsys, "pareto", "--study-dir", str(tmp_path))
    assert "unknown storage" in cli_error(capsys, "pareto", "--storage", "mongodb://x")
    open_storage(f"sqlite:///{tmp_path}/e.db")  # a storage without that study
    assert "not found" in cli_error(capsys, "pareto", "--storage", f"sqlite:///{tmp_path}/e.db", "--study-name", "x")


def test_pareto_creates_no_file(tmp_path, capsys):
    assert "no SQLite study file" in cli_error(capsys, "pareto", "--storage", f"sqlite:///{tmp_path}/none.db")
    assert "no file" in cli_error(capsys, "pareto", "--storage", f"journal:///{tmp_path}/none.log")
    assert list(tmp_path.iterdir()) == []  # no empty database, lock or journal file left behind
    # negative control: a search given the same URL does create the file
    cli_error(capsys, "search", "--storage", f"sqlite:///{tmp_path}/none.db", "--study-name", "absent")
    assert (tmp_path / "none.db").exists()


def test_unreachable_database_from_the_console_script():
    """The same path through a real process: no traceback reaches the user."""
    assert_one_line_error(run_cli("search", "--storage", "postgresql://127.0.0.1:1/x"), "cannot open storage")
