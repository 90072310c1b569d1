"""The speed/quality table of a study (rich), its CSV/JSON export and the Pareto plot (matplotlib, Agg)."""
from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna
from rich.table import Table

from evals.record import write_json_atomic
from runtime.model_store import SMOLLM2, is_default_model
from runtime.errors import UserError
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
    speedup: float | None = None  # vs the reference config (unquantized, no speculation)
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
    exact: dict | None = None  # greedy-output equality of a speculative config vs its non-speculative twin
    quality_basis: str | None = None  # measured | exact by construction | verified | infeasible: why
    length_ratio: float | None = None  # mean output tokens (natural end-of-turn) / the reference's
    eot_rate: float | None = None  # share of outputs that ended at end-of-turn before the limit
    infeasible_because: list[str] = field(default_factory=list)  # the constraints it breaks
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

    @property
    def measured(self) -> list[Row]:
        """Distinct measured configurations, fastest first (duplicates reuse an earlier row)."""
        rows = [r for r in self.rows if r.state == "COMPLETE" and r.tok_s is not None and r.duplicate_of is None]
        return sorted(rows, key=lambda r: -r.tok_s)

    @property
    def skipped(self) -> list[Row]:
        return [r for r in self.rows if r.state in ("PRUNED", "FAIL")]

    def to_dict(self) -> dict:
        return {"study": self.name, "mode": self.mode, "floor": self.floor, "floor_value": self.floor_value,
                "reference": self.reference, "length_band": self.length_band or "off",
                "notes": self.notes, "rows": [asdict(r) for r in self.rows]}


def pareto_mask(points: list[tuple[float, float]]) -> list[bool]:
    """True where no other point is >= in both coordinates and > in one (both maximised)."""
    return [not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points) for p in points]


def _row(trial: optuna.trial.FrozenTrial) -> Row:
    attrs = trial.user_attrs
    config = attrs.get("config") or {}
    quality, speed = attrs.get("quality") or {}, attrs.get("speed") or {}
    constraints = trial.constraints or {}
    basis, length = attrs.get("quality_basis") or {}, attrs.get("length") or {}
    row = Row(
        number=trial.number, state=trial.state.name, label=attrs.get("label", ""),
        backend=config.get("backend", ""), config=config, tok_s=speed.get("tok_s"),
        quality=quality.get("value"), accuracy=quality.get("accuracy"), delta=quality.get("delta"),
        ci=quality.get("ci"), flips=quality.get("flips"), kl=quality.get("kl"),
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
            r.speedup = r.tok_s / ref_rows[0].tok_s if r.tok_s else None
    summary = StudySummary(study.study_name, study.user_attrs.get("mode", "constrained"),
                           str(study.user_attrs.get("floor")), study.user_attrs.get("floor_value", float("nan")),
                           reference, rows, length_band=study.user_attrs.get("length_band"))
    requeued = {t.system_attrs["failed_trial"]: t.number for t in trials if "failed_trial" in t.system_attrs}
    for r in rows:
        if r.state == "FAIL" and not r.reason and r.number in requeued:
            r.reason = f"its worker died (killed or heartbeat lost); re-queued as #{requeued[r.number]}"
    feasible = [r for r in summary.measured if r.feasible]
    if summary.mode == "pareto":
        front = {t.number for t in study.best_trials}
        for r in feasible:
            r.pareto = r.number in front
    else:
        for r, on_front in zip(feasible, pareto_mask([(r.tok_s, r.quality) for r in feasible])):
            r.pareto = on_front
    if any("q4_1" in r.notes for r in rows):
        summary.notes["q4_1"] = f"{Q4_1_SCHEME} on the default model: {SMOLLM2.note}"
    return summary


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
                        "* = Pareto-optimal among feasible rows", title_justify="left")
    for col, justify in (("", "center"), ("#", "right"), ("config", "left"), ("backend", "left"),
                         ("tok/s", "right"), ("speedup", "right"), ("acc % (Δ [CI])", "right"), ("flips", "right"),
                         ("KL", "right"), ("α / τ", "right"), ("greedy =", "right"), ("quality", "left"),
                         ("len ×ref", "right"), ("EOT", "right"), ("feasible", "center")):
        table.add_column(col, justify=justify)
    for r in summary.measured:
        label = r.label + ("  †" if "q4_1" in r.notes else "")
        verdict = "" if r.feasible is None else ("[green]pass[/]" if r.feasible else "[red]fail[/]")
        spec = f"{r.alpha:.2f} / {r.tau:.2f}" if r.alpha is not None and r.tau is not None else ""
        table.add_row("*" if r.pareto else "", str(r.number), label, r.backend, _fmt(r.tok_s, ".1f"),
                      _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""), _accuracy_cell(r),
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
    duplicates = sum(r.duplicate_of is not None for r in summary.rows)
    if duplicates:
        lines.append(f"{duplicates} trial(s) re-sampled an already measured config and reused its numbers")
    reasons: dict[str, list[int]] = {}
    for r in summary.skipped:
        reasons.setdefault(f"{r.state.lower()}: {r.reason or 'no reason recorded'}", []).append(r.number)
    lines += [f"{len(nums)} trial(s) {reason} (#{', #'.join(map(str, nums[:6]))}{', ...' if len(nums) > 6 else ''})"
              for reason, nums in reasons.items()]
    return lines


CSV_FIELDS = ("number", "state", "label", "backend", "tok_s", "speedup", "quality", "accuracy", "delta", "ci_low",
              "ci_high", "flips", "kl", "alpha", "tau", "feasible", "pareto", "exact", "quality_basis", "length_ratio", "eot_rate",
              "duplicate_of", "reason", "notes")


def write_csv(summary: StudySummary, path: str | Path) -> Path:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for r in summary.rows:
        d = asdict(r)
        d["ci_low"], d["ci_high"] = (r.ci or [None, None])[:2]
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


def write_png(summary: StudySummary, path: str | Path) -> Path:
    """Scatter of tok/s vs quality: feasible points coloured, infeasible grey, the Pareto front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary.measured if r.quality is not None]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    bad = [r for r in rows if not r.feasible]
    good = [r for r in rows if r.feasible]
    ax.scatter([r.tok_s for r in bad], [r.quality for r in bad], c="lightgrey", edgecolors="grey",
               label="below floor (infeasible)")
    ax.scatter([r.tok_s for r in good], [r.quality for r in good], c="tab:blue", label="feasible")
    front = sorted((r for r in good if r.pareto), key=lambda r: r.tok_s)
    if front:
        ax.plot([r.tok_s for r in front], [r.quality for r in front], "-o", c="tab:orange", label="Pareto front")
    for r in front:
        ax.annotate(r.label, (r.tok_s, r.quality), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(summary.floor_value, ls="--", c="tab:red", lw=1, label=f"floor {summary.floor}")
    ax.set_xlabel("effective output tokens / s")
    ax.set_ylabel("quality (>= floor passes the paired floor verdict)")
    ax.set_title(f"{summary.name}: speed vs quality")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
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

