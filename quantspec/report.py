"""Rich tables and plots of the API's results, shared by the CLI and the bench/ scripts."""
from __future__ import annotations

import math
import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from evals.config import DEFAULT_BACKEND
from evals.floor import Floor, how_to_decide
from evals.record import RunRecord
from runtime.errors import UserError
from runtime.measure import BOOTSTRAP_RESAMPLES, CONFIDENCE, load_line, with_ci
from evals.quant_report import FIDELITY_PROMPTS
from runtime.hardware import hardware_line
from runtime.model_store import DEFAULT_MODEL, SMOLLM2, caveat_applies



def _make_console() -> Console:
    """The one console of every table, note and bar: the terminal's width, or $COLUMNS (default 200) when output
    goes to a file or a pipe, so tables do not wrap their labels in logs."""
    return Console() if Console().is_terminal else Console(width=int(os.environ.get("COLUMNS", 200)))


console = _make_console()
_verbosity = 0  # -1 quiet (tables and errors only), 0 normal, 1 verbose (libraries' own logs and bars too)


def set_verbosity(level: int) -> None:
    """``quantspec -q`` (-1) / default (0) / ``-v`` (1)."""
    global _verbosity
    _verbosity = level


def verbosity() -> int:
    return _verbosity


def note(text: str) -> None:
    """A line beside the results (where a file went, caveats, conditions): not printed under ``-q``."""
    if _verbosity >= 0:
        console.print(text)


