"""docs/cli.md from the typer app: every command's flags, and the spellings of the tools users know beside ours.

    python -m quantspec.cli.reference            # rewrite docs/cli.md
    python -m quantspec.cli.reference --check    # exit 1 when docs/cli.md is stale (tests/test_cli_reference.py)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import typer.main

from quantspec.cli import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


@dataclass(frozen=True)
class Anchor:
    """A neighbour tool's spelling of a flag and the quantspec command that should accept it."""

    tool: str
    spelling: str  # as that tool writes it, e.g. "--num_fewshot"
    command: str
    ours: str  # quantspec's name for the same thing
    note: str = ""


ANCHORS = (
    Anchor("lm-eval", "--model_args pretrained=M", "eval", "--model, -m (or MODEL)", "lm-eval's --model is the engine: our --backend"),
    Anchor("lm-eval", "--model", "eval", "--backend", "hf|vllm there; --model is the model here (MODEL)"),
    Anchor("lm-eval", "--tasks", "eval", "--tasks"),
    Anchor("lm-eval", "-t", "eval", "--tasks"),
    Anchor("lm-eval", "--num_fewshot", "eval", "--num-fewshot"),
    Anchor("lm-eval", "-f", "eval", "--num-fewshot"),
    Anchor("lm-eval", "--limit", "eval", "--limit"),
    Anchor("lm-eval", "-L", "eval", "--limit"),
    Anchor("lm-eval", "--output_path", "eval", "--output-path"),
    Anchor("lm-eval", "-o", "eval", "--output-path"),
    Anchor("lm-eval", "--include_path", "eval", "--include-path"),
    Anchor("lm-eval", "--seed", "eval", "--seed"),
    Anchor("lm-eval", "--batch_size", "eval", "-", "native scores at batch 1 reusing the shared prefix's KV cache; "
                                                    "vLLM batches itself (auto)"),
    Anchor("lm-eval", "--device", "eval", "-", "eval runs on the CPU; --device is on generate and accept"),
    Anchor("vllm bench serve", "--model", "bench", "--model, -m (or MODEL)"),
    Anchor("vllm bench serve", "--backend", "bench", "--backend", "our engines: native, vllm"),
    Anchor("vllm bench serve", "--num-prompts", "bench", "--num-prompts, -n"),
    Anchor("vllm bench serve", "--request-rate", "bench", "--request-rate", "a comma list runs each rate"),
    Anchor("vllm bench serve", "--max-concurrency", "bench", "--max-concurrency", "closed loop here; a comma list runs each"),
    Anchor("vllm bench serve", "--burstiness", "bench", "--burstiness"),
    Anchor("vllm bench serve", "--goodput", "bench", "--goodput", "ttft:MS,tpot:MS (comma or quoted spaces); e2el not "
                                                                 "measured"),
    Anchor("vllm bench serve", "--dataset-name", "bench", "--dataset-name", "our datasets: spec_bench, mt_bench, "
                                                                            "short-short, ... or a .jsonl"),
    Anchor("vllm bench serve", "--random-output-len", "bench", "--output-len"),
    Anchor("vllm bench serve", "--ignore-eos", "bench", "--ignore-eos", "on by default here (fixed lengths)"),
    Anchor("vllm bench serve", "--temperature", "bench", "--temperature"),
    Anchor("vllm bench serve", "--save-result", "bench", "--save-result", "writes vllm bench serve's JSON schema"),
    Anchor("vllm bench serve", "--result-dir", "bench", "--result-dir"),
    Anchor("vllm bench serve", "--result-filename", "bench", "--result-filename"),
    Anchor("vllm serve", "--max-model-len", "bench", "--max-model-len"),
    Anchor("vllm serve", "--dtype", "bench", "-", "bench serves bf16; --dtype on generate, eval, accept, quantize"),
    Anchor("vllm serve", "--speculative-config", "bench", "--spec and --k", "num_speculative_tokens is --k"),
    Anchor("HF generate", "--max-new-tokens", "generate", "--max-new-tokens", "a cap (stops at the end of turn)"),
    Anchor("llm-compressor", "--output-dir", "quantize", "--output-dir"),
    Anchor("optuna", "--study-name", "search", "--study-name"),
    Anchor("optuna", "--storage", "search", "--storage"),
    Anchor("optuna", "--n-trials", "search", "--n-trials"),
    Anchor("optuna-dashboard", "--storage", "dashboard", "--storage"),
    Anchor("all of them", "--version", "", "--version"),
)


