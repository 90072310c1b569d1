"""``quantspec accept`` (acceptance and speed vs K) and ``quantspec check-lossless``."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from runtime.data import load_prompts
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime.errors import UserError
from runtime.loading import LoadedModel, load_model
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from runtime.generate import encode_prompt
from specdec.lossless import (ALPHA, AcceptanceTest, Chain, DistributionTest, FirstStepTest, JointTest, bonus_test,
                              first_step_test, greedy_mismatches, joint_test)
from specdec.proposers import Proposer, build_proposer
from runtime.sampling import SamplingConfig
from specdec.speculative import MAX_K, SpeculativeDecoder, check_k
from specdec.sweep import SweepResult, run_sweep
from specdec.theory import best_k
from quantspec.cli.app import DataDirOption, app

console = Console(width=max(Console().width, 120))

METRICS = {
    "alpha": "accepted draft tokens / drafted tokens (vLLM draft acceptance rate)",
    "beta": "accepted / tested draft tokens, tested = up to and including the first rejection (the per-token "
            "acceptance probability of Leviathan et al.; the predictions use it)",
    "tau": "1 + accepted / drafts, a draft = a verification step carrying >= 1 draft token (vLLM mean "
           "acceptance length, Spec-Bench)",
    "acceptance_per_pos": "drafts whose first i+1 tokens were accepted / drafts (vLLM per-position rate)",
    "tok_s": "decode tok/s = (new tokens - 1) / decode seconds, summed over requests, prefill excluded",
    "speedup": "speculative tok/s / plain-decoding tok/s, same target, prompts, sampling and length",
    "c": "proposer seconds per drafted token / plain decode seconds per token",
    "verify_cost": "target forward over K+1 tokens / one decode step (min of 7, after the first prompt)",
    "predicted_speedup": "Leviathan et al. Thm 3.8: (1-b^(K+1)) / ((1-b)(Kc+1)) with b = beta",
    "refined_speedup": "expected tokens per step over the measured mix of draft lengths / (drafted tokens per "
                       "step * c + measured verify cost of each length)",
}


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--k must be comma-separated integers like 1,2,4,8, got {text!r}") from None
    if not ks:
        raise UserError("--k needs at least one value, e.g. --k 1,2,4,8")
    return [check_k(k) for k in ks]


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


def prompt_ids(lm: LoadedModel, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(lm.tokenizer, text) for text in texts]


def model_condition(target: str, lm: LoadedModel) -> ModelCondition:
    return ModelCondition(target, weights_hash(lm.path), lm.precision,
                          note=SMOLLM2.note if is_default_model(lm.path) else "")


def sweep_record(target: str, lm: LoadedModel, proposer: str, sampling: SamplingConfig, source: str,
                 prompts: list[list[int]], max_new_tokens: int, sweep: SweepResult) -> RunRecord:
    lengths = [len(p) for p in prompts]
    emitted, ignore_eos = sweep.baseline["output_tokens"], sweep.ignore_eos
    output = {"fixed": max_new_tokens} if ignore_eos else {
        "max": max_new_tokens, "stop": "end of turn", "mean": sum(emitted) / len(emitted), "min": min(emitted)}
    return RunRecord(
        name="specdec-accept",
        model=model_condition(target, lm),
        hardware=hardware_info(lm.model),
        lengths=LengthDistribution(len(prompts), {"mean": sum(lengths) / len(lengths), "min": min(lengths),
                                                  "max": max(lengths)}, output, source, ignore_eos),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"dtype": lm.precision, "attention": lm.model.attn_implementation,
                                          "threads": torch.get_num_threads(),
                                          "proposer": proposer, "sampling": vars(sampling)},
                               warmup="one 8-token request per engine (plain and each K), excluded",
                               cache_warmth="KV caches reset per request; weights resident in RAM"),
        metric=MetricCondition(METRICS, "greedy rows: tokens compared with plain greedy decoding "
                                        "(greedy_equal = identical requests); " + (
                                            "ignore_eos, fixed output length" if ignore_eos else
                                            "stop at end of turn (same tokens for plain and greedy speculation)")),
        results={"proposer": proposer, "baseline": sweep.baseline, "rows": sweep.rows,
                 "verify_cost_curve": sweep.verify_cost, "best_k_measured": sweep.best_k,
                 "best_k_theory": best_k(sweep.rows[-1]["beta"], sweep.rows[-1]["c"],
                                         lambda k: sweep.verify_cost[min(k, len(sweep.verify_cost) - 1)],
                                         k_max=len(sweep.verify_cost) - 1)},
    )


def output_length(record: RunRecord) -> str:
    out = record.lengths.output_tokens
    return str(out["fixed"]) if "fixed" in out else f"{out['mean']:.0f} (to end of turn, <= {out['max']})"


def print_sweep(record: RunRecord) -> None:
    res = record.results
    base = res["baseline"]
    ref = base.get("reference")
    ref_title = f", plain with {ref['attention']} attention {ref['tok_s']:.1f}" if ref else ""
    table = Table(title=f"{res['proposer']} on {record.model.model_id} {record.model.precision}, "
                        f"T={record.engine.config['sampling']['temperature']}, {record.lengths.n_requests} prompts "
                        f"x {output_length(record)} tokens; plain {base['tok_s']:.1f} tok/s{ref_title}")
    cols = ["K", "α", "β", "τ", "acc. per pos.", "tok/s", "speedup", "Thm 3.8", "refined", "c", "V(K)"]
    greedy = "greedy_equal" in res["rows"][0]
    ended = "speedup_ended" in res["rows"][0]
    extra = (["=greedy"] if greedy else []) + ([f"vs {ref['attention']}"] if ref else []) + (
        [f"ended ({sum(base['ended'])})"] if ended else [])
    for col in cols + extra:
        table.add_column(col, justify="right")
    for r in res["rows"]:
        cells = [str(r["k"]), f"{r['alpha']:.2f}", f"{r['beta']:.2f}", f"{r['tau']:.2f}",
                 " ".join(f"{a:.2f}"[1:] for a in r["acceptance_per_pos"]), f"{r['tok_s']:.1f}",
                 f"{r['speedup']:.2f}", f"{r['predicted_speedup']:.2f}", f"{r['refined_speedup']:.2f}",
                 f"{r['c']:.3f}", f"{r['verify_cost']:.2f}"]
        if greedy:
            cells.append(f"{r['greedy_equal']}/{record.lengths.n_requests}")
        if ref:
            cells.append(f"{r['speedup_vs_reference']:.2f}")
        if ended:
            cells.append(f"{r['speedup_ended']:.2f}")
        table.add_row(*cells)
    console.print(table)
    console.print(f"recommended K: {res['best_k_measured']} (best measured speedup); theory with the largest K's "
                  f"β and c and the measured verify costs: K={res['best_k_theory']}")
    if record.model.note:
        console.print(f"[yellow]note:[/] {record.model.note}")


def plot_sweep(record: RunRecord, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record.results["rows"]
    ks = [r["k"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ks, [r["alpha"] for r in rows], "o-", label="α")
    ax1.plot(ks, [r["tau"] for r in rows], "s-", label="τ")
    ax1.set_xlabel("K")
    ax1.legend()
    ax1.set_title("acceptance")
    ax2.plot(ks, [r["speedup"] for r in rows], "o-", label="measured")
    ax2.plot(ks, [r["predicted_speedup"] for r in rows], "--", label="Thm 3.8")
    ax2.plot(ks, [r["refined_speedup"] for r in rows], ":", label="refined")
    ax2.axhline(1.0, color="grey", lw=0.5)
    ax2.set_xlabel("K")
    ax2.set_title("speedup over plain decoding")
    ax2.legend()
    fig.suptitle(f"{record.results['proposer']} on {record.model.model_id}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def measure_acceptance(lm: LoadedModel, target: str, proposer: Proposer, ks: list[int], texts: list[str],
                       source: str, max_new_tokens: int, sampling: SamplingConfig,
                       reference: LoadedModel | None = None, ignore_eos: bool = True) -> RunRecord:
    """Python API behind ``quantspec accept``: a RunRecord with one row per K (``reference``, ``ignore_eos``:
    see run_sweep)."""
    prompts = prompt_ids(lm, texts)
    with progress_bar() as bar:
        task = bar.add_task("plain", total=len(prompts) * (len(ks) + 1 + (reference is not None)))
        sweep = run_sweep(lm, proposer, ks, prompts, max_new_tokens, sampling,
                          lambda what: bar.update(task, advance=1, description=what), reference, ignore_eos)
    return sweep_record(target, lm, proposer.label, sampling, source, prompts, max_new_tokens, sweep)


@app.command()
def accept(
    target: str = typer.Option("default", "--target", "-m", help="Target model: `default` or a local HF dir."),
    draft: str = typer.Option(..., "--draft", help="Proposer: ngram:min=2,max=4 | draft:PATH[@SCHEME] | "
                                                   "layerskip:L | selfquant:SCHEME."),
    k: str = typer.Option("1,2,4,8", "--k", help="Draft lengths to sweep, comma-separated (1..32)."),
    prompts: str = typer.Option("spec_bench", help="spec_bench | mt_bench | PATH.jsonl"),
    limit: int = typer.Option(8, help="Number of prompts."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Fixed output length (ignore_eos)."),
    natural_eos: bool = typer.Option(False, "--natural-eos", help="Stop at the end of turn instead (at most -n)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("bf16", help="fp32 or bf16 (target and draft)."),
    threads: int = typer.Option(None),
    json_out: str = typer.Option(None, "--json", help="Write the RunRecord here."),
    plot: str = typer.Option(None, "--plot", help="Write a PNG of α and speedup vs K."),
    data_dir: str = DataDirOption,
):
    """Acceptance (α, τ, per position) and speedup vs K, beside Leviathan's prediction."""
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    ks = parse_ks(k)
    texts = load_prompts(prompts, data_dir, limit)
    lm = load_model(target, dtype, threads, "eager")
    record = measure_acceptance(lm, target, build_proposer(draft, lm), ks, texts, prompts, max_new_tokens, sampling,
                                ignore_eos=not natural_eos)
    print_sweep(record)
    if json_out:
        console.print(f"run record: {record.write(json_out)}")
    if plot:
        plot_sweep(record, plot)
        console.print(f"plot: {plot}")