def progress(*columns, transient: bool = True) -> Progress:
    """A rich progress bar on the console (description, bar, n/total, elapsed, then ``columns``); off under ``-q``."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), *columns,
                    console=console, transient=transient, disable=_verbosity < 0)


def output_length(record: RunRecord) -> str:
    out = record.lengths.output_tokens
    return str(out["fixed"]) if "fixed" in out else f"{out['mean']:.0f} (to end of turn, <= {out['max']})"


def step_line(engine: dict) -> str:
    """The decode step a record ran and its one-time compile cost (``runtime.compiled``), for table titles."""
    step = engine.get("step") or "eager"
    return f"{step} step, compiled in {engine['compile_s']:.0f} s (one-time)" if engine.get("compile_s") else \
        f"{step} step"


def print_sweep(record: RunRecord) -> None:
    res = record.results
    base = res["baseline"]
    ref = base.get("reference")
    ref_title = f", plain with {ref['attention']} attention {ref['tok_s']:.1f}" if ref else ""
    table = Table(title=f"{res['proposer']} on {record.model.model_id} {record.model.precision}, "
                        f"T={record.engine.config['sampling']['temperature']}, {record.lengths.n_requests} prompts "
                        f"x {output_length(record)} tokens; plain {base['tok_s']:.1f} tok/s{ref_title}; "
                        f"{step_line(record.engine.config)}")
    cols = ["K", "α", "β", "τ", "acc. per pos.", "tok/s", "speedup [95% CI]", "Thm 3.8", "refined", "c", "V(K)"]
    greedy = "greedy_equal" in res["rows"][0]
    ended = "speedup_ended" in res["rows"][0]
    extra = (["=greedy"] if greedy else []) + ([f"vs {ref['attention']}"] if ref else []) + (
        [f"ended ({sum(base['ended'])})"] if ended else [])
    for col in cols + extra:
        table.add_column(col, justify="right")
    for r in res["rows"]:
        cells = [str(r["k"]), f"{r['alpha']:.2f}", f"{r['beta']:.2f}", f"{r['tau']:.2f}",
                 " ".join(f"{a:.2f}"[1:] for a in r["acceptance_per_pos"]), f"{r['tok_s']:.1f}",
                 with_ci(r["speedup"], r.get("speedup_ci")), f"{r['predicted_speedup']:.2f}",
                 f"{r['refined_speedup']:.2f}",
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
    print_caveat(record)


THEORY_LABEL = ("theory: (1-β^(K+1)) / ((1-β)(K·c+1)), Leviathan et al. Thm 3.8\n"
                "(assumes verifying K+1 tokens costs 1 decode step;\nc = draft time / decode time per token)")
REFINED_LABEL = ("theory with the measured verify cost V(K) (target forward over K+1 tokens)\n"
                 "and the measured mix of draft lengths 0..K")


def _finite_ci(ci) -> tuple[float, float] | None:
    return tuple(ci) if ci and all(map(math.isfinite, ci)) else None


def acceptance_cis(row: dict, seed: int = 0) -> dict[str, tuple[float, float]] | None:
    """Bootstrap 95% CIs over prompts of the row's pooled α (accepted / drafted) and τ (1 + accepted / drafts),
    resampling prompts as the speedup's CI does, from per-prompt counts; None when the record's per-request
    entries hold no counts (only per-prompt rates, which cannot be pooled) or there are fewer than 3 prompts."""
    import numpy as np

    per = row.get("per_request") or []
    if len(per) < 3 or not all({"accepted", "draft_tokens", "drafts"} <= p.keys() for p in per):
        return None
    accepted, drafted, drafts = (np.array([p[key] for p in per], float)
                                 for key in ("accepted", "draft_tokens", "drafts"))
    idx = np.random.default_rng(seed).integers(0, len(per), size=(BOOTSTRAP_RESAMPLES, len(per)))
    acc = accepted[idx].sum(-1)
    q = [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2]
    alpha = np.quantile(acc / np.maximum(drafted[idx].sum(-1), 1), q)
    tau = np.quantile(1 + acc / np.maximum(drafts[idx].sum(-1), 1), q)
    return {"alpha": (float(alpha[0]), float(alpha[1])), "tau": (float(tau[0]), float(tau[1]))}


def _yerr(values: list[float], cis: list) -> list[list[float]]:
    """Error-bar lengths below/above each value (0 where there is no CI; a percentile interval that misses its
    point estimate, which a skewed bootstrap can, draws no bar on that side)."""
    return [[max(v - ci[0], 0.0) if ci else 0.0 for v, ci in zip(values, cis)],
            [max(ci[1] - v, 0.0) if ci else 0.0 for v, ci in zip(values, cis)]]


def sweep_title(record: RunRecord) -> str:
    """Two lines: what ran (proposer, model, precision) and under which conditions (prompts, output length,
    sampling, hardware)."""
    res, hw, cfg = record.results, record.hardware or {}, record.engine.config
    temperature = (cfg.get("sampling") or {}).get("temperature", 0.0)
    threads = cfg.get("threads") or hw.get("torch_threads")
    device = f"GPU {hw['gpu']}" if "cuda" in hw else f"CPU {hw.get('cpu', '?')} ({hw.get('isa', '?')})"
    model = record.model.model_id + (f" ({SMOLLM2.name})" if record.model.model_id == DEFAULT_MODEL else "")
    return (f"{res['proposer']} drafting for {model}, {record.model.precision}: α, τ and speedup vs K\n"
            f"{record.lengths.n_requests} prompts ({record.lengths.source}) × {output_length(record)} new tokens, "
            f"{'greedy' if not temperature else f'T={temperature:g}'}, batch 1; {device}"
            + (f", {threads} threads" if threads else ""))


def figure_sweep(record: RunRecord):
    """The ``accept`` sweep as a matplotlib Figure with three panels sharing the K axis: α (a probability), τ
    (tokens per verification step) and the speedup over plain decoding beside the two predictions. Error bars:
    bootstrap 95% CIs over prompts where the record has them; a legend line says where it has none."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    rows = record.results["rows"]
    ks = [r["k"] for r in rows]
    n_prompts = record.lengths.n_requests
    fig = Figure(figsize=(15, 5.4), dpi=100, layout="constrained")
    ax_alpha, ax_tau, ax_speed = fig.subplots(1, 3)
    acc_cis = [acceptance_cis(r) for r in rows]
    have_acc_ci = all(acc_cis)
    why_no_ci = (f"no 95% CI: {n_prompts} prompt(s), a CI needs >= 3" if n_prompts < 3 else
                 "no 95% CI: the record keeps per-prompt rates,\nnot the counts a CI of the pooled rate needs")
    per_prompt = all(r.get("per_request") for r in rows)

    for ax, key, label in ((ax_alpha, "alpha", "α: accepted / drafted tokens (pooled over prompts)"),
                           (ax_tau, "tau", "τ: 1 + accepted / drafts (pooled over prompts;\n1 = no draft token accepted, K+1 = all)")):
        values = [r[key] for r in rows]
        if per_prompt:
            xs = [r["k"] for r in rows for _ in r["per_request"]]
            ax.plot(xs, [p[key] for r in rows for p in r["per_request"]], ".", c="grey", alpha=0.5, ms=5,
                    label="single prompts (one without drafts: α 0, τ 1)")
        if have_acc_ci:
            ax.errorbar(ks, values, yerr=_yerr(values, [c[key] for c in acc_cis]), fmt="o-", c="tab:blue",
                        capsize=4, label=label + "\nbars: 95% CI, bootstrap over prompts")
        else:
            ax.plot(ks, values, "o-", c="tab:blue", label=label)
            ax.plot([], [], " ", label=why_no_ci)
    ax_alpha.plot(ks, [r["beta"] for r in rows], "s--", c="tab:green", ms=5,
                  label="β: accepted / tested tokens (per-token acceptance;\nthe α of Leviathan et al., used by the theory)")
    ax_alpha.set_ylim(0, 1.05)
    ax_alpha.set_ylabel("acceptance rate α (probability, 0-1)")
    ax_alpha.set_title("how often draft tokens are accepted", fontsize=10)
    ax_tau.set_ylabel("τ (tokens per verification step)")
    ax_tau.set_title("tokens gained per target forward", fontsize=10)

    speedups = [r["speedup"] for r in rows]
    speed_cis = [_finite_ci(r.get("speedup_ci")) for r in rows]
    if all(speed_cis):
        ax_speed.errorbar(ks, speedups, yerr=_yerr(speedups, speed_cis), fmt="o-", c="tab:blue", capsize=4,
                          label="measured: speculative / plain decode tok/s\nbars: 95% CI, bootstrap over prompts")
    else:
        ax_speed.plot(ks, speedups, "o-", c="tab:blue", label="measured: speculative / plain decode tok/s")
        ax_speed.plot([], [], " ", label=why_no_ci if n_prompts < 3 else "no 95% CI in the record")
    ax_speed.plot(ks, [r["predicted_speedup"] for r in rows], "^--", c="tab:orange", ms=5, label=THEORY_LABEL)
    ax_speed.plot(ks, [r["refined_speedup"] for r in rows], "v:", c="tab:red", ms=5, label=REFINED_LABEL)
    ax_speed.axhline(1.0, color="black", lw=0.8, ls="-.", label="1.0: no speedup")
    ax_speed.set_ylabel("speedup (× plain decoding tok/s)")
    ax_speed.set_title(f"speedup over plain decoding ({record.results['baseline']['tok_s']:.1f} tok/s)", fontsize=10)

    log2 = len(ks) > 1 and all(k > 0 and k & (k - 1) == 0 for k in ks)
    for ax in (ax_alpha, ax_tau, ax_speed):
        if log2:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("K (draft tokens per verification step)" + (", log2 scale" if log2 else ""))
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        order = sorted(range(len(labels)), key=lambda i: not labels[i].startswith(("α", "τ", "measured")))
        ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=7.5, loc="upper center",
                  bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.suptitle(sweep_title(record), fontsize=11)
    return fig