def commands() -> dict:
    """Every leaf command by its full name ("model fetch" for subcommands); "" is the top-level group."""
    root = typer.main.get_command(app)
    found = {"": root}

    def walk(group, prefix: str) -> None:
        for name, command in group.commands.items():
            full = f"{prefix}{name}"
            if hasattr(command, "commands"):
                walk(command, f"{full} ")
            else:
                found[full] = command

    walk(root, "")
    return found


def accepts(command, spelling: str, ours: str | None = None) -> bool:
    """Whether ``command`` parses the flag of ``spelling`` (its first word) as written, and, given ``ours``
    (quantspec's flag for the same thing), as that same option, not another one of the same spelling."""
    flag = spelling.split()[0]
    for p in command.params:
        opts = (*p.opts, *p.secondary_opts) if p.param_type_name == "option" else ()
        if flag in opts:
            return ours is None or ours.split(",")[0].split()[0] in opts
    return False


def render() -> str:
    found = commands()
    lines = ["# quantspec CLI reference", "",
             "Generated from the typer app by `python -m quantspec.cli.reference` (a test fails when it is stale).",
             "Where lm-eval, `vllm bench serve` or Optuna have a name for a flag, quantspec takes that spelling, as the",
             "name or beside it; the table at the end says which spellings work as written.", ""]
    for name, command in found.items():
        if not name:
            continue
        lines += [f"## `quantspec {name}`", "", (command.help or "").strip().split("\n\n")[0].replace("\n", " "), "",
                  "| flag | default | what it sets | the neighbours' spelling |", "| --- | --- | --- | --- |"]
        for p in command.params:
            if p.param_type_name == "argument":
                lines.append(f"| `{p.metavar or p.name.upper()}` (argument) | {_default(p)} | "
                             f"{_cell(getattr(p, 'help', ''))} | |")
                continue
            opts = (*p.opts, *p.secondary_opts)
            theirs = "; ".join(f"{a.tool} `{a.spelling}`" for a in ANCHORS
                               if a.command == name and a.ours != "-" and a.ours.split(",")[0].split()[0] in opts)
            lines.append(f"| {', '.join(f'`{o}`' for o in opts)} | {_default(p)} | {_cell(p.help)} | {theirs} |")
        lines.append("")
    lines += ["## The neighbours' spellings", "", "| tool | their flag | command | quantspec | works as written | note |",
              "| --- | --- | --- | --- | --- | --- |"]
    for a in ANCHORS:
        works = "yes" if a.ours != "-" and accepts(found[a.command], a.spelling, a.ours) else "no"
        lines.append(f"| {a.tool} | `{a.spelling}` | {a.command or '(any)'} | {a.ours} | {works} | {a.note} |")
    return "\n".join(lines) + "\n"


def _default(p: click.Parameter) -> str:
    if p.required:
        return "required"
    if p.default is None or p.default == () or p.default == []:
        return ""
    if getattr(p, "is_flag", False) and p.secondary_opts:
        return f"`{(p.opts if p.default else p.secondary_opts)[0]}`"
    return "" if p.default is False else f"`{p.default}`"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ").replace("\\[", "[")


def main(argv: list[str] | None = None) -> int:
    text = render()
    if "--check" in (sys.argv[1:] if argv is None else argv):
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m quantspec.cli.reference", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
