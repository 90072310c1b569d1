"""The speed/quality table of a study (rich), its CSV/JSON export and the Pareto plot (matplotlib, Agg)."""
from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna
from rich.table import Table

from evals.config import DEFAULT_BACKEND
from evals.floor import Floor
from evals.record import write_json_atomic
from runtime.model_store import DEFAULT_MODEL, SMOLLM2, is_default_model
from runtime.errors import UserError
from runtime.measure import load_line, with_ci
from studies.storage import open_storage, shown_url

Q4_1_SCHEME = "w4g32-asym"  # rows of this scheme on the default model carry the Q4_1-origin caveat


@dataclass
class Row:
    number: int
    state: str  # COMPLETE | PRUNED | FAIL | RUNNING | WAITING
    label: str
    backend: str
    config: dict
    tok_s: float | None = None
    tok_s_ci: list | None = None
    speedup: float | None = None  # vs the reference config (unquantized, no speculation): paired when measured so
    speedup_ci: list | None = None  # its 95% CI (paired runs only)
    noisy: bool | None = None  # the speedup's CI stayed wider than the noise threshold
    rounds: int | None = None  # interleaved reference/candidate rounds behind the speedup (one ratio each)
    load: str | None = None  # the machine's load while it was measured
    quality: float | None = None  # the statistic compared with the floor
    accuracy: float | None = None
    delta: float | None = None
    ci: list | None = None
    flips: int | None = None
    kl: float | None = None
    alpha: float | None = None
    tau: float | None = None
    feasible: bool | None = None
    pareto: bool = False
    not_separable: bool = False  # off the front on point estimates, but no front point beats it beyond the CIs
    exact: dict | None = None  # greedy-output equality of a speculative config vs its non-speculative twin
    quality_basis: str | None = None  # measured | exact by construction | verified | infeasible: why
    length_ratio: float | None = None  # mean output tokens (natural end-of-turn) / the reference's
    eot_rate: float | None = None  # share of outputs that ended at end-of-turn before the limit
    infeasible_because: list[str] = field(default_factory=list)  # the constraints it breaks
    failed_constraints: list[str] = field(default_factory=list)  # their names: quality_floor, exactness, length_band
    task: str | None = None  # the quality task (the worst one when several)
    duplicate_of: int | None = None
    reason: str | None = None  # pruned reason or error
    notes: list[str] = field(default_factory=list)


@dataclass
class StudySummary:
    name: str
    mode: str
    floor: str  # as given (e.g. 0.98, abs:0.40)
    floor_value: float  # the number quality values are compared with
    reference: dict | None
    rows: list[Row]  # every trial
    notes: dict[str, str] = field(default_factory=dict)  # marker -> caveat
    length_band: list | None = None  # the output-length gate (None: off)
    conditions: str | None = None  # model, dtype, quality task and hardware, from the reference trial's records

    @property
    def measured(self) -> list[Row]:
        """Distinct measured configurations, fastest first (duplicates reuse an earlier row): by paired speedup
        when every row has one (absolute tok/s move with the load each trial saw), else by tok/s."""
        rows = [r for r in self.rows if r.state == "COMPLETE" and r.tok_s is not None and r.duplicate_of is None]
        paired = all(r.speedup_ci for r in rows)
        return sorted(rows, key=lambda r: -(r.speedup if paired else r.tok_s))

    @property
    def skipped(self) -> list[Row]:
        return [r for r in self.rows if r.state in ("PRUNED", "FAIL")]

    def to_dict(self) -> dict:
        return {"study": self.name, "mode": self.mode, "floor": self.floor, "floor_value": self.floor_value,
                "reference": self.reference, "length_band": self.length_band or "off", "conditions": self.conditions,
                "notes": self.notes, "rows": [asdict(r) for r in self.rows]}


def pareto_mask(points: list[tuple[float, float]]) -> list[bool]:
    """True where no other point is >= in both coordinates and > in one (both maximised)."""
    return [not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points) for p in points]


Interval = tuple[float, float]


def separably_dominated(points: list[tuple[Interval, Interval]]) -> list[bool]:
    """Each point is (speed CI, quality CI), both maximised. True where another point is at least as good on both
    midpoints and beats it beyond both CIs on at least one axis (its lower bound above this one's upper bound);
    a point dominated only on point estimates is not separable from the one that dominates it."""
    mid = [((s[0] + s[1]) / 2, (q[0] + q[1]) / 2) for s, q in points]
    return [any(mid[j][0] >= mid[i][0] and mid[j][1] >= mid[i][1] and mid[j] != mid[i]
                and (points[j][0][0] > points[i][0][1] or points[j][1][0] > points[i][1][1])
                for j in range(len(points)) if j != i) for i in range(len(points))]


