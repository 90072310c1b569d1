"""The typer application every CLI command module registers on."""
import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="quantspec: quantize, speculate, and score speed per effective token against quality.")
model_app = typer.Typer(no_args_is_help=True, help="Fetch and inspect models.")
app.add_typer(model_app, name="model")

DataDirOption = typer.Option(None, "--data-dir", envvar="QUANTSPEC_DATA_DIR",
                             help="Offline eval data dir (default: ../shared/data when present).")