def plot_sweep(record: RunRecord, path: str) -> Path:
    """``figure_sweep`` saved as a PNG at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure_sweep(record).savefig(path)
    return path


def print_caveat(record: RunRecord) -> None:
    """The default model's Q4_1 note, where the record holds 4-bit results (it is in every record regardless)."""
    if caveat_applies(record.to_dict()):
        note(f"[yellow]note:[/] {record.model.note}")


def print_decode_comparison(record) -> None:
    res = record.results
    table = Table(title=f"batch-1 greedy decode, {record.model.model_id} {record.model.precision}, "
                        f"{record.lengths.output_tokens['fixed']} new tokens (ignore_eos)")
    for col in ("engine", "decode tok/s [95% CI]", "prefill ms", "% of roofline"):
        table.add_column(col, justify="right")
    for row in res["rows"]:
        ci = row.get("decode_tok_s_ci")
        rounds = f" (n={row['rounds']})" if ci else ""
        step = f" ({row['step']} step)" if row.get("step") else ""
        table.add_row(row["engine"] + step, with_ci(row["decode_tok_s"], ci, ".1f") + rounds, f"{row['prefill_ms']:.0f}",
                      f"{row['roofline_pct']:.0f}%")
    console.print(table)
    console.print(f"bandwidth {res['bandwidth_gb_s']:.1f} GB/s, {res['bytes_per_token'] / 2**20:.0f} MiB/token -> "
                  f"roofline {res['roofline_tok_s']:.1f} tok/s")
    if "native_over_hf" in res:
        lo, hi = res.get("native_over_hf_ci") or (float("nan"), float("nan"))
        paired = res.get("paired") or {}
        console.print(f"native / HF = [bold]{res['native_over_hf']:.2f}x[/] [95% CI {lo:.2f}, {hi:.2f}] over "
                      f"{paired.get('rounds')} interleaved rounds{' [yellow]noisy[/]' if res.get('noisy') else ''}; "
                      f"greedy tokens equal: {res['greedy_tokens_equal']}")
        if paired.get("load"):
            load = paired["load"]
            note(f"[dim]{load_line(load)}; {res['threads']['threads']} thread(s) ({res['threads']['how']})[/]")
    print_caveat(record)


def print_quantized(q) -> None:
    """``quantspec quantize``: per-kernel sizes and errors, time, fidelity, caveat, where the checkpoint went."""
    report, fidelity, out, caveat = q.report, q.fidelity, q.checkpoint, q.caveat
    rotated = f" rotated ({report.rotate})" if report.rotate else ""
    table = Table(title=f"{report.scheme.label} via {report.method}{rotated} ({report.dtype} activations), "
                        f"{len(report.layers)} layers quantized, {len(report.dense)} kept dense")
    for col in ("kernel", "layers", "real low-bit", "weight MiB before", "MiB after", "mean rel. weight error"):
        table.add_column(col, justify="right")
    for kernel, count in report.kernels.items():
        rows = [layer for layer in report.layers if layer.kernel == kernel]
        table.add_row(kernel, str(count), "no (simulated)" if rows[0].simulated else "yes",
                      f"{sum(r.bytes_before for r in rows) / 2**20:.1f}", f"{sum(r.bytes_after for r in rows) / 2**20:.1f}",
                      f"{sum(r.weight_rel_error for r in rows) / len(rows):.4f}")
    console.print(table)
    console.print(f"quantized Linear weights {report.bytes_before / 2**20:.1f} -> {report.bytes_after / 2**20:.1f} MiB "
                  f"({report.bytes_before / report.bytes_after:.2f}x smaller) in {report.seconds:.1f} s"
                  + (f"; calibration {report.calibration}" if report.calibration else ""))
    console.print(f"fidelity vs unquantized on {fidelity.n_tokens} tokens of {len(FIDELITY_PROMPTS)} prompts: "
                  f"mean KL {fidelity.mean_kl:.4f} nats, p99 KL {fidelity.p99_kl:.4f}, "
                  f"top-1 agreement {100 * fidelity.top1_agreement:.1f}%")
    if report.simulated:
        console.print("[yellow]simulated:[/] layers on the 'simulated' kernel run a dequantized weight; "
                      "their speed is not a low-bit speed")
    if caveat:
        note(f"[yellow]note:[/] {caveat}")
    if out is not None:
        console.print(f"compressed-tensors checkpoint: {out}")
    note(f"[dim]{hardware_line(q.model.model)}[/]")


