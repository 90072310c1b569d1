"""Named workloads: which prompts, how long, how long the answers (a registry; a JSONL path also works).

Real prompts come from Spec-Bench / MT-Bench (via ``runtime.data.load_prompts``) or a JSONL file. The three
shapes short→short, long→short and short→long cut real prompt text to a target token count (so n-gram
proposers see natural text, not random ids); ``mix`` interleaves them. Every prompt goes through the chat
template of instruct models (``runtime.generate.encode_prompt``).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from serving.requests import Request
from runtime.data import find_data_dir, load_prompts
from runtime.errors import UserError
from runtime.registry import Registry
from runtime.generate import encode_prompt

FALLBACK_TEXT = (  # used for synthetic shapes when no data dir is configured
    "The history of computing is a story of abstraction: from relays to transistors, from machine code to "
    "compilers, from single machines to networks. Each layer hides the one below it and lets people build "
    "larger systems. Explain how caches, pipelines and parallelism changed what programs can do. "
)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    build: Callable[["WorkloadArgs"], list[tuple[str, int]]]  # -> [(user message, max new tokens)]
    default_output_len: int


@dataclass(frozen=True)
class WorkloadArgs:
    tokenizer: object
    num_prompts: int
    output_len: int | None
    data_dir: str | Path | None
    seed: int
    max_total_tokens: int | None = None  # real prompts whose tokens + output exceed it are skipped


WORKLOADS: Registry[WorkloadSpec] = Registry("workload")


def register_workload(name: str, description: str, default_output_len: int):
    def deco(fn):
        WORKLOADS.add(name, WorkloadSpec(name, description, fn, default_output_len))
        return fn

    return deco


def _output_len(args: WorkloadArgs, name: str) -> int:
    return args.output_len or WORKLOADS.get(name).default_output_len


def _real_prompts(source: str, args: WorkloadArgs, n_out: int) -> list[str]:
    """The first ``num_prompts`` of the shuffled prompts (cycled when fewer), those that fit ``max_total_tokens``
    with ``n_out`` new tokens where it is set (as vLLM's ShareGPT sampling skips sequences too long)."""
    prompts = load_prompts(source, args.data_dir)
    random.Random(args.seed).shuffle(prompts)
    if args.max_total_tokens is not None:
        fits = (p for p in prompts if len(encode_prompt(args.tokenizer, p)) + n_out <= args.max_total_tokens)
        prompts = list(itertools.islice(fits, args.num_prompts))
        if not prompts:
            raise UserError(f"no {source} prompt fits {args.max_total_tokens} positions with {n_out} new tokens: "
                            "raise the position bound or lower the output length")
    return [prompts[i % len(prompts)] for i in range(args.num_prompts)]


@register_workload("spec_bench", "Spec-Bench questions (first turn), fixed output length", 128)
def _spec_bench(args: WorkloadArgs):
    n_out = _output_len(args, "spec_bench")
    return [(p, n_out) for p in _real_prompts("spec_bench", args, n_out)]


@register_workload("mt_bench", "MT-Bench questions (first turn), fixed output length", 128)
def _mt_bench(args: WorkloadArgs):
    n_out = _output_len(args, "mt_bench")
    return [(p, n_out) for p in _real_prompts("mt_bench", args, n_out)]


POOL_CHARS = 40_000  # enough real text for many distinct 512-token cuts, cheap to tokenize


def _text_pool(args: WorkloadArgs) -> str:
    data = find_data_dir(args.data_dir, required=False)
    if data is None:
        return (FALLBACK_TEXT * (POOL_CHARS // len(FALLBACK_TEXT) + 1))[:POOL_CHARS]
    prompts = load_prompts("spec_bench", data)
    random.Random(args.seed).shuffle(prompts)
    return "\n".join(prompts)[:POOL_CHARS]


def _cut(tokenizer, pool_ids: list[int], start: int, n_tokens: int) -> str:
    start %= max(1, len(pool_ids) - n_tokens)
    return tokenizer.decode(pool_ids[start:start + n_tokens], skip_special_tokens=True)


def _shaped(args: WorkloadArgs, shapes: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """Cut real text to ``input`` tokens for each (input, output) shape, cycling through ``shapes``."""
    pool_ids = args.tokenizer.encode(_text_pool(args), add_special_tokens=False)
    rng = random.Random(args.seed)
    out = []
    for i in range(args.num_prompts):
        n_in, n_out = shapes[i % len(shapes)]
        out.append((_cut(args.tokenizer, pool_ids, rng.randrange(len(pool_ids)), n_in), args.output_len or n_out))
    return out


SHAPES = {"short-short": (32, 32), "long-short": (512, 32), "short-long": (32, 256)}
for _name, (_in, _out) in SHAPES.items():
    register_workload(_name, f"~{_in} prompt tokens -> {_out} output tokens (real text cut to length)", _out)(
        lambda args, shape=(_in, _out): _shaped(args, [shape]))
register_workload("mix", "short-short, long-short and short-long interleaved", 32)(
    lambda args: _shaped(args, list(SHAPES.values())))


def build_requests(workload: str, tokenizer, num_prompts: int = 16, output_len: int | None = None,
                   ignore_eos: bool = True, data_dir: str | Path | None = None, seed: int = 0,
                   max_total_tokens: int | None = None) -> tuple[list[Request], str]:
    """Requests for a named workload or a JSONL path, plus a description of their source for the record.
    ``max_total_tokens``: only prompts whose tokens plus output fit (real prompts that do not are skipped)."""
    if num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise UserError(f"--output-len must be >= 1, got {output_len}")
    args = WorkloadArgs(tokenizer, num_prompts, output_len, data_dir, seed, max_total_tokens)
    if workload in WORKLOADS:
        pairs, source = WORKLOADS.get(workload).build(args), f"{workload}: {WORKLOADS.get(workload).description}"
    elif workload.endswith(".jsonl") and Path(workload).exists():
        n_out = output_len or 128
        pairs, source = [(p, n_out) for p in _real_prompts(workload, args, n_out)], f"JSONL {workload}"
    else:
        raise UserError(f"unknown workload {workload!r}: use one of {', '.join(WORKLOADS)} or an existing .jsonl path")
    requests = [Request(i, encode_prompt(tokenizer, text), n_out, ignore_eos) for i, (text, n_out) in enumerate(pairs)]
    if max_total_tokens is not None:
        if any(len(r.prompt_ids) + r.max_tokens > max_total_tokens for r in requests):
            raise UserError(f"workload {workload!r} has requests longer than {max_total_tokens} positions (prompt + "
                            "output): raise the position bound or use a workload of real prompts")
        source += f"; prompt + output <= {max_total_tokens} tokens"
    return requests, source