def _load_text(load: dict | None) -> str | None:
    return load_line(load) if load else None


def _row(trial: optuna.trial.FrozenTrial) -> Row:
    attrs = trial.user_attrs
    config = attrs.get("config") or {}
    quality, speed = attrs.get("quality") or {}, attrs.get("speed") or {}
    constraints = trial.constraints or {}
    basis, length = attrs.get("quality_basis") or {}, attrs.get("length") or {}
    row = Row(
        number=trial.number, state=trial.state.name, label=attrs.get("label", ""),
        backend=config.get("backend", ""), config=config, tok_s=speed.get("tok_s"), tok_s_ci=speed.get("tok_s_ci"),
        speedup=speed.get("speedup"), speedup_ci=speed.get("speedup_ci"), noisy=speed.get("noisy"),
        rounds=(speed.get("measurement") or {}).get("rounds"),
        load=_load_text((speed.get("measurement") or {}).get("load")),
        quality=quality.get("value"), accuracy=quality.get("accuracy"), delta=quality.get("delta"),
        ci=quality.get("ci"), flips=quality.get("flips"), kl=quality.get("kl"), task=quality.get("task"),
        alpha=speed.get("alpha"), tau=speed.get("tau"),
        feasible=None if "quality_floor" not in constraints else all(v <= 0 for v in constraints.values()),
        exact=attrs.get("exact_check"),
        quality_basis=(f"{basis['kind']}: {basis['why']}" if basis else None),
        length_ratio=length.get("ratio"), eot_rate=length.get("eot_rate"),
        duplicate_of=attrs.get("duplicate_of"),
        reason=attrs.get("pruned_reason") or attrs.get("error") or attrs.get("stale") or attrs.get("surplus"),
    )
    for name, value in constraints.items():
        if value > 0:
            row.failed_constraints.append(name)
            row.infeasible_because.append(
                "below the quality floor" if name == "quality_floor" else
                f"quality not applicable ({basis.get('why', 'outputs differ')})" if name == "exactness" else
                f"output length {length.get('ratio', float('nan')):.2f}x the reference's, outside "
                f"{length.get('band')}" if name == "length_band" else name)
    if config.get("weights", "").startswith(Q4_1_SCHEME) and is_default_model(config.get("model", "")):
        row.notes.append("q4_1")
    return row


def summarize(study: optuna.Study) -> StudySummary:
    """Rows for every trial, with speedups vs the reference config and Pareto marks on feasible rows."""
    trials = study.get_trials(deepcopy=False)
    rows = [_row(t) for t in trials]
    reference = study.user_attrs.get("reference")
    ref_rows = [r for r in rows if r.config == reference and r.tok_s]
    if ref_rows:
        for r in rows:
            if r.speedup is None:  # unpaired (or an older study): two separate runs, no CI
                r.speedup = r.tok_s / ref_rows[0].tok_s if r.tok_s else None
    summary = StudySummary(study.study_name, study.user_attrs.get("mode", "constrained"),
                           str(study.user_attrs.get("floor")), study.user_attrs.get("floor_value", float("nan")),
                           reference, rows, length_band=study.user_attrs.get("length_band"))
    requeued = {t.system_attrs["failed_trial"]: t.number for t in trials if "failed_trial" in t.system_attrs}
    for r in rows:
        if r.state == "FAIL" and not r.reason and r.number in requeued:
            r.reason = f"its worker died (killed or heartbeat lost); re-queued as #{requeued[r.number]}"
    mark_front(summary.measured)
    summary.conditions = _conditions(next((t for t in trials if t.user_attrs.get("config") == reference
                                           and t.user_attrs.get("record")), None))
    if any("q4_1" in r.notes for r in rows):
        summary.notes["q4_1"] = f"{Q4_1_SCHEME} on the default model: {SMOLLM2.note}"
    return summary


def _conditions(trial: optuna.trial.FrozenTrial | None) -> str | None:
    """One line of the conditions every row shares: model, dtype, quality task, CPU and ISA, from the reference
    trial's run record (None without one)."""
    record = trial.user_attrs["record"] if trial else {}
    if "model" not in record:
        return None
    hardware, quality = record.get("hardware", {}), trial.user_attrs.get("quality") or {}
    model = record["model"]["model_id"]
    if model == DEFAULT_MODEL:
        model = f"{model} ({SMOLLM2.name})"
    return (f"model {model}, {record['engine']['config'].get('dtype', '?')}, quality on "
            f"{quality.get('task') or '?'}, {hardware.get('cpu', '?')} ({hardware.get('isa', '?')})")


def _speed_interval(r: Row) -> Interval:
    if r.speedup_ci and r.speedup is not None:
        return tuple(r.speedup_ci)
    value = r.speedup if r.speedup is not None else r.tok_s
    return value, value


