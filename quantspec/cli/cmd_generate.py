"""``quantspec generate`` (one answer with a speed line) and ``quantspec demo`` (the main job on the default model)."""
from __future__ import annotations

import typer

import quantspec
from quantspec.cli.app import (DeviceOption, DtypeOption, ModelArgument, ModelOption, app, compile_option, flag,
                               pick_model)
from quantspec.report import console, note, print_answer, print_decode_comparison, print_study, search_with_progress


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="User message (chat template applied for instruct models)."),
    model: str = ModelArgument,
    model_option: str = ModelOption,
    dtype: str = DtypeOption,
    device: str = DeviceOption,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="At most this many tokens (stops at the end "
                                                                      "of turn; HF generate's max_new_tokens)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="0 = off."),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(None),
    threads: int = typer.Option(None, help="torch threads (default: chosen by a short timed probe; shown)."),
    no_chat: bool = flag("--no-chat", help="Do not apply the chat template."),
    attention: str = typer.Option("sdpa", help="sdpa (fastest on short histories) or eager (batch-invariant: "
                                               "the text `accept` and `check-lossless` compare against in bf16)."),
    compile: str = compile_option("eager"),
):
    """Generate an answer with the native runtime and print a one-line speed summary."""
    print_answer(quantspec.generate(prompt, pick_model(model, model_option), dtype, max_new_tokens,
                                    quantspec.SamplingConfig(temperature, top_k, top_p, seed), threads,
                                    chat=False if no_chat else None, attention=attention,
                                    compile_mode=quantspec.resolve_compile(compile, device).mode, device=device))


@app.command()
def demo(
    output_len: int = typer.Option(64, "--output-len", help="Fixed output length of the decode comparison."),
    out: str = typer.Option("runs/demo-decode.json", "--output-path", "-o", "--json", help="Run record JSON."),
):
    """The main job on the default model: answer a question, native vs HF decode speed, then a small
    speed/quality search (studies/spaces/demo.yaml) and its Pareto table."""
    quantspec.require_optuna("quantspec demo")  # before the first part, not after it
    # fp32, beside the fp32 HF comparison
    print_answer(quantspec.generate("What is the capital of France?", dtype="fp32", max_new_tokens=32))
    record = quantspec.compare_decode("default", "fp32", new_tokens=output_len, repeats=1)
    print_decode_comparison(record)
    record.write(out)
    note(f"run record: {out}")
    console.rule("speed/quality search (studies/spaces/demo.yaml)")
    outcome = search_with_progress(*quantspec.demo_settings())
    demo_dir = quantspec.DEMO_DIR
    print_study(quantspec.summarize(outcome.study), demo_dir / "pareto.csv", demo_dir / "pareto.png",
                demo_dir / "pareto.json")
