"""``quantspec generate`` and ``quantspec demo``."""
from __future__ import annotations

import typer
from rich.console import Console

import quantspec
from runtime.loading import DEFAULT_DTYPE
from quantspec.report import print_decode_comparison
from runtime.compiled import DEFAULT_MODE
from runtime.generate import Decoder, encode_prompt
from runtime.sampling import SamplingConfig
from runtime.hardware import hardware_line
from runtime.threads import apply_threads
from quantspec.cli.app import CompileOption, DeviceOption, DtypeOption, ModelArgument, ModelOption, app, flag, pick_model
from evals.decode_speed import compare_decode
from quantspec.cli.cmd_search import demo_search
from studies.defaults import require_optuna

console = Console()


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
    compile: bool = CompileOption,
):
    """Generate an answer with the native runtime and print a one-line speed summary."""
    answer(prompt, pick_model(model, model_option), dtype, max_new_tokens, SamplingConfig(temperature, top_k, top_p, seed), threads,
           chat=False if no_chat else None, attention=attention, compile_mode=DEFAULT_MODE if compile else None,
           device=device)


def answer(prompt: str, model: str = "default", dtype: str = DEFAULT_DTYPE, max_new_tokens: int = 128,
           sampling: SamplingConfig = SamplingConfig(), threads: int | None = None, chat: bool | None = None,
           attention: str = "sdpa", compile_mode: str | None = None, device: str = "cpu") -> None:
    """Print the native runtime's answer, then one speed line naming the precision, attention, the device, the
    decode step (eager or compiled), the kernels that ran and this machine's ISA (with any fallback)."""
    lm = quantspec.load(model, dtype, threads, attention, device)
    choice = apply_threads(lm.model, threads)
    ids = encode_prompt(lm.tokenizer, prompt, chat=chat)
    decoder = Decoder(lm, max_len=len(ids) + max_new_tokens + 1, compile_mode=compile_mode)
    result = decoder.generate(ids, max_new_tokens, sampling)
    step = "eager step" if decoder.step is None or decoder.step.fallback else f"compiled step ({compile_mode})"
    console.print(result.text)
    console.print(f"[dim]{result.summary()} | native {lm.precision} on {lm.device}, {attention} attention, {step}, "
                  f"{choice.line()}, {hardware_line(lm.model)}[/]")


@app.command()
def demo(
    output_len: int = typer.Option(64, "--output-len", help="Fixed output length of the decode comparison."),
    out: str = typer.Option("runs/demo-decode.json", "--output-path", "-o", "--json", help="Run record JSON."),
):
    """The main job on the default model: answer a question, native vs HF decode speed, then a small
    speed/quality search (studies/spaces/demo.yaml) and its Pareto table."""
    require_optuna("quantspec demo")  # before the first part, not after it
    answer("What is the capital of France?", dtype="fp32", max_new_tokens=32)  # beside the fp32 HF comparison
    record = compare_decode("default", "fp32", new_tokens=output_len, repeats=1)
    print_decode_comparison(record)
    record.write(out)
    console.print(f"run record: {out}")
    demo_search()
