"""The typer application every CLI command module registers on, and the options every command spells alike."""
import typer

from runtime.loading import DEFAULT_DTYPE

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="quantspec: quantize, speculate, and score speed per effective token against quality. "
                       "Extensions: QUANTSPEC_PLUGINS=mod1,mod2 or --plugin MOD (before the command) imports "
                       "modules that register methods, proposers, backends.")


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        import torch

        typer.echo(f"quantspec {version('quantspec')} (torch {torch.__version__})")
        raise typer.Exit()


@app.callback()
def _options(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")) -> None:
    """Options before any command."""


model_app = typer.Typer(no_args_is_help=True, help="Fetch and inspect models.")
app.add_typer(model_app, name="model")

DataDirOption = typer.Option(None, "--data-dir", envvar="QUANTSPEC_DATA_DIR",
                             help="Offline eval data dir (default: ../shared/data when present).")
ModelArgument = typer.Argument("default", metavar="MODEL", help="`default`, a local HF dir, or a hub id.")
SpecOption = typer.Option(..., "--spec", help="Proposer: ngram:min=2,max=4 (a bare `ngram` is vLLM's default, "
                                              "min=max=5) | draft:PATH\\[@SCHEME] | layerskip:L | "
                                              "selfquant:SCHEME | eagle:HEAD_DIR | a registered one.")
DtypeOption = typer.Option(DEFAULT_DTYPE, "--dtype", help=f"bf16 or fp32 (default {DEFAULT_DTYPE}, every command).")
DeviceOption = typer.Option("auto", "--device", help="cpu, cuda, or auto (default: cuda when torch sees a GPU).")
CompileOption = typer.Option(False, "--compile/--no-compile", help="Decode through torch.compile'd steps (one-token, "
                             "and speculation's K+1-token verification; each compiles on first use; prefill eager).")