def print_model_info(name: str, info) -> None:
    """``quantspec model info``: architecture, sizes per weight format, weights hash (quant.sizing.ModelInfo)."""
    config, sizes = info.config, info.sizes
    table = Table(title=f"{name} ({info.path})")
    table.add_column("field")
    table.add_column("value", justify="right")
    table.add_row("architecture", ", ".join(config["architectures"]))
    table.add_row("layers / hidden / heads (kv)", f"{config['num_hidden_layers']} / {config['hidden_size']} / "
                  f"{config['num_attention_heads']} ({config.get('num_key_value_heads')})")
    table.add_row("vocab / tied embeddings", f"{config['vocab_size']} / {config.get('tie_word_embeddings', False)}")
    table.add_row("parameters", f"{sizes.parameters / 1e6:.1f} M ({sizes.linear_parameters / 1e6:.1f} M in body "
                                "Linear layers)")
    for fmt, nbytes in sizes.bytes_by_format.items():
        table.add_row(f"weights at {fmt}", f"{nbytes / 2**20:.1f} MiB")
    table.add_row("weights hash", info.weights_hash)
    if info.q4_1_origin:
        table.add_row("source", "a Q4_1 GGUF, dequantized (see the README's 4-bit caveat)")
    console.print(table)


def print_answer(answer) -> None:
    """``quantspec generate``: the text, then its speed line (runtime.answer.Answer)."""
    console.print(answer.result.text)
    console.print(f"[dim]{answer.speed_line()}[/]")


def print_study(summary, csv: str | Path | None = None, png: str | Path | None = None,
                json_out: str | Path | None = None) -> None:
    """A study's speed/quality table and its footer, and the CSV / PNG / JSON written where asked."""
    from studies.pareto import write_csv, write_json  # optuna: optional

    console.print(rich_table(summary))
    for line in footer_lines(summary):
        note(f"[dim]{line}[/]")
    for path, writer in ((csv, write_csv), (png, write_png), (json_out, write_json)):
        if path:
            note(f"wrote {writer(summary, path)}")


def search_with_progress(settings, evaluator):
    """``quantspec.search`` under a rich progress bar showing the study-wide finished count and the last trial."""
    from studies.search import finished_trials, run_search  # optuna: optional
    with progress(TextColumn("{task.fields[last]}"), transient=False) as bar:
        task = bar.add_task("[bold]search[/]", total=settings.n_trials, last="starting")

        def on_trial(study, trial):
            attrs = trial.user_attrs
            what = attrs.get("pruned_reason") or attrs.get("error") or \
                (f"{attrs['speed']['tok_s']:.1f} tok/s" if "speed" in attrs else "")
            bar.update(task, completed=len(finished_trials(study)),
                       last=f"#{trial.number} {attrs.get('label', '')}: {trial.state.name.lower()} {what}"[:100])

        return run_search(settings, evaluator, on_trial=on_trial, on_wait=bar.console.print)


def print_lossless(result, k: int, alpha: float, num_prompts: int, output_len: int) -> None:
    """``quantspec check-lossless``: one row per check (evals.acceptance.LosslessReport)."""
    table = Table(title=f"check-lossless {result.label}, K={k}, {result.precision}, false alarm <= {alpha:g} per test")
    for col in ("check", "result", "detail"):
        table.add_column(col)
    mismatches = result.mismatches
    table.add_row("greedy == plain greedy", "FAIL" if mismatches else "ok",
                  f"{num_prompts - len(mismatches)}/{num_prompts} prompts token-exact over {output_len} tokens"
                  + (f"; first: {mismatches[0]}" if mismatches else ""))
    for name, passed, detail in result.rows:
        table.add_row(name, "info" if passed is None else "ok" if passed else "FAIL", detail)
    console.print(table)