def distribution_detail(t: DistributionTest) -> str:
    detect = (f"detectable TV {t.detectable_tv:.3f} at power {t.power:g}" if t.detectable_tv < 1 else
              "detects no TV at this sample count (raise --samples or set --top-k)")
    return (f"TV {t.tv:.3f} vs threshold {t.tv_threshold:.3f} (exact sampler E[TV] <= {t.tv_bound:.3f}); {detect}; "
            f"chi2 p={t.p_value:.3g} (info)")


def acceptance_detail(a: AcceptanceTest) -> str:
    return (f"{a.rate:.3f} vs Σmin(p,q) = {a.expected:.3f} over {a.rounds} rounds, region "
            f"[{a.region[0] / a.rounds:.3f}, {a.region[1] / a.rounds:.3f}]; detectable shift {a.detectable_shift:.3f}")


def lossless_rows(model_tests: list[FirstStepTest], joint: JointTest, bonus: DistributionTest, samples: int,
                  temperature: float) -> list[tuple[str, bool | None, str]]:
    """(check, passed or None for information, detail): one fact per row."""
    rows = []
    for i, t in enumerate(model_tests):
        rows.append((f"prefix {i}: first token ({samples} samples, T={temperature})", t.distribution.passed,
                     distribution_detail(t.distribution)))
        rows.append((f"prefix {i}: first-position acceptance", None, "no draft after this prefix") if t.acceptance is None
                    else (f"prefix {i}: first-position acceptance", t.acceptance.passed, acceptance_detail(t.acceptance)))
    rows.append((f"synthetic V={SYNTHETIC_VOCAB}: first 3 tokens jointly (K=2)", joint.distribution.passed,
                 distribution_detail(joint.distribution)))
    rows.append((f"synthetic V={SYNTHETIC_VOCAB}: first-position acceptance", joint.acceptance.passed,
                 acceptance_detail(joint.acceptance)))
    rows.append((f"synthetic V={SYNTHETIC_VOCAB}: bonus token after K=2 accepted", bonus.passed,
                 f"{bonus.samples} bonus tokens; " + distribution_detail(bonus)))
    return rows


