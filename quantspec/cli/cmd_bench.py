"""``quantspec bench``: throughput per effective token and latency of one configuration at several load levels."""
from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from evals.record import write_json_atomic
from runtime.errors import UserError
from runtime.hardware import hardware_line
from runtime.measure import load_line, with_ci
from quantspec.cli.app import DataDirOption, ModelArgument, ModelOption, app, pick_model
from specdec.sweep import parse_ks
from evals.loadgen import LoadSpec
import quantspec
from quantspec.report import print_caveat
from evals.backends import backend_class
from evals.backends.base import ServingConfig
from evals.serving_metrics import SLO
from evals.vllm_bench_schema import save_results

console = Console()
if not console.is_terminal:
    console.width = 200  # keep the results table readable in logs


def parse_levels(text: str | None, cast, name: str) -> list:
    if not text:
        return []
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{name} takes a comma-separated list of numbers, got {text!r}") from None


def load_specs(concurrency: str | None, rate: str | None, burstiness: float) -> list:
    if concurrency and rate:
        raise UserError("pass either --max-concurrency (closed loop) or --request-rate (open loop), not both")
    rates = parse_levels(rate, float, "--request-rate")
    if rates:
        return [LoadSpec.open(r, burstiness) for r in rates]
    return [LoadSpec.closed(c) for c in parse_levels(concurrency or "1", int, "--max-concurrency")]


def _ms(stats: dict, key: str) -> str:
    return f"{stats[key] * 1e3:.0f}" if stats and key in stats else "-"


def print_results(title: str, runs: list) -> None:
    table = Table(title=title)
    for col in ("config", "load", "eff tok/s", "req/s", "TTFT p50/p99 ms", "TPOT p50 ms", "ITL p50/p99 ms",
                "E2E p50/p99 ms", "goodput r/s", "α", "τ", "speedup", "peak RSS MiB", "failed"):
        table.add_column(col, justify="right")
    for run in runs:
        s = run.summary
        if run.failed:
            table.add_row(_spec_label(run), run.record.arrival.kind,
                          "FAILED", *["-"] * 10, s.get("error", "")[:40])
            continue
        spec = s.get("spec") or {}
        table.add_row(
            _spec_label(run),
            _load_label(run.record.arrival), _repeated(s, "effective_tok_s", ".1f"), f"{s['requests_s']:.2f}",
            f"{_ms(s['ttft_s'], 'p50')}/{_ms(s['ttft_s'], 'p99')}", _ms(s["tpot_s"], "p50"),
            f"{_ms(s['itl_s'], 'p50')}/{_ms(s['itl_s'], 'p99')}", f"{_ms(s['e2e_s'], 'p50')}/{_ms(s['e2e_s'], 'p99')}",
            f"{s['goodput_rps']:.2f}", f"{spec['alpha']:.2f}" if spec.get("alpha") is not None else "-",
            f"{spec['tau']:.2f}" if spec.get("tau") is not None else "-",
            _repeated(s, "speedup", ".2f", "x") if s.get("speedup") else "-", f"{s['peak_rss_mib']:.0f}",
            str(s["n_failed"]))
    console.print(table)
    ok = [r.summary for r in runs if not r.failed and "load" in r.summary]
    if ok:
        load, repeated = ok[-1]["load"], ok[-1].get("repeats")
        how = (f"mean [95% CI] over {repeated['n']} repeats ({repeated['granularity']})" if repeated else
               "one run per load point, so no spread (--repeats N gives each metric's mean and CI)")
        console.print(f"[dim]{how}; {load_line(load)}[/]")
    console.print(f"[dim]{hardware_line()}[/]")


def _repeated(summary: dict, name: str, spec: str, unit: str = "") -> str:
    """A metric, as mean [95% CI] when the load point was repeated."""
    stats = (summary.get("repeats") or {}).get(name)
    if not stats:
        return format(summary[name], spec) + unit
    return with_ci(stats["value"], stats["ci"], spec, unit)


def _spec_label(run) -> str:
    cfg = run.record.engine.config["serving_config"]
    return f"{cfg['spec']} K={cfg['k']}" if cfg["spec"] else "no spec"


def _load_label(arrival) -> str:
    return f"C={arrival.concurrency}" if arrival.kind == "closed-loop" else f"λ={arrival.rate_rps:g}/s"


@app.command()
def bench(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    scheme: str = typer.Option("none", help="Weight/activation scheme: none, W8A8, W4A16, w4g32-asym, ..."),
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
):
    """Measure MODEL's effective output tokens/s, latency percentiles, goodput and (speculative) α, τ, speedup."""
    model = pick_model(model, model_option)
    loads = load_specs(concurrency, rate, burstiness)
    slo = SLO.parse(goodput) if goodput else SLO()
    spec_configs = [ServingConfig(model=model, scheme=scheme, method=method, kv=kv, spec=spec, k=one_k,
                                  backend=backend, smoothquant=smoothquant, temperature=temperature,
                                  max_model_len=max_model_len, port=port) for one_k in parse_ks(k)]
    config = spec_configs[0]
    if not config.speculative:
        spec_configs = spec_configs[:1]
    configs = ([config.without_spec()] if config.speculative and baseline else []) + spec_configs
    for c in configs:
        backend_class(c)  # refuse what cannot run before any engine starts
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        def progress(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda: bar.advance(task)

        runs = quantspec.benchmark(configs, loads, dataset, num_prompts, output_len, ignore_eos, data_dir, slo,
                                   progress, repeats)
    print_results(f"{backend}: {model} {scheme} kv={kv} | {dataset}, {num_prompts} prompts", runs)
    print_caveat(runs[-1].record)
    if json_out:
        write_json_atomic(json_out, {"runs": [r.record.to_dict() for r in runs]})
        console.print(f"run records: {json_out}")
    if save_result:
        for path in save_results(runs, result_dir, result_filename):
            console.print(f"vllm bench serve result: {path}")
    failed = [r for r in runs if r.failed]
    if failed:
        print(f"error: measurement failed: {failed[0].summary['error']} (engine log tail in the JSON record)",
              file=sys.stderr)
        raise typer.Exit(1)
