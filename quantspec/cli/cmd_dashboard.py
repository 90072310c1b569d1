"""``quantspec dashboard``: optuna-dashboard on a study's storage (studies/dashboard.py), until Ctrl-C.

The study module is imported inside the command: it needs optuna, and the CLI starts without it."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from quantspec.cli.app import app
from studies.defaults import DEFAULT_STUDY_DIR, require_optuna


@app.command()
def dashboard(
    storage: str = typer.Option(None, help="Optuna storage URL (sqlite:///, postgresql://, mysql://, "
                                           "journal:///FILE.log); default: SQLite in --study-dir."),
    study_dir: Path = typer.Option(DEFAULT_STUDY_DIR, "--study-dir", help="Folder of the default SQLite storage."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, help="Port to listen on (0: a free one, printed)."),
):
    """optuna-dashboard on the search's storage: trials, objectives (tok_s, quality), history, Pareto front."""
    require_optuna("quantspec dashboard")
    from studies.dashboard import open_dashboard
    from studies.storage import shown_url

    server = open_dashboard(storage, study_dir, host, port)
    console = Console()
    console.print(f"optuna-dashboard on {shown_url(server.storage)}: [bold]{server.url}[/] (Ctrl-C stops it)",
                  soft_wrap=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        console.print("stopped")
