"""``quantspec bench``: throughput per effective token and latency of one configuration at several load levels."""
from __future__ import annotations

import sys

import typer

import quantspec
from quantspec import Config, ServingConfig
from quantspec.cli.app import (ROTATE_HELP, SCHEME_HELP, DataDirOption, ModelArgument, ModelOption, app,
                               compile_option, pick_model)
from quantspec.report import note, print_bench, print_caveat, progress


@app.command()
def bench(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    scheme: str = typer.Option("none", help=f"{SCHEME_HELP} none: unquantized."),
    method: str = typer.Option("rtn", help="Weight quantization method."),
    kv: str = typer.Option("none", help="KV-cache format: none (bf16), fp8, kivi4, k8tok-v4chg32, ..."),
    spec: str = typer.Option(None, help="Proposer, e.g. ngram:k=4, ngram:min=2,max=4, draft:PATH (default: none)."),
    k: str = typer.Option("4", "--k", help="Draft tokens per step, as in `accept --k`: several Ks run one config "
                                           "each (a k= inside --spec wins)."),
    backend: str = typer.Option("native", help="native (batch-1, requests queue) or vllm (continuous batching); "
                                               "both serve bf16, the default dtype of every command."),
    dataset: str = typer.Option("short-short", "--dataset-name", help="spec_bench, mt_bench, short-short, long-short, "
                                "short-long, mix, or a prompts .jsonl path."),
    concurrency: str = typer.Option(None, "--max-concurrency", help="Closed-loop client counts, e.g. 1,4,16 (default 1)."),
    rate: str = typer.Option(None, "--request-rate", help="Open-loop Poisson rates in req/s, e.g. 0.5,1,2."),
    burstiness: float = typer.Option(1.0, help="Gamma shape of inter-arrivals (1 = Poisson)."),
    num_prompts: int = typer.Option(16, "--num-prompts", "-n", help="Requests per load point."),
    output_len: int = typer.Option(None, "--output-len", "--random-output-len", show_default=False,
                                   help="Fixed output length (default: the dataset's)."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--natural-eos", metavar="",
                                    help="Generate exactly the output length, or stop at EOS and report real lengths."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    max_model_len: int = typer.Option(1024, help="Engine context length (prompt + output must fit)."),
    port: int = typer.Option(0, help="Port of the vllm serve used for --request-rate runs (0 = a free one)."),
    baseline: bool = typer.Option(True, metavar="", help="With --spec, also run without speculation for the speedup."),
    repeats: int = typer.Option(1, "--repeats", help="Repeat each load point N times and report each metric's mean "
                                "and 95% CI across repeats (native engines alternate run by run)."),
    goodput: str = typer.Option(None, "--goodput", show_default=False,
                                help="Goodput SLOs in ms as `vllm bench serve` takes them: ttft:2000,tpot:200 "
                                     "(default; a bound left out does not count)."),
    json_out: str = typer.Option(None, "--output-path", "-o", "--json", show_default=False,
                                 help="Write every run record to this JSON file."),
    save_result: bool = typer.Option(False, "--save-result", metavar="",
                                     help="Also write each run (config x load point) in `vllm bench serve`'s result "
                                          "schema, named as vLLM names it (quantspec's extras under `quantspec`)."),
    result_dir: str = typer.Option(None, "--result-dir", help="Folder for --save-result files (default: here)."),
    result_filename: str = typer.Option(None, "--result-filename",
                                        help="--save-result file name (several runs: NAME-LABEL-RATEqps... each)."),
    data_dir: str = DataDirOption,
    smoothquant: float = typer.Option(None, "--smoothquant", metavar="ALPHA",
                                      help="SmoothQuant alpha before a W8A8 scheme (e.g. 0.5); native only."),
    rotate: str = typer.Option("none", "--rotate", help=ROTATE_HELP),
    compile: str = compile_option("auto"),
):
    """Measure MODEL's effective output tokens/s, latency percentiles, goodput and (speculative) α, τ, speedup."""
    model = pick_model(model, model_option)
    loads = quantspec.LoadSpec.parse(concurrency, rate, burstiness)
    slo = quantspec.SLO.parse(goodput) if goodput else quantspec.SLO()
    spec_configs = [ServingConfig(Config.parse(model=model, scheme=scheme, method=method, kv=kv, spec=spec, k=one_k,
                                               backend=backend, smoothquant=smoothquant, rotate=rotate),
                                  temperature=temperature, max_model_len=max_model_len, port=port, compile=compile)
                    for one_k in quantspec.parse_ks(k)]
    config = spec_configs[0]
    if not config.config.speculative:
        spec_configs = spec_configs[:1]
    configs = ([config.without_spec()] if config.config.speculative and baseline else []) + spec_configs
    with progress() as bar:
        def counter(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda: bar.advance(task)

        runs = quantspec.benchmark(configs, loads, dataset, num_prompts, output_len, ignore_eos, data_dir, slo,
                                   counter, repeats)
    print_bench(f"{backend}: {model} {scheme} kv={kv} | {dataset}, {num_prompts} prompts", runs)
    print_caveat(runs[-1].record)
    if json_out:
        quantspec.write_json(json_out, {"runs": [r.record.to_dict() for r in runs]})
        note(f"run records: {json_out}")
    if save_result:
        for path in quantspec.save_vllm_bench_results(runs, result_dir, result_filename):
            note(f"vllm bench serve result: {path}")
    failed = [r for r in runs if r.failed]
    if failed:
        print(f"error: measurement failed: {failed[0].summary['error']} (engine log tail in the JSON record)",
              file=sys.stderr)
        raise typer.Exit(1)