def _pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal, "-" when absent."""
    return "-" if x is None else f"{100 * x:.1f}"


def print_eval_report(report) -> None:
    """``quantspec eval``: accuracy, Δ vs the reference with its CI, flips, floor margin, fidelity, verdict."""
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
        console.print(f"  {task}: at n={c.n} even answers equal to the reference's on every item could not "
                      f"pass {c.floor}; {how_to_decide(c.items_to_decide)}")
    four_bit = caveat_applies(report.record.to_dict())
    for line in report.notes:
        if four_bit or not line.startswith("default model:"):  # the Q4_1 note only beside 4-bit results
            note(f"[yellow]note:[/] {line}")


def print_backend_comparison(comparison, show: int = 10) -> None:
    """``quantspec eval --compare-backends``: per-task agreement and the first ``show`` differing items."""
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


def _ms(stats: dict, key: str) -> str:
    """Seconds as whole milliseconds, "-" when the statistic is missing."""
    return f"{stats[key] * 1e3:.0f}" if stats and key in stats else "-"


def print_bench(title: str, runs: list) -> None:
    """``quantspec bench``: one row per config and load point (serving.bench_api.BenchResult), the spread and load."""
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
    steps = dict.fromkeys(step_line(r.record.engine.config) for r in runs if r.record.engine.config.get("step"))
    if steps:
        note(f"[dim]native decode: {'; '.join(steps)}[/]")
    ok = [r.summary for r in runs if not r.failed and "load" in r.summary]
    if ok:
        load, repeated = ok[-1]["load"], ok[-1].get("repeats")
        how = (f"mean [95% CI] over {repeated['n']} repeats ({repeated['granularity']})" if repeated else
               "one run per load point, so no spread (--repeats N gives each metric's mean and CI)")
        note(f"[dim]{how}; {load_line(load)}[/]")
    note(f"[dim]{hardware_line()}[/]")


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


# ---- a study (studies.pareto.StudySummary): its table and its Pareto plot ----

def _fmt(value, spec: str, empty: str = "") -> str:
    return empty if value is None else format(value, spec)


def _accuracy_cell(r: Row) -> str:
    if r.accuracy is None:
        return ""
    text = f"{100 * r.accuracy:.1f}"
    if r.delta is not None:
        text += f" ({100 * r.delta:+.1f}"
        if r.ci:
            text += f" [{100 * r.ci[0]:+.1f}, {100 * r.ci[1]:+.1f}]"
        text += ")"
    return text


def _tok_s_cell(r: Row) -> str:
    if r.tok_s is None:
        return ""
    if not r.tok_s_ci:
        return f"{r.tok_s:.1f}"
    return f"{r.tok_s:.1f} ±{50 * (r.tok_s_ci[1] - r.tok_s_ci[0]) / r.tok_s:.0f}%"


def _speedup_cell(r: Row) -> str:
    if r.speedup is None:
        return ""
    return with_ci(r.speedup, r.speedup_ci, ".2f", "x") + (" [yellow]noisy[/]" if r.noisy else "")


def _exact_cell(r: Row) -> str:
    if not r.exact:
        return ""
    n_equal = sum(r.exact["equal_per_prompt"])
    mark = " §" if r.exact.get("reference_step") else ""
    return f"{'yes' if r.exact['equal'] else 'NO'} {n_equal}/{r.exact['n_prompts']}{mark}"


def _basis_cell(r: Row) -> str:
    if not r.quality_basis:
        return ""
    kind = r.quality_basis.split(":", 1)[0]
    return {"exact by construction": "exact (constr.)", "infeasible": "[red]infeasible[/]"}.get(kind, kind)


def _length_cell(r: Row) -> str:
    """The length ratio, ``?`` where its prompts do not decide the band."""
    return _fmt(r.length_ratio, ".2f") + (" ?" if r.length_verdict == "undecidable" else "")


def rich_table(summary: StudySummary) -> Table:
    table = Table(title=f"study {summary.name}: effective tok/s vs quality (floor {summary.floor}, {summary.mode}, "
                        f"length band {'-'.join(map(str, summary.length_band)) if summary.length_band else 'off'}"
                        f"{'; decode: ' + ' / '.join(summary.steps) + ' step' if summary.steps else ''}); "
                        "speedup: paired with the reference, median of per-round ratios [95% CI] over n rounds; "
                        "* = Pareto-optimal among feasible rows, ~ = not separable from the front within the CIs",
                  title_justify="left")
    for col, justify in (("", "center"), ("#", "right"), ("config", "left"), ("backend", "left"),
                         ("tok/s", "right"), ("speedup [CI]", "right"), ("n", "right"), ("acc % (Δ [CI])", "right"),
                         ("flips", "right"),
                         ("KL", "right"), ("α / τ", "right"), ("greedy =", "right"), ("quality", "left"),
                         ("len ×ref", "right"), ("EOT", "right"), ("feasible", "center")):
        table.add_column(col, justify=justify)
    for r in summary.measured:
        label = r.label + ("  †" if "q4_1" in r.notes else "")
        verdict = "" if r.feasible is None else ("[green]pass[/]" if r.feasible else "[red]fail[/]")
        spec = f"{r.alpha:.2f} / {r.tau:.2f}" if r.alpha is not None and r.tau is not None else ""
        table.add_row("*" if r.pareto else "~" if r.not_separable else "", str(r.number), label, r.backend,
                      _tok_s_cell(r), _speedup_cell(r), _fmt(r.rounds, "d"), _accuracy_cell(r),
                      _fmt(r.flips, "d"), _fmt(r.kl, ".4f"), spec, _exact_cell(r), _basis_cell(r),
                      _length_cell(r), _fmt(r.eot_rate, ".0%"), verdict,
                      style=None if r.feasible is not False else "dim")
    return table


def footer_lines(summary: StudySummary) -> list[str]:
    """Caveats, skipped trials with their reasons, and duplicates, one line each."""
    lines = [f"† {text}" for text in summary.notes.values()]
    for r in summary.measured:
        if r.infeasible_because:
            lines.append(f"#{r.number} {r.label} infeasible: {'; '.join(r.infeasible_because)}")
        if r.noisy:
            half = (r.speedup_ci[1] - r.speedup_ci[0]) / 2 / r.speedup if r.speedup_ci and r.speedup else float("nan")
            lines.append(f"#{r.number} {r.label}: speed noisy: its speedup CI stayed ±{100 * half:.0f}% after "
                         f"{r.rounds} rounds ({r.load}); re-measure on a quieter machine")
    undecided = [r for r in summary.measured if r.length_verdict == "undecidable"]
    if undecided:
        lines.append(f"len ×ref ? = the length gate is undecidable on its prompts for #"
                     f"{', #'.join(str(r.number) for r in undecided)} (the paired interval straddles the band): "
                     "recorded, not enforced; more --length-prompts decide it")
    own_step = [r for r in summary.measured if r.exact and r.exact.get("reference_step")]
    if own_step:
        lines.append(f"§ greedy = plain decoding on the step the point ran on, not its twin's engine's, for #"
                     f"{', #'.join(str(r.number) for r in own_step)} (lossless speculation reproduces its own kernels)")
    if summary.compile_s:
        lines.append(f"compiled steps built in {summary.compile_s:.0f} s in all (one-time, in no row's speed)")
    steps = summary.steps
    if len(steps) > 1:
        lines += [f"#{r.number} {r.label} ran on the {r.step} step" for r in summary.measured if r.step != steps[0]]
    duplicates = sum(r.duplicate_of is not None for r in summary.rows)
    if duplicates:
        lines.append(f"{duplicates} trial(s) re-sampled an already measured config and reused its numbers")
    reasons: dict[str, list[int]] = {}
    for r in summary.skipped:
        reasons.setdefault(f"{r.state.lower()}: {r.reason or 'no reason recorded'}", []).append(r.number)
    lines += [f"{len(nums)} trial(s) {reason} (#{', #'.join(map(str, nums[:6]))}{', ...' if len(nums) > 6 else ''})"
              for reason, nums in reasons.items()]
    return lines


# How the plot marks a row that breaks a constraint (one overlay per broken constraint, so a row that fails two
# gates shows both) and one whose speed is noisy: constraint -> (legend text, marker style).
INFEASIBLE_MARKERS = {
    "quality_floor": ("infeasible: quality floor not shown to hold",
                      dict(marker="v", ms=9, mfc="tab:red", mec="tab:red")),
    "length_band": ("infeasible: output length outside the band",
                    dict(marker="s", ms=13, mfc="none", mec="tab:purple", mew=1.5)),
    "exactness": ("infeasible: greedy outputs differ from its non-speculative twin",
                  dict(marker="X", ms=11, mfc="black", mec="white", mew=0.8)),
}
OTHER_MARKER = dict(marker="P", ms=9, mfc="tab:brown", mec="tab:brown")
NOISY_MARKER = ("speed noisy: its speedup CI stayed wider than the threshold",
                dict(marker="o", ms=17, mfc="none", mec="magenta", mew=1.2))


def short_label(r: Row, reference: dict | None) -> str:
    """``#7 w4g32-asym+rtn ngram K=2``: the trial number (as in the table) and its label, proposer options
    dropped; the reference config is called so."""
    import re

    label = re.sub(r"(\w+):\S+ K=", r"\1 K=", r.label)
    if r.config == reference:
        label = "reference" + ("" if label == "none" else f" ({label})")
    else:
        label = re.sub(r"^none\b", "unquantized", label)
    if r.backend and r.backend != DEFAULT_BACKEND:  # a point off the default backend says which it ran on
        label = f"{r.backend} {label}"
    return f"#{r.number} {label}"


def _floor_line(summary: StudySummary, y_kind: str, ref_acc: float | None) -> float | None:
    """The floor in the plotted y units: Δ points, accuracy % or the floor statistic itself."""
    if y_kind == "quality":
        return summary.floor_value
    try:
        floor = Floor.parse(summary.floor)
    except (UserError, ValueError, TypeError):  # a toy evaluator's floor, or none: no line in accuracy units
        return None
    if floor is None or (floor.relative and ref_acc is None):
        return None
    acc = floor.value * ref_acc if floor.relative else floor.value
    return 100 * (acc - ref_acc) if y_kind == "delta" else 100 * acc


def _place_labels(fig, ax, items: list[tuple[float, float, str, dict]], points: list[tuple[float, float]]) -> None:
    """Annotate each (x, y, text, style) at the first of a few offsets around its point whose text box overlaps no
    earlier label and no plotted point and stays inside the axes (else the first offset); far ones get a leader."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # runs the layout: display positions are final from here
    renderer = canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    pad = 5
    taken = [Bbox.from_extents(px - pad, py - pad, px + pad, py + pad)
             for px, py in (ax.transData.transform(p) for p in points)]
    offsets = [(6, 5, "left", "bottom"), (6, -5, "left", "top"), (-6, 5, "right", "bottom"),
               (-6, -5, "right", "top"), (0, 12, "center", "bottom"), (0, -12, "center", "top"),
               (14, 18, "left", "bottom"), (14, -18, "left", "top"), (-14, 18, "right", "bottom"),
               (-14, -18, "right", "top"), (20, 32, "left", "bottom"), (20, -32, "left", "top"),
               (-20, 32, "right", "bottom"), (-20, -32, "right", "top")]
    for x, y, text, style in items:
        chosen = None
        for dx, dy, ha, va in offsets:
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va, **style)
            box = ann.get_window_extent(renderer)
            fits = (box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0 and box.y1 <= inside.y1
                    and not any(box.overlaps(t) for t in taken))
            if fits:
                chosen = ann
                break
            ann.remove()
        if chosen is None:
            dx, dy, ha, va = offsets[0]
            chosen = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va, **style)
        elif abs(dx) > 6 or abs(dy) > 12:
            chosen.arrow_patch = None
            chosen.remove()
            chosen = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                                 arrowprops=dict(arrowstyle="-", lw=0.5, color="grey", shrinkA=0, shrinkB=3), **style)
        chosen.set_in_layout(False)
        taken.append(chosen.get_window_extent(renderer))


