"""The two plots a reader sees without the code: ``quantspec accept --plot`` (quantspec.report.figure_sweep) and the
Pareto plot of a study (quantspec.report.figure_pareto), asserted on the matplotlib Figure they build."""
from __future__ import annotations

import math

import optuna
import pytest
from matplotlib.container import ErrorbarContainer

from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord)
from quantspec.report import acceptance_cis, figure_sweep, plot_sweep
from quantspec.report import figure_pareto, short_label, write_png
from studies.pareto import Row, StudySummary, mark_front, summarize


# ---- accept sweep -------------------------------------------------------------------------------------------

def per_prompt_counts(k: int, i: int) -> tuple[int, int, int]:
    """(accepted, drafted tokens, drafts) of prompt i at draft length k."""
    return 30 + 5 * i + 2 * k, (40 + 3 * i) * k, 40 + 3 * i


def sweep_record(ks=(1, 2, 4, 8), n: int = 4, counts: bool = True, speedup_ci: bool = True) -> RunRecord:
    rows = []
    for k in ks:
        per = []
        for i in range(n):
            acc, drafted, drafts = per_prompt_counts(k, i)
            per.append({"alpha": acc / drafted, "tau": 1 + acc / drafts, "tok_s": 20.0}
                       | ({"accepted": acc, "draft_tokens": drafted, "drafts": drafts} if counts else {}))
        acc, drafted, drafts = (sum(c) for c in zip(*(per_prompt_counts(k, i) for i in range(n))))
        rows.append({"k": k, "alpha": acc / drafted, "beta": min(1.0, acc / drafted + 0.1), "tau": 1 + acc / drafts,
                     "speedup": 1.2 + 0.05 * k,
                     "speedup_ci": [1.1 + 0.05 * k, 1.35 + 0.05 * k] if speedup_ci else [-math.inf, math.inf],
                     "predicted_speedup": 1.5 + 0.1 * k, "refined_speedup": 1.3 + 0.04 * k, "c": 0.02,
                     "verify_cost": 1 + 0.05 * k, "per_request": per})
    return RunRecord("specdec-accept", ModelCondition("SmolTest-135M", "h", "bf16"),
                     {"cpu": "Test CPU 9000", "isa": "AVX512", "torch_threads": 2},
                     LengthDistribution(n, {"mean": 40}, {"fixed": 32}, "spec_bench", True), ArrivalProcess(),
                     EngineCondition("native", {"dtype": "bf16", "threads": 2, "sampling": {"temperature": 0.0}}),
                     MetricCondition({}, ""),
                     results={"proposer": "ngram:min=2,max=4", "rows": rows, "baseline": {"tok_s": 15.3}})


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def errorbars(ax) -> list[ErrorbarContainer]:
    return [c for c in ax.containers if isinstance(c, ErrorbarContainer)]


