"""`quantspec search` / `pareto` against a real PostgreSQL server (tests/pg_server.py): the table matches SQLite's for
the same trials; wrong password, unknown database and a missing driver are one line and exit 2; `pareto` creates
no database, table or file it did not find."""
import sys

import optuna
import pytest

from quantspec.cli import main
from test_search import ToyEvaluator, settings, toy_space
from test_search_cli import cli_error
from studies.search import run_search

pytestmark = pytest.mark.postgres


def pareto_text(capsys, url: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["pareto", "--storage", url, "--study-name", "s"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_pareto_table_same_as_sqlite(tmp_path, tiny_llama_dir, pg_url, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    run_search(settings(tmp_path, toy_space(tiny_llama_dir), n_trials=10, storage=pg_url), ToyEvaluator())
    sqlite_url = f"sqlite:///{tmp_path}/copy.db"
    optuna.copy_study(from_study_name="s", from_storage=pg_url.replace("postgresql://", "postgresql+psycopg2://"),
                      to_storage=sqlite_url)
    from_pg, from_sqlite = pareto_text(capsys, pg_url), pareto_text(capsys, sqlite_url)
    rows = [line for line in from_pg.splitlines() if line.startswith("│")]
    assert len(rows) >= 3 and "tok/s" in from_pg  # a real table, not two empty ones
    assert from_pg == from_sqlite


def test_bad_connections_one_line(pg_server, pg_url, tmp_path, capsys, monkeypatch):
    wrong_pw = pg_url.replace(":qs-test-pw@", ":wrong@")
    unknown_db = pg_url.rsplit("/", 1)[0] + "/no_such_db"
    for command in (["search", "--study-dir", str(tmp_path)], ["pareto"]):
        line = cli_error(capsys, *command, "--storage", wrong_pw)
        assert "password authentication failed" in line and "wrong" not in line  # the password is not echoed
        assert 'database "no_such_db" does not exist' in cli_error(capsys, *command, "--storage", unknown_db)
    assert "no_such_db" not in pg_server.databases()
    monkeypatch.setitem(sys.modules, "psycopg2", None)  # as if psycopg2-binary were not installed
    for command in (["search", "--study-dir", str(tmp_path)], ["pareto"]):
        assert "no database driver for postgresql" in cli_error(capsys, *command, "--storage", pg_url)


def test_pareto_creates_no_schema(pg_server, pg_url, tmp_path, tiny_llama_dir, capsys):
    database = pg_url.rsplit("/", 1)[1]
    assert "no Optuna study" in cli_error(capsys, "pareto", "--storage", pg_url)
    assert pg_server.tables(database) == set()
    # negative control: the same check sees the tables a search creates
    run_search(settings(tmp_path, toy_space(tiny_llama_dir, kv=["none"]), n_trials=1, storage=pg_url), ToyEvaluator())
    assert {"studies", "trials"} <= pg_server.tables(database)
