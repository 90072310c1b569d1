"""``quantspec eval``: task accuracy (lm-eval), Δ vs the unquantized reference, flips, KL, PPL, verdict."""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from evals.compare_backends import BackendComparison, compare_backends
from evals.harness import EvalConfig, EvalReport, evaluate
from evals.record import write_json_atomic
from quantspec.cli.app import DataDirOption, DtypeOption, ModelArgument, ModelOption, app, flag, pick_model
from runtime.model_store import caveat_applies

console = Console()


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def print_report(report: EvalReport) -> None:
    cfg = report.config
    metric = cfg["metric"]
    title = (f"{cfg['model']} scheme={cfg['scheme'] or 'dense'} method={cfg['method'] if cfg['scheme'] else '-'} "
             f"kv={cfg['kv'] or 'dense'} backend={cfg['backend']} limit={cfg['limit']} fewshot={cfg['fewshot']}")
    table = Table(title=title)
    for col in ("task", "n", f"{metric} % ± se", f"ref {metric} %", f"Δ pts [{cfg['confidence']:.0%} CI]",
                "flips (-lost/+gained)", "floor margin lo", "cached"):
        table.add_column(col, justify="right")
    for task, res in report.tasks.items():
        value, stderr = res.value(metric)
        ref_value = report.reference[task].value(metric)[0] if task in report.reference else None
        comp = report.comparison.get(task)
        table.add_row(
            task, str(res.n), f"{_pct(value)} ± {_pct(stderr)}", _pct(ref_value),
            f"{100 * comp.delta:+.1f} [{100 * comp.delta_ci[0]:+.1f}, {100 * comp.delta_ci[1]:+.1f}]" if comp else "-",
            f"{comp.flips.total} (-{comp.flips.lost}/+{comp.flips.gained})" if comp else "-",
            f"{100 * comp.margin_ci[0]:+.1f}" if comp and cfg["floor"] else "-",
            "yes" if res.cached else "no",
        )
    console.print(table)
    if report.fidelity:
        f = report.fidelity
        console.print(f"WikiText-2 fidelity vs reference ({f.n_tokens} tokens): KL mean {f.mean_kl:.4f} / p99 "
                      f"{f.p99_kl:.4f} nats, top-1 agreement {100 * f.top1_agreement:.1f}%, PPL {f.ppl_test:.2f} "
                      f"(reference {f.ppl_ref:.2f})")
    colour = {"pass": "green", "fail": "red"}.get(report.verdict, "yellow")
    floor = report.record.metric.correctness
    console.print(f"verdict: [bold {colour}]{report.verdict.upper()}[/] ({floor})")
    undecided = report.comparison if report.verdict == "undecidable" else {}
    for task, c in ((t, c) for t, c in undecided.items() if not c.decidable):
        more = f"about {c.items_to_decide} items (--limit) would decide it" if c.items_to_decide else \
            "no number of items decides it: only a configuration beating the reference could pass"
        console.print(f"  {task}: at n={c.n} even answers equal to the reference's on every item could not "
                      f"pass {c.floor}; {more}")
    four_bit = caveat_applies(report.record.to_dict())
    for note in report.notes:
        if four_bit or not note.startswith("default model:"):  # the Q4_1 note only beside 4-bit results
            console.print(f"[yellow]note:[/] {note}")


def print_comparison(comparison: BackendComparison, show: int = 10) -> None:
    first, second = comparison.backends
    cfg = comparison.config
    table = Table(title=f"{cfg['model']} weights={cfg.get('weights')} activations={cfg.get('activations')} "
                        f"dtype={cfg.get('dtype', 'bf16')}: {first} vs {second}, same weights and items "
                        f"({cfg['checkpoint']})")
    for col in ("task", "n", f"{first} %", f"{second} %", "answers differ", f"only {first} right",
                f"only {second} right", "McNemar p"):
        table.add_column(col, justify="right")
    for task, d in comparison.tasks.items():
        table.add_row(task, str(d.n), _pct(d.accuracy[0]), _pct(d.accuracy[1]), str(d.disagree),
                      str(d.only_first), str(d.only_second), f"{d.mcnemar_p:.3g}")
    console.print(table)
    for task, d in comparison.tasks.items():
        for diff in d.diffs[:show]:
            where = (f", first diverging token #{diff.diverge_at}: {diff.diverging_tokens[0]!r} vs "
                     f"{diff.diverging_tokens[1]!r}" if diff.diverging_tokens else "")
            console.print(f"  {task} doc {diff.doc_id}: {first} {diff.answers[0]!r} ({diff.correct[0]:g}) vs "
                          f"{second} {diff.answers[1]!r} ({diff.correct[1]:g}){where}", markup=False)
        if d.disagree > show:
            console.print(f"  {task}: {d.disagree - show} more differing items in --json")


@app.command("eval")
def eval_command(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    tasks: str = typer.Option("arc_easy", "--tasks", "-t", help="Comma-separated lm-eval task names."),
    scheme: str = typer.Option(None, "--scheme", "-s", help="Weight scheme (e.g. w4g32-asym, W8A16); native only."),
    method: str = typer.Option("rtn", "--method", help="Quantization method (rtn, gptq, ...)."),
    kv: str = typer.Option(None, "--kv", help="KV cache spec (quant.kvcache), e.g. k8tok-v8tok, fp8."),
    backend: str = typer.Option("native", "--backend", help="native or vllm."),
    limit: int = typer.Option(None, "--limit", "-L", help="First N documents per task."),
    fewshot: int = typer.Option(0, "--num-fewshot", "--num_fewshot", "-f", help="Few-shot examples per item."),
    floor: str = typer.Option(None, "--floor", help="0.99 = 99% of reference accuracy; abs:0.40 = absolute."),
    confidence: float = typer.Option(0.95, "--confidence"),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = DtypeOption,
    fidelity_windows: int = typer.Option(4, "--fidelity-windows", help="WikiText-2 windows for KL/PPL (0 = off)."),
    reference_model: str = typer.Option(None, "--reference", help="Unquantized model to compare a checkpoint with."),
    no_reference: bool = flag("--no-reference", help="Skip the unquantized reference run."),
    include_path: list[str] = typer.Option([], "--include-path", "--include_path", help="Extra lm-eval task folder(s)."),
    json_out: str = typer.Option(None, "--output-path", "--output_path", "-o", "--json", show_default=False,
                                 help="Write an lm-eval results file (quantspec's fields under `quantspec`) here."),
    data_dir: str = DataDirOption,
    smoothquant: float = typer.Option(None, "--smoothquant", metavar="ALPHA",
                                      help="SmoothQuant alpha before a W8A8 scheme (e.g. 0.5); native only."),
    compare: bool = flag("--compare-backends",
                         help="Score the configuration natively and through vLLM (same weights, dtype and "
                              "items) and list the items whose answers differ."),
):
    """Accuracy ± stderr, Δ vs the unquantized reference with a paired-bootstrap CI, flips, KL, PPL, verdict."""
    model = pick_model(model, model_option)
    config = EvalConfig(model=model, scheme=scheme, method=method, kv=kv, backend=backend, smoothquant=smoothquant,
                        tasks=tasks, limit=limit,
                        fewshot=fewshot, floor=floor, confidence=confidence, seed=seed, data_dir=data_dir,
                        include_path=tuple(include_path), dtype=dtype, reference=not no_reference, reference_model=reference_model,
                        fidelity_windows=fidelity_windows)
    result = compare_backends(config) if compare else evaluate(config)
    (print_comparison if compare else print_report)(result)
    if json_out:
        write_json_atomic(json_out, result.to_json())
        console.print(f"results: {json_out}")
