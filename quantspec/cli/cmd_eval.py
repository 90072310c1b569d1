"""``quantspec eval``: task accuracy (lm-eval), Δ vs the unquantized reference, flips, KL, PPL, verdict."""
from __future__ import annotations

import typer

import quantspec
from quantspec import Config, EvalConfig
from quantspec.cli.app import (ROTATE_HELP, SCHEME_HELP, DataDirOption, DtypeOption, ModelArgument, ModelOption,
                               app, flag, pick_model)
from quantspec.report import note, print_backend_comparison, print_eval_report


@app.command("eval")
def eval_command(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    tasks: str = typer.Option("arc_easy", "--tasks", "-t", help="Comma-separated lm-eval task names."),
    scheme: str = typer.Option(None, "--scheme", "-s", help=SCHEME_HELP),
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
    rotate: str = typer.Option("none", "--rotate", help=ROTATE_HELP),
    compare: bool = flag("--compare-backends",
                         help="Score the configuration natively and through vLLM (same weights, dtype and "
                              "items) and list the items whose answers differ."),
):
    """Accuracy ± stderr, Δ vs the unquantized reference with a paired-bootstrap CI, flips, KL, PPL, verdict."""
    model = pick_model(model, model_option)
    point = Config.parse(model=model, scheme=scheme, method=method, kv=kv, backend=backend, smoothquant=smoothquant,
                         rotate=rotate, dtype=dtype)
    config = EvalConfig(point, tasks=tasks, limit=limit, fewshot=fewshot, floor=floor, confidence=confidence,
                        seed=seed, data_dir=data_dir, include_path=tuple(include_path), reference=not no_reference,
                        reference_model=reference_model, fidelity_windows=fidelity_windows)
    result = quantspec.compare_backends(config) if compare else quantspec.evaluate(config)
    (print_backend_comparison if compare else print_eval_report)(result)
    if json_out:
        quantspec.write_json(json_out, result.to_json())
        note(f"results: {json_out}")
