"""The typer application every CLI command module registers on, and the options every command spells alike.

Names follow the tools users know where those have one: lm-eval (``--model/-m``, ``--num-fewshot``, ``--limit/-L``,
``--output-path/-o``) and ``vllm bench serve`` (``--num-prompts/-n``, ``--request-rate``, ``--max-concurrency``,
``--goodput``, ``--dataset-name``); docs/cli.md lists every flag with the anchor's spelling beside it."""
import logging

import typer

from quantspec import DEFAULT_DTYPE, ROTATIONS, SCHEME_PRESETS, UserError
from quantspec.report import set_verbosity

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="quantspec: quantize, speculate, and score speed per effective token against quality. "
                       "Extensions: QUANTSPEC_PLUGINS=mod1,mod2 or --plugin MOD (before the command) imports "
                       "modules that register methods, proposers, backends.")


SCHEME_HELP = (f"Preset ({', '.join(SCHEME_PRESETS)}) or label (w4g32-asym, wfp8ch-sym_afp8tok-dyn, wnvfp4g16-sym); "
               "@ignore=a,b keeps those layers dense instead of lm_head (w8ch-sym@ignore= quantizes the LM head too); "
               "@head=LABEL gives the LM head its own weight-only scheme (w4g32-sym@head=w8ch-sym: llama.cpp Q4_1's "
               "layout).")
ROTATE_HELP = (f"Rotate before quantizing: none or {', '.join(ROTATIONS)} (QuaRot-style: R1, R2 fused into the "
               "weights, R4 online before down_proj; with rtn, gptq, mse; native only).")


def flag(*names: str, help: str) -> typer.models.OptionInfo:
    """A boolean option shown as a flag (no ``<bool>`` type column in --help)."""
    return typer.Option(False, *names, help=help, metavar="")


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        import torch

        typer.echo(f"quantspec {version('quantspec')} (torch {torch.__version__})")
        raise typer.Exit()


@app.callback()
def _options(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, metavar="",
                                               help="Print the version and exit."),
             quiet: bool = flag("--quiet", "-q", help="Results and errors only: no progress bars, notes or file lines."),
             verbose: bool = flag("--verbose", "-v", help="Also the libraries' own logs and progress bars (lm-eval, "
                                                          "transformers, optuna).")) -> None:
    """Options before any command."""
    if quiet and verbose:
        raise UserError("pass -q or -v, not both")
    set_verbosity(-1 if quiet else 1 if verbose else 0)
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")


model_app = typer.Typer(no_args_is_help=True, help="Fetch and inspect models.")
app.add_typer(model_app, name="model")

DataDirOption = typer.Option(None, "--data-dir", envvar="QUANTSPEC_DATA_DIR",
                             help="Offline eval data dir (default: ../shared/data when present).")
ModelArgument = typer.Argument(None, metavar="MODEL", show_default=False,
                               help="`default` (when omitted), a local HF or compressed-tensors dir, or a hub id.")
ModelOption = typer.Option(None, "--model", "-m", show_default=False, help="MODEL, spelled as an option (lm-eval, vllm).")
SpecOption = typer.Option(..., "--spec", help="Proposer: ngram:min=2,max=4 (a bare `ngram` is vLLM's default, "
                                              "min=max=5) | draft:PATH\\[@SCHEME] | layerskip:L | "
                                              "selfquant:SCHEME | eagle:HEAD_DIR | a registered one.")
DtypeOption = typer.Option(DEFAULT_DTYPE, "--dtype", help=f"bf16 or fp32 (default {DEFAULT_DTYPE}, every command).")
DeviceOption = typer.Option("auto", "--device", help="cpu, cuda, or auto (default: cuda when torch sees a GPU).")
OutputPathOption = typer.Option(None, "--output-path", "-o", "--json", show_default=False,
                                help="Write the results (JSON) here.")
NumPromptsOption = typer.Option(8, "--num-prompts", "-n", help="Number of prompts.")
OutputLenOption = typer.Option(64, "--output-len", help="Fixed output length per prompt (ignore_eos).")
DatasetOption = typer.Option("spec_bench", "--dataset-name", help="Prompts: spec_bench | mt_bench | PATH.jsonl.")
KOption = typer.Option("1,2,4,8", "--k", help="Draft lengths: a list 1,2,4,8, a range 1-8, or both (1-4,8); 1..32.")
def compile_option(default: str):
    """``--compile``: the decode step speed is measured on (one meaning in every command that has it)."""
    return typer.Option(default, "--compile", help="Decode step: auto (compiled in inductor's max-autotune-no-"
                        "cudagraphs mode where it builds here, else eager, labelled; $QUANTSPEC_COMPILE sets what auto "
                        "means), eager, default, max-autotune-no-cudagraphs or max-autotune-cpp-wrapper (its C++ "
                        "wrapper: faster steps, longer builds). One-token and K+1-token verification steps compile "
                        "once per process (reported apart as compile_s); prefill stays eager.")


def pick_model(positional: str | None, option: str | None) -> str:
    """MODEL from the positional argument or ``--model/-m`` (the same thing twice, if at all); ``default`` if none."""
    if positional and option and positional != option:
        raise UserError(f"two models given ({positional!r} and --model {option!r}): pass one")
    return positional or option or "default"
