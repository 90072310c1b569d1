"""Rich tables and plots of the API's results, shared by the CLI and the bench/ scripts."""
from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evals.record import RunRecord
from runtime.measure import BOOTSTRAP_RESAMPLES, CONFIDENCE, load_line, with_ci
from runtime.model_store import DEFAULT_MODEL, SMOLLM2, caveat_applies

console = Console(width=max(Console().width, 120))


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
        console.print(f"[yellow]note:[/] {record.model.note}")


def print_decode_comparison(record) -> None:
    res = record.results
    table = Table(title=f"batch-1 greedy decode, {record.model.model_id} {record.model.precision}, "
                        f"{record.lengths.output_tokens['fixed']} new tokens (ignore_eos)")
    for col in ("engine", "decode tok/s [95% CI]", "prefill ms", "% of roofline"):
        table.add_column(col, justify="right")
    for row in res["rows"]:
        ci = row.get("decode_tok_s_ci")
        rounds = f" (n={row['rounds']})" if ci else ""
        table.add_row(row["engine"], with_ci(row["decode_tok_s"], ci, ".1f") + rounds, f"{row['prefill_ms']:.0f}",
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
            console.print(f"[dim]{load_line(load)}; {res['threads']['threads']} thread(s) ({res['threads']['how']})[/]")
    print_caveat(record)
