"""``quantspec accept`` (acceptance and speed vs K) and ``quantspec check-lossless``: options in, API call,
tables out."""
from __future__ import annotations

import sys

import typer

import quantspec
from quantspec import ALPHA, SamplingConfig
from quantspec.cli.app import (DataDirOption, DatasetOption, DeviceOption, DtypeOption, KOption,
                               ModelArgument, ModelOption, NumPromptsOption, OutputLenOption, OutputPathOption,
                               SpecOption, app, compile_option, flag, pick_model)
from quantspec.report import console, note, plot_sweep, print_lossless, print_sweep, progress


@app.command()
def accept(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    spec: str = SpecOption,
    k: str = KOption,
    dataset: str = DatasetOption,
    num_prompts: int = NumPromptsOption,
    output_len: int = OutputLenOption,
    natural_eos: bool = flag("--natural-eos", help="Stop at the end of turn instead (at most --output-len)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    dtype: str = DtypeOption,
    device: str = DeviceOption,
    threads: int = typer.Option(None),
    json_out: str = OutputPathOption,
    plot: str = typer.Option(None, "--plot", help="Write a PNG of α, τ and speedup vs K."),
    data_dir: str = DataDirOption,
    compile: str = compile_option("auto"),
):
    """Acceptance (α, τ, per position) and speedup vs K of proposer --spec on MODEL, beside Leviathan's prediction."""
    model = pick_model(model, model_option)
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    ks = quantspec.parse_ks(k)
    texts = quantspec.load_prompts(dataset, data_dir, num_prompts)
    lm = quantspec.load(model, dtype, threads, "eager", device)
    step = quantspec.resolve_compile(compile, str(lm.device))
    if step.why:
        note(f"decode step: {step.label}")
    proposer = quantspec.build_proposer(spec, lm)
    with progress() as bar:
        task = bar.add_task("plain", total=len(texts) * (len(ks) + 1))
        record = quantspec.measure_acceptance(lm, model, proposer, ks, texts, dataset, output_len, sampling,
                                              ignore_eos=not natural_eos,
                                              tick=lambda what: bar.update(task, advance=1, description=what),
                                              compile_mode=step.mode)
    print_sweep(record)
    if json_out:
        note(f"run record: {record.write(json_out)}")
    if plot:
        plot_sweep(record, plot)
        note(f"plot: {plot}")


@app.command("check-lossless")
def check_lossless(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    spec: str = SpecOption,
    k: str = typer.Option("4", "--k", help="Draft length(s) to check, as in `accept --k` (each checked in turn)."),
    dataset: str = DatasetOption,
    num_prompts: int = typer.Option(4, "--num-prompts", "-n", help="Prompts for the greedy equality check."),
    output_len: int = typer.Option(48, "--output-len", help="Tokens per prompt of the greedy equality check."),
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
    json_out: str = OutputPathOption,
    data_dir: str = DataDirOption,
    compile: str = compile_option("eager"),
):
    """Greedy token equality with plain decoding; sampled first steps (TV beyond the exact-sampler noise, first-
    position acceptance vs Σ min(p, q)) and a synthetic joint/bonus test, each with its detectable effect at
    power 0.999 printed; exit 1 on failure."""
    model = pick_model(model, model_option)
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    results = []
    for one_k in quantspec.parse_ks(k):
        with progress() as bar:
            task = bar.add_task(f"K={one_k}: greedy equality", total=num_prompts + prefixes * samples)
            result = quantspec.check_lossless(model, spec, one_k, dataset, num_prompts, output_len, samples, prefixes,
                                              synthetic_samples, sampling, dtype, threads, alpha, data_dir,
                                              tick=lambda what: bar.update(task, advance=1, description=f"K={one_k}: {what}"),
                                              compile_mode=quantspec.resolve_compile(compile).mode)
        print_lossless(result, one_k, alpha, num_prompts, output_len)
        results.append(result)
    if json_out:
        quantspec.write_json(json_out, results[0].record.to_dict() if len(results) == 1 else
                          {"runs": [r.record.to_dict() for r in results]})
    if not all(r.passed for r in results):
        console.print("[red]lossless check FAILED[/]")
        sys.exit(1)
    console.print("[green]lossless check passed[/]")