def test_sweep_figure_has_three_labelled_panels_on_the_sweeps_ks_with_cis():
    record = sweep_record()
    fig = figure_sweep(record)
    alpha_ax, tau_ax, speed_ax = fig.axes
    assert len(fig.axes) == 3
    assert "α" in alpha_ax.get_ylabel() and "probability" in alpha_ax.get_ylabel() and alpha_ax.get_ylim() == (0, 1.05)
    assert "τ" in tau_ax.get_ylabel() and "tokens per verification step" in tau_ax.get_ylabel()
    assert "speedup" in speed_ax.get_ylabel() and "plain decoding" in speed_ax.get_ylabel()
    for ax in fig.axes:  # integer K ticks only, the sweep's own, on a log2 axis (powers of two)
        assert list(ax.get_xticks()) == [1, 2, 4, 8] and [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
        assert ax.get_xscale() == "log" and not ax.xaxis.get_minorticklocs().size
        assert len(errorbars(ax)) == 1  # α, τ (from per-prompt counts) and speedup CIs
    bars = errorbars(speed_ax)[0]
    segments = bars.lines[2][0].get_segments()  # one vertical segment per K: the speedup CI
    assert [v for seg in segments for v in seg[:, 1]] == pytest.approx(
        [v for r in record.results["rows"] for v in r["speedup_ci"]])
    texts = legend_texts(speed_ax)
    assert any("Thm 3.8" in t and "(1-β^(K+1)) / ((1-β)(K·c+1))" in t for t in texts)
    assert any("measured verify cost V(K)" in t for t in texts) and "1.0: no speedup" in texts
    assert any(line.get_ydata()[0] == 1.0 for line in speed_ax.get_lines() if line.get_label() == "1.0: no speedup")
    assert any(t.startswith("β:") for t in legend_texts(alpha_ax))
    title = fig._suptitle.get_text()
    for needle in ("ngram:min=2,max=4", "SmolTest-135M", "bf16", "4 prompts", "32 new tokens", "Test CPU 9000",
                   "AVX512", "greedy"):
        assert needle in title, needle


def test_sweep_figure_without_cis_says_so_and_draws_no_bars():
    """Negative control: 2 prompts without per-prompt counts and an infinite speedup CI: no error bars, a legend
    line instead; Ks that are not powers of two stay on a linear axis, ticked at the Ks."""
    fig = figure_sweep(sweep_record(ks=(1, 3, 5), n=2, counts=False, speedup_ci=False))
    for ax in fig.axes:
        assert not errorbars(ax) and ax.get_xscale() == "linear" and list(ax.get_xticks()) == [1, 3, 5]
        assert any("no 95% CI" in t and "2 prompt(s)" in t for t in legend_texts(ax))
    fig = figure_sweep(sweep_record(n=4, counts=False))  # enough prompts, but rates only: α/τ bars need counts
    alpha_ax, tau_ax, speed_ax = fig.axes
    assert not errorbars(alpha_ax) and not errorbars(tau_ax) and len(errorbars(speed_ax)) == 1
    assert any("not the counts" in t for t in legend_texts(alpha_ax))


def test_acceptance_cis_pool_counts_over_resampled_prompts():
    row = sweep_record(n=6).results["rows"][1]
    cis = acceptance_cis(row)
    assert cis["alpha"][0] < row["alpha"] < cis["alpha"][1] and cis["tau"][0] < row["tau"] < cis["tau"][1]
    per_alpha = [p["alpha"] for p in row["per_request"]]
    assert min(per_alpha) <= cis["alpha"][0] and cis["alpha"][1] <= max(per_alpha)
    assert acceptance_cis(sweep_record(n=6, counts=False).results["rows"][1]) is None
    assert acceptance_cis(sweep_record(n=2).results["rows"][1]) is None


def test_plot_sweep_writes_a_png(tmp_path):
    path = plot_sweep(sweep_record(), tmp_path / "sub" / "a.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


# ---- Pareto plot --------------------------------------------------------------------------------------------

REFERENCE = {"weights": "none", "proposer": "none"}
REASON_TEXT = {"quality_floor": "below the quality floor", "exactness": "quality not applicable (outputs differ)",
               "length_band": "output length 1.30x the reference's, outside [0.9, 1.1]"}


def row(n, label, speedup, delta, failed=(), noisy=False, config=None, ci=0.004, speed_ci=0.05) -> Row:
    return Row(n, "COMPLETE", label, "native", config or {"weights": label}, tok_s=20 * speedup, speedup=speedup,
               speedup_ci=[speedup - speed_ci, speedup + speed_ci], noisy=noisy, quality=1 + delta,
               accuracy=0.5 + delta, delta=delta, ci=[delta - ci, delta + ci], feasible=not failed,
               infeasible_because=[REASON_TEXT[f] for f in failed], failed_constraints=list(failed), task="arc_easy")


def toy_summary() -> StudySummary:
    rows = [row(0, "none", 1.0, 0.0, config=REFERENCE, ci=0.0),
            row(1, "w8ch-sym+rtn", 1.3, -0.005),
            row(2, "w4g32-asym+rtn", 1.8, -0.06, failed=["quality_floor"]),
            row(3, "w8ch-sym+rtn ngram:min=2,max=4 K=4", 1.6, -0.005, failed=["length_band"]),  # length gate only
            row(4, "w4g32-sym+rtn ngram:min=2,max=4 K=2", 2.0, -0.04, failed=["exactness", "quality_floor"]),
            row(5, "none ngram:min=2,max=4 K=3", 1.25, 0.0, ci=0.0, noisy=True, speed_ci=0.2),
            row(6, "w8ch-sym+rtn ngram:min=2,max=4 K=2", 1.45, -0.01),
            row(7, "w8ch-sym+rtn kv-int8", 1.35, -0.012)]
    summary = StudySummary("toy", "constrained", "0.98", 0.98, REFERENCE, rows, length_band=[0.9, 1.1],
                           conditions="model SmolTest-135M, bf16, quality on arc_easy, Test CPU 9000 (AVX512)")
    mark_front(summary.measured)
    return summary


def series(ax, gid: str) -> set[tuple[float, float]]:
    return {(float(x), float(y)) for line in ax.get_lines() if line.get_gid() == gid
            for x, y in zip(line.get_xdata(), line.get_ydata())}


def test_pareto_figure_axes_reasons_front_and_labels():
    summary = toy_summary()
    fig = figure_pareto(summary)
    ax = fig.axes[0]
    point = {r.number: (r.speedup, 100 * r.delta) for r in summary.rows}
    assert "arc_easy accuracy Δ vs the reference" in ax.get_ylabel() and "percentage points" in ax.get_ylabel()
    assert "speedup over the reference" in ax.get_xlabel() and "95% CI" in ax.get_xlabel()
    assert any("effective tok/s" in a.get_xlabel() for a in ax.child_axes)  # the same axis in tok/s, on top
    bars = errorbars(ax)  # every point with both CIs as error bars
    assert len(bars) == len(summary.rows) and all(b.has_xerr and b.has_yerr for b in bars)
    texts = legend_texts(ax)
    for needle in ("quality floor not shown to hold", "output length outside the band",
                   "differ from its non-speculative twin", "speed noisy", "Pareto front", "quality floor 0.98"):
        assert any(needle in t for t in texts), needle
    floor = series(ax, "infeasible:quality_floor")
    assert floor == {point[2], point[4]}
    assert point[3] not in floor and series(ax, "infeasible:length_band") == {point[3]}  # negative control
    assert series(ax, "infeasible:exactness") == {point[4]} and series(ax, "noisy") == {point[5]}
    front = sorted((r for r in summary.measured if r.pareto), key=lambda r: r.speedup)
    assert [r.number for r in front] == [5, 1, 6]
    (front_line,) = [line for line in ax.get_lines() if line.get_gid() == "front"]
    assert set(zip(front_line.get_xdata(), front_line.get_ydata())) == {point[r.number] for r in front}
    labels = {t.get_text(): t for t in ax.texts}
    for r in front:  # front points carry their (short) configuration label, others their number only
        assert short_label(r, summary.reference) in labels
    assert "#6 w8ch-sym+rtn ngram K=2" in labels and "#5 unquantized ngram K=3" in labels
    assert "#2" in labels and not any(t.startswith("#2 ") for t in labels)
    assert labels["#6 w8ch-sym+rtn ngram K=2"].xy == pytest.approx(point[6])
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])  # no label covers another
    title = fig._suptitle.get_text()
    assert "SmolTest-135M" in title and "bf16" in title and "arc_easy" in title and "Test CPU 9000 (AVX512)" in title