SYNTHETIC_VOCAB = 6


@app.command("check-lossless")
def check_lossless(
    target: str = typer.Option("default", "--target", "-m"),
    draft: str = typer.Option(..., "--draft", help="Proposer spec, as for `accept`."),
    k: int = typer.Option(4, "--k"),
    prompts: str = typer.Option("spec_bench"),
    limit: int = typer.Option(4, help="Prompts for the greedy equality check."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", "-n"),
    samples: int = typer.Option(400, help="Independent first-step samples per prefix for the distribution test."),
    prefixes: int = typer.Option(2, help="Prefixes (the first prompts) for the distribution test."),
    synthetic_samples: int = typer.Option(20000, help="Generations of the synthetic-vocabulary test (known p, q)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature of the distribution test."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("fp32"),
    threads: int = typer.Option(None, help="torch threads (1 is fastest on a busy 2-core machine)."),
    alpha: float = typer.Option(ALPHA, help="False-alarm bound of each distribution and acceptance test."),
    json_out: str = typer.Option(None, "--json"),
    data_dir: str = DataDirOption,
):
    """Greedy token equality with plain decoding; sampled first steps (TV beyond the exact-sampler noise, first-
    position acceptance vs Σ min(p, q)) and a synthetic joint/bonus test, each with its detectable effect at
    power 0.999 printed; exit 1 on failure."""
    if not 0 < alpha < 1:
        raise UserError(f"--alpha must be in (0, 1), got {alpha}")
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    check_k(k)
    lm = load_model(target, dtype, threads, "eager")
    ids = prompt_ids(lm, load_prompts(prompts, data_dir, max(limit, prefixes)))
    max_len = max(len(p) for p in ids) + max_new_tokens + MAX_K + 1
    spec = SpeculativeDecoder(lm, draft, k, SamplingConfig(), max_len)
    with progress_bar() as bar:
        task = bar.add_task("greedy equality", total=limit + prefixes * samples)
        tick = lambda: bar.update(task, advance=1)  # noqa: E731
        mismatches = greedy_mismatches(spec, ids[:limit], max_new_tokens, tick)
        bar.update(task, description="first-step distribution")
        spec.sampling = sampling
        model_tests = [first_step_test(spec, p, samples, tick, alpha) for p in ids[:prefixes]]
    chain = Chain.random(SYNTHETIC_VOCAB, seed)
    joint = joint_test(chain, k=2, length=3, n=synthetic_samples, seed=seed, alpha=alpha)
    bonus = bonus_test(chain, k=2, n=synthetic_samples, seed=seed, alpha=alpha)
    table = Table(title=f"check-lossless {spec.proposer.label}, K={k}, {lm.precision}, false alarm <= {alpha:g} per test")
    for col in ("check", "result", "detail"):
        table.add_column(col)
    table.add_row("greedy == plain greedy", "FAIL" if mismatches else "ok",
                  f"{limit - len(mismatches)}/{limit} prompts token-exact over {max_new_tokens} tokens"
                  + (f"; first: {mismatches[0]}" if mismatches else ""))
    rows = lossless_rows(model_tests, joint, bonus, samples, temperature)
    for name, passed, detail in rows:
        table.add_row(name, "info" if passed is None else "ok" if passed else "FAIL", detail)
    console.print(table)
    failed = bool(mismatches) or any(passed is False for _, passed, _ in rows)
    if json_out:
        RunRecord(
            name="specdec-check-lossless", model=model_condition(target, lm), hardware=hardware_info(lm.model),
            lengths=LengthDistribution(limit, {"prompts": [len(p) for p in ids]}, {"fixed": max_new_tokens}, prompts, True),
            arrival=ArrivalProcess("batch-1 sequential", 1),
            engine=EngineCondition("native", {"dtype": lm.precision, "attention": lm.model.attn_implementation,
                                              "proposer": spec.proposer.label, "k": k,
                                              "sampling": vars(sampling)}),
            metric=MetricCondition({"tv": "0.5 * sum |empirical - target p|; fails above tv_threshold = "
                                          "tv_bound + sqrt(ln(1/alpha)/(2n)) (McDiarmid)",
                                    "detectable_tv": "true TV failed with probability >= power",
                                    "acceptance": "first draft token accepted / rounds vs Σ min(p, q); fails "
                                                  "outside the exact binomial region at level alpha",
                                    "p_value": "scipy chisquare, bins with < 5 expected samples merged (info)"},
                                   f"greedy token-exact; every TV and acceptance test passes at alpha={alpha:g}"),
            results={"passed": not failed, "greedy_mismatches": mismatches,
                     "first_step": [t.to_dict() for t in model_tests],
                     "synthetic": {"vocab": SYNTHETIC_VOCAB, "joint": joint.to_dict(), "bonus": bonus.to_dict()}},
        ).write(json_out)
    if failed:
        console.print("[red]lossless check FAILED[/]")
        sys.exit(1)
    console.print("[green]lossless check passed[/]")