def _quality_interval(r: Row) -> Interval:
    if r.ci and r.delta is not None:  # the paired accuracy delta's CI (same reference items for every row)
        return tuple(r.ci)
    return r.quality, r.quality


def mark_front(rows: list[Row]) -> None:
    """Among feasible rows: ``pareto`` on the point-estimate front; ``not_separable`` where a row is off that
    front but nothing beats it beyond both CIs (speedup CI, accuracy-delta CI)."""
    feasible = [r for r in rows if r.feasible]
    speed = [_speed_interval(r) for r in feasible]
    points = [(s, _quality_interval(r)) for r, s in zip(feasible, speed)]
    front = pareto_mask([((s[0] + s[1]) / 2, r.quality) for r, s in zip(feasible, speed)])
    dominated = separably_dominated(points)
    for r, on_front, beaten in zip(feasible, front, dominated):
        r.pareto, r.not_separable = on_front, not on_front and not beaten


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
    return f"{'yes' if r.exact['equal'] else 'NO'} {n_equal}/{r.exact['n_prompts']}"


def _basis_cell(r: Row) -> str:
    if not r.quality_basis:
        return ""
    kind = r.quality_basis.split(":", 1)[0]
    return {"exact by construction": "exact (constr.)", "infeasible": "[red]infeasible[/]"}.get(kind, kind)


def rich_table(summary: StudySummary) -> Table:
    table = Table(title=f"study {summary.name}: effective tok/s vs quality (floor {summary.floor}, {summary.mode}, "
                        f"length band {'-'.join(map(str, summary.length_band)) if summary.length_band else 'off'}); "
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
                      _fmt(r.length_ratio, ".2f"), _fmt(r.eot_rate, ".0%"), verdict,
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
    duplicates = sum(r.duplicate_of is not None for r in summary.rows)
    if duplicates:
        lines.append(f"{duplicates} trial(s) re-sampled an already measured config and reused its numbers")
    reasons: dict[str, list[int]] = {}
    for r in summary.skipped:
        reasons.setdefault(f"{r.state.lower()}: {r.reason or 'no reason recorded'}", []).append(r.number)
    lines += [f"{len(nums)} trial(s) {reason} (#{', #'.join(map(str, nums[:6]))}{', ...' if len(nums) > 6 else ''})"
              for reason, nums in reasons.items()]
    return lines


CSV_FIELDS = ("number", "state", "label", "backend", "tok_s", "tok_s_ci_low", "tok_s_ci_high", "speedup",
              "speedup_ci_low", "speedup_ci_high", "noisy", "rounds", "load", "not_separable", "quality", "accuracy", "delta", "ci_low",
              "ci_high", "flips", "kl", "alpha", "tau", "feasible", "pareto", "exact", "quality_basis", "length_ratio", "eot_rate",
              "duplicate_of", "reason", "notes")


def write_csv(summary: StudySummary, path: str | Path) -> Path:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for r in summary.rows:
        d = asdict(r)
        d["ci_low"], d["ci_high"] = (r.ci or [None, None])[:2]
        d["tok_s_ci_low"], d["tok_s_ci_high"] = (r.tok_s_ci or [None, None])[:2]
        d["speedup_ci_low"], d["speedup_ci_high"] = (r.speedup_ci or [None, None])[:2]
        d["exact"] = None if r.exact is None else r.exact["equal"]
        d["notes"] = ";".join(summary.notes.get(n, n) for n in r.notes)
        writer.writerow({k: d.get(k) for k in CSV_FIELDS})
    return _write_text_atomic(path, buf.getvalue())


def _write_text_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_json(summary: StudySummary, path: str | Path) -> Path:
    return write_json_atomic(path, summary.to_dict())


# How the plot marks a row that breaks a constraint (one overlay per broken constraint, so a row that fails two
# gates shows both) and one whose speed is noisy: constraint -> (legend text, marker style).
INFEASIBLE_MARKERS = {
    "quality_floor": ("infeasible: below the quality floor", dict(marker="v", ms=9, mfc="tab:red", mec="tab:red")),
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


def load_summary(storage_url: str, study_name: str | None) -> StudySummary:
    storage = open_storage(storage_url, read_only=True)
    names = optuna.get_all_study_names(storage)
    if study_name is None:
        if len(names) != 1:
            raise UserError(f"pass --study-name: the storage holds {len(names)} studies ({', '.join(names) or 'none'})")
        study_name = names[0]
    if study_name not in names:
        raise UserError(f"study {study_name!r} not found in {shown_url(storage_url)} (has: {', '.join(names) or 'none'})")
    return summarize(optuna.load_study(study_name=study_name, storage=storage))