def test_pareto_rows_record_which_gate_failed_from_trial_constraints(tmp_path):
    """A trial failing only the length gate is infeasible for its length, never drawn as below the floor; one whose
    floor no answers could pass at the items scored says so, not that it fell below."""
    study = optuna.create_study(directions=["maximize"])
    study.set_user_attr("reference", REFERENCE)
    for number, (config, constraints) in enumerate((
            (REFERENCE, {"quality_floor": -0.01, "length_band": -0.1}),
            ({"weights": "w8"}, {"quality_floor": -0.01, "length_band": 0.2}),
            ({"weights": "w4"}, {"quality_floor": 0.05, "length_band": -0.1}),
            ({"weights": "w4g32"}, {"quality_floor": 0.05, "length_band": -0.1}))):
        undecided = {"decidable": False, "items_to_decide": 100} if config["weights"] == "w4g32" else {}
        study.add_trial(optuna.create_trial(value=20.0 + number, user_attrs={
            "config": config, "label": config["weights"], "speed": {"tok_s": 20.0 + number},
            "quality": {"value": 1.0, "accuracy": 0.5, "delta": 0.0, "ci": [-0.01, 0.01], "task": "arc_easy",
                        **undecided},
            "length": {"ratio": 1.3, "band": [0.9, 1.1]}},
            system_attrs={f"constraints:{k}": v for k, v in constraints.items()}))
    summary = summarize(study)
    by_label = {r.label: r for r in summary.rows}
    assert by_label["w8"].failed_constraints == ["length_band"] and by_label["w4"].failed_constraints == ["quality_floor"]
    assert by_label["none"].task == "arc_easy"
    assert by_label["w4"].infeasible_because == ["below the quality floor"]
    (undecided,) = by_label["w4g32"].infeasible_because
    assert "undecidable" in undecided and "about 100 items (--limit)" in undecided
    ax = figure_pareto(summary).axes[0]
    w8 = (by_label["w8"].speedup, 0.0)
    assert w8 in series(ax, "infeasible:length_band") and w8 not in series(ax, "infeasible:quality_floor")
    assert write_png(summary, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_pareto_figure_without_reference_uses_tok_s():
    summary = toy_summary()
    for r in summary.rows:
        r.speedup, r.speedup_ci = None, None
    ax = figure_pareto(summary).axes[0]
    assert ax.get_xlabel().startswith("effective tok/s") and not ax.child_axes
