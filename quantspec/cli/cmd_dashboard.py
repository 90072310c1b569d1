"""``quantspec dashboard``: optuna-dashboard on a study's storage (studies/dashboard.py), until Ctrl-C."""
from __future__ import annotations

from pathlib import Path

import typer

import quantspec
from quantspec import DEFAULT_STUDY_DIR
from quantspec.cli.app import app
from quantspec.report import console


@app.command()
def dashboard(
    storage: str = typer.Option(None, help="Optuna storage URL (sqlite:///, postgresql://, mysql://, "
                                           "journal:///FILE.log); default: SQLite in --study-dir."),
    study_dir: Path = typer.Option(DEFAULT_STUDY_DIR, "--study-dir", help="Folder of the default SQLite storage."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, help="Port to listen on (0: a free one, printed)."),
):
    """optuna-dashboard on the search's storage: trials, objectives (tok_s, quality), history, Pareto front."""
    server = quantspec.dashboard(storage, study_dir, host, port)
    console.print(f"optuna-dashboard on {quantspec.study_url(server.storage)}: [bold]{server.url}[/] (Ctrl-C stops it)",
                  soft_wrap=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        console.print("stopped")
