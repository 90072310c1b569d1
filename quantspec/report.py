"""Rich tables and plots of the API's results, shared by the CLI and the bench/ scripts."""
from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evals.record import RunRecord
from runtime.measure import load_line, with_ci
from runtime.model_store import caveat_applies

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
    cis = [r.get("speedup_ci") or (r["speedup"], r["speedup"]) for r in rows]
    cis = [ci if all(map(math.isfinite, ci)) else (r["speedup"], r["speedup"]) for ci, r in zip(cis, rows)]
    ax2.errorbar(ks, [r["speedup"] for r in rows], fmt="o-", capsize=3, label="measured (95% CI over prompts)",
                 yerr=[[r["speedup"] - ci[0] for r, ci in zip(rows, cis)], [ci[1] - r["speedup"] for r, ci in zip(rows, cis)]])
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
