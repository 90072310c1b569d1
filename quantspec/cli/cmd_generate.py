"""``quantspec generate`` and ``quantspec demo``."""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from runtime.loading import load_model
from runtime.generate import Decoder, encode_prompt
from runtime.sampling import SamplingConfig
from runtime.hardware import hardware_line
from quantspec.cli.app import app
from evals.decode_speed import compare_decode
from quantspec.cli.cmd_search import demo_search

console = Console()


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="User message (chat template applied for instruct models)."),
    model: str = typer.Option("default", "--model", "-m", help="`default`, a local HF dir, or a hub id."),
    dtype: str = typer.Option("fp32", help="fp32 or bf16."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0, help="0 = off."),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(None),
    threads: int = typer.Option(None, help="torch threads (default: torch's choice)."),
    no_chat: bool = typer.Option(False, "--no-chat", help="Do not apply the chat template."),
    attention: str = typer.Option("sdpa", help="sdpa (fastest on short histories) or eager (batch-invariant: "
                                               "the text `accept` and `check-lossless` compare against in bf16)."),
):
    """Generate an answer with the native runtime and print a one-line speed summary."""
    answer(prompt, model, dtype, max_new_tokens, SamplingConfig(temperature, top_k, top_p, seed), threads,
           chat=False if no_chat else None, attention=attention)


def answer(prompt: str, model: str = "default", dtype: str = "fp32", max_new_tokens: int = 128,
           sampling: SamplingConfig = SamplingConfig(), threads: int | None = None, chat: bool | None = None,
           attention: str = "sdpa") -> None:
    """Print the native runtime's answer, then one speed line naming the precision, attention, the kernels
    that ran and this machine's ISA (with any fallback)."""
    lm = load_model(model, dtype, threads, attention)
    ids = encode_prompt(lm.tokenizer, prompt, chat=chat)
    result = Decoder(lm, max_len=len(ids) + max_new_tokens + 1).generate(ids, max_new_tokens, sampling)
    console.print(result.text)
    console.print(f"[dim]{result.summary()} | native {lm.precision}, {attention} attention, "
                  f"{hardware_line(lm.model)}[/]")


def print_decode_comparison(record) -> None:
    res = record.results
    table = Table(title=f"batch-1 greedy decode, {record.model.model_id} {record.model.precision}, "
                        f"{record.lengths.output_tokens['fixed']} new tokens (ignore_eos)")
    for col in ("engine", "decode tok/s", "prefill ms", "% of roofline"):
        table.add_column(col, justify="right")
    for row in res["rows"]:
        table.add_row(row["engine"], f"{row['decode_tok_s']:.1f}", f"{row['prefill_ms']:.0f}", f"{row['roofline_pct']:.0f}%")
    console.print(table)
    console.print(f"bandwidth {res['bandwidth_gb_s']:.1f} GB/s, {res['bytes_per_token'] / 2**20:.0f} MiB/token -> "
                  f"roofline {res['roofline_tok_s']:.1f} tok/s")
    if "native_over_hf" in res:
        console.print(f"native / HF = [bold]{res['native_over_hf']:.2f}x[/], greedy tokens equal: {res['greedy_tokens_equal']}")
    if record.model.note:
        console.print(f"[yellow]note:[/] {record.model.note}")


@app.command()
def demo(
    new_tokens: int = typer.Option(64, help="Fixed output length of the decode comparison."),
    out: str = typer.Option("runs/demo-decode.json", help="Run record JSON."),
):
    """The main job on the default model: answer a question, native vs HF decode speed, then a small
    speed/quality search (studies/spaces/demo.yaml) and its Pareto table."""
    answer("What is the capital of France?", max_new_tokens=32)
    record = compare_decode("default", "fp32", new_tokens=new_tokens, repeats=2)
    print_decode_comparison(record)
    record.write(out)
    console.print(f"run record: {out}")
    demo_search()