def figure_pareto(summary: StudySummary):
    """The study as a matplotlib Figure: y = accuracy Δ vs the reference (percentage points, its paired 95% CI as
    error bars; accuracy or the floor statistic when rows carry no Δ), x = speedup over the reference (paired,
    95% CI; effective tok/s on a second axis) or tok/s where there is no reference. Feasible points blue;
    infeasible ones grey with one marker per broken constraint; noisy speeds ringed; the Pareto front joined and
    labelled, every other point numbered as in the table."""
    import textwrap

    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows = [r for r in summary.measured if r.quality is not None and (r.speedup is not None or r.tok_s is not None)]
    fig = Figure(figsize=(12, 6.5), dpi=100, layout="constrained")
    ax = fig.subplots()
    by_speedup = bool(rows) and all(r.speedup is not None for r in rows)
    y_kind = ("delta" if rows and all(r.delta is not None for r in rows) else
              "accuracy" if rows and all(r.accuracy is not None for r in rows) else "quality")
    task = next((r.task for r in rows if r.task), None) or (
        summary.conditions.split("quality on ", 1)[1].split(",")[0] if summary.conditions and
        "quality on " in summary.conditions else None)
    accuracy = f"{task} accuracy" if task else "accuracy"
    ref_acc = next((r.accuracy - r.delta for r in sorted(rows, key=lambda r: r.config != summary.reference)
                    if r.accuracy is not None and r.delta is not None), None)

    def xy(r: Row) -> tuple[float, float, list, list]:
        x, x_ci = (r.speedup, r.speedup_ci) if by_speedup else (r.tok_s, r.tok_s_ci)
        if y_kind == "delta":
            y, y_ci = 100 * r.delta, [100 * v for v in r.ci] if r.ci else None
        elif y_kind == "accuracy":
            y, y_ci = 100 * r.accuracy, None
        else:
            y, y_ci = r.quality, None
        xerr = [[max(x - x_ci[0], 0)], [max(x_ci[1] - x, 0)]] if x_ci else None
        yerr = [[max(y - y_ci[0], 0)], [max(y_ci[1] - y, 0)]] if y_ci else None
        return x, y, xerr, yerr

    handles: dict[str, Line2D] = {}
    for r in rows:
        x, y, xerr, yerr = xy(r)
        colour = "tab:blue" if r.feasible else "grey"
        ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", ms=5 if r.feasible else 4, c=colour, ecolor=colour,
                    elinewidth=0.9, capsize=3, alpha=1 if r.feasible else 0.7, zorder=3)
        key = ("feasible (passes every gate)" if r.feasible else
               "not gated (no constraints recorded)" if r.feasible is None else
               "infeasible (grey; the markers below say which gate it fails)")
        handles.setdefault(key, Line2D([], [], ls="", marker="o", ms=5, c=colour))
        for name in r.failed_constraints:
            text, style = INFEASIBLE_MARKERS.get(name, (f"infeasible: {name}", OTHER_MARKER))
            ax.plot([x], [y], ls="", zorder=5 if name == "exactness" else 4, gid=f"infeasible:{name}", **style)
            handles.setdefault(text, Line2D([], [], ls="", **style))
        if r.noisy:
            ax.plot([x], [y], ls="", zorder=2, gid="noisy", **NOISY_MARKER[1])
            handles.setdefault(NOISY_MARKER[0], Line2D([], [], ls="", **NOISY_MARKER[1]))
        if r.config == summary.reference:
            ax.plot([x], [y], ls="", marker="*", ms=15, mfc="none", mec="black", mew=1, zorder=5)
            handles.setdefault("reference config (unquantized, no speculation)",
                               Line2D([], [], ls="", marker="*", ms=12, mfc="none", mec="black"))

    front = sorted((r for r in rows if r.feasible and r.pareto), key=lambda r: xy(r)[0])
    if front:
        ax.plot([xy(r)[0] for r in front], [xy(r)[1] for r in front], "-D", ms=11, mfc="none", mew=1.5,
                c="tab:orange", zorder=2, gid="front")
        handles["Pareto front (feasible points no other beats on both axes)"] = Line2D(
            [], [], ls="-", marker="D", ms=9, mfc="none", c="tab:orange")
    close = [r for r in rows if r.not_separable]
    for r in close:
        ax.plot([xy(r)[0]], [xy(r)[1]], ls="", marker="D", ms=11, mfc="none", mec="tab:orange", mew=1,
                alpha=0.6, zorder=2)
    if close:
        handles["off the front, but not separable from it within the CIs"] = Line2D(
            [], [], ls="", marker="D", ms=9, mfc="none", mec="tab:orange", alpha=0.6)

    floor_y = _floor_line(summary, y_kind, ref_acc)
    if floor_y is not None and floor_y == floor_y:  # not NaN (a study without a stored floor)
        floor_text = (f"quality floor {summary.floor}" + (f" ({floor_y:+.1f} pts)" if y_kind == "delta" else "")
                      + ": passing needs the lower end\nof the paired 95% interval above this line")
        ax.axhline(floor_y, ls="--", c="tab:red", lw=1)
        handles[floor_text] = Line2D([], [], ls="--", c="tab:red", lw=1)
    if by_speedup:
        ax.axvline(1.0, ls=":", c="grey", lw=1)
        handles["1.0×: the reference's speed"] = Line2D([], [], ls=":", c="grey", lw=1)
    if y_kind == "delta":
        ax.axhline(0.0, ls="-", c="grey", lw=0.5)

    labels = [(*xy(r)[:2], short_label(r, summary.reference), dict(fontsize=7.5, color="black"))
              for r in rows if r.pareto or r.not_separable]
    labels += [(*xy(r)[:2], f"#{r.number}", dict(fontsize=7, color="dimgrey"))
               for r in rows if not (r.pareto or r.not_separable)]

    paired = by_speedup and any(r.speedup_ci for r in rows)
    if by_speedup:
        ax.set_xlabel("speedup over the reference (× its effective tok/s; " + (
            "paired interleaved rounds, bars: 95% CI)" if paired else "tok/s ÷ the reference's, unpaired)"))
        ref_tok_s = next((r.tok_s for r in rows if r.config == summary.reference and r.tok_s), None)
        if ref_tok_s:
            top = ax.secondary_xaxis("top", functions=(lambda s: s * ref_tok_s, lambda t: t / ref_tok_s))
            top.set_xlabel(f"≈ effective tok/s (speedup × the reference's {ref_tok_s:.1f} tok/s; batch 1)",
                           fontsize=9)
    else:
        ax.set_xlabel("effective tok/s (batch 1" + ("; bars: 95% CI)" if any(r.tok_s_ci for r in rows) else ")"))
    ax.set_ylabel({"delta": f"{accuracy} Δ vs the reference (percentage points;\n< 0: lost accuracy"
                            + (f", reference {100 * ref_acc:.1f}%" if ref_acc is not None else "")
                            + "; bars: paired 95% CI)",
                   "accuracy": f"{accuracy} (%)",
                   "quality": "quality (the statistic compared with the floor)"}[y_kind])
    ax.grid(alpha=0.3)
    ax.margins(0.12)
    handles["#n: trial number in the table (`quantspec pareto`)"] = Line2D([], [], ls="")
    first = ("feasible", "not gated", "infeasible (", "infeasible:", "speed noisy", "reference", "Pareto", "off the")
    order = sorted(handles, key=lambda text: next((i for i, s in enumerate(first) if text.startswith(s)), len(first)))
    ax.legend([handles[text] for text in order], order, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1),
              frameon=False)
    band = "-".join(map(str, summary.length_band)) if summary.length_band else "off"
    title = (f"study {summary.name}: speed vs {accuracy} ({summary.mode}, floor {summary.floor}, "
             f"length band {band})")
    if summary.conditions:
        title += "\n" + "\n".join(textwrap.wrap(summary.conditions, 110))
    fig.suptitle(title, fontsize=10.5)
    _place_labels(fig, ax, labels, [xy(r)[:2] for r in rows])
    fig.set_layout_engine("none")  # keep the positions the labels were placed at
    return fig


def write_png(summary: StudySummary, path: str | Path) -> Path:
    """``figure_pareto`` saved as a PNG at ``path`` (written to a temporary name, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure_pareto(summary).savefig(tmp)
    tmp.replace(path)
    return path
