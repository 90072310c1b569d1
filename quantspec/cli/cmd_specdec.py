"""``quantspec accept`` (acceptance and speed vs K) and ``quantspec check-lossless``: options in, API call,
tables out."""
from __future__ import annotations

import sys

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import quantspec
from runtime.compiled import DEFAULT_MODE
from runtime.data import load_prompts
from runtime.sampling import SamplingConfig
from specdec.lossless import ALPHA
from specdec.sweep import parse_ks
from quantspec.cli.app import (CompileOption, DataDirOption, DeviceOption, DtypeOption, ModelArgument, SpecOption,
                               app)
from quantspec.report import console, plot_sweep, print_sweep


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


@app.command()
def accept(
    model: str = ModelArgument,
    spec: str = SpecOption,
    k: str = typer.Option("1,2,4,8", "--k", help="Draft lengths to sweep, comma-separated (1..32)."),
    prompts: str = typer.Option("spec_bench", help="spec_bench | mt_bench | PATH.jsonl"),
    limit: int = typer.Option(8, help="Number of prompts."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Fixed output length (ignore_eos)."),
    natural_eos: bool = typer.Option(False, "--natural-eos", help="Stop at the end of turn instead (at most -n)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    dtype: str = DtypeOption,
    device: str = DeviceOption,
    threads: int = typer.Option(None),
    json_out: str = typer.Option(None, "--json", help="Write the RunRecord here."),
    plot: str = typer.Option(None, "--plot", help="Write a PNG of α and speedup vs K."),
    data_dir: str = DataDirOption,
    compile: bool = CompileOption,
):
    """Acceptance (α, τ, per position) and speedup vs K of proposer --spec on MODEL, beside Leviathan's prediction."""
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    ks = parse_ks(k)
    texts = load_prompts(prompts, data_dir, limit)
    lm = quantspec.load(model, dtype, threads, "eager", device)
    proposer = quantspec.build_proposer(spec, lm)
    with progress_bar() as bar:
        task = bar.add_task("plain", total=len(texts) * (len(ks) + 1))
        record = quantspec.measure_acceptance(lm, model, proposer, ks, texts, prompts, max_new_tokens, sampling,
                                              ignore_eos=not natural_eos,
                                              tick=lambda what: bar.update(task, advance=1, description=what),
                                              compile_mode=DEFAULT_MODE if compile else None)
    print_sweep(record)
    if json_out:
        console.print(f"run record: {record.write(json_out)}")
    if plot:
        plot_sweep(record, plot)
        console.print(f"plot: {plot}")


@app.command("check-lossless")
def check_lossless(
    model: str = ModelArgument,
    spec: str = SpecOption,
    k: int = typer.Option(4, "--k"),
    prompts: str = typer.Option("spec_bench"),
    limit: int = typer.Option(4, help="Prompts for the greedy equality check."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n"),
    samples: int = typer.Option(400, help="Independent first-step samples per prefix for the distribution test."),
    prefixes: int = typer.Option(2, help="Prefixes (the first prompts) for the distribution test."),
    synthetic_samples: int = typer.Option(20000, help="Generations of the synthetic-vocabulary test (known p, q)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature of the distribution test."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    dtype: str = DtypeOption,
    threads: int = typer.Option(None, help="torch threads (1 is fastest on a busy 2-core machine)."),
    alpha: float = typer.Option(ALPHA, help="False-alarm bound of each distribution and acceptance test."),
    json_out: str = typer.Option(None, "--json"),
    data_dir: str = DataDirOption,
    compile: bool = CompileOption,
):
    """Greedy token equality with plain decoding; sampled first steps (TV beyond the exact-sampler noise, first-
    position acceptance vs Σ min(p, q)) and a synthetic joint/bonus test, each with its detectable effect at
    power 0.999 printed; exit 1 on failure."""
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    with progress_bar() as bar:
        task = bar.add_task("greedy equality", total=limit + prefixes * samples)
        result = quantspec.check_lossless(model, spec, k, prompts, limit, max_new_tokens, samples, prefixes,
                                          synthetic_samples, sampling, dtype, threads, alpha, data_dir,
                                          tick=lambda what: bar.update(task, advance=1, description=what),
                                          compile_mode=DEFAULT_MODE if compile else None)
    table = Table(title=f"check-lossless {result.label}, K={k}, {result.precision}, false alarm <= {alpha:g} per test")
    for col in ("check", "result", "detail"):
        table.add_column(col)
    mismatches = result.mismatches
    table.add_row("greedy == plain greedy", "FAIL" if mismatches else "ok",
                  f"{limit - len(mismatches)}/{limit} prompts token-exact over {max_new_tokens} tokens"
                  + (f"; first: {mismatches[0]}" if mismatches else ""))
    for name, passed, detail in result.rows:
        table.add_row(name, "info" if passed is None else "ok" if passed else "FAIL", detail)
    console.print(table)
    if json_out:
        result.record.write(json_out)
    if not result.passed:
        console.print("[red]lossless check FAILED[/]")
        sys.exit(1)
    console.print("[green]lossless check passed[/]")
