"""A study summarized: one row per trial, the Pareto front among feasible rows, the CSV/JSON export (the table and
the plot are drawn in quantspec/report.py)."""
from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna

from evals.floor import how_to_decide
from evals.record import write_json_atomic
from runtime.model_store import DEFAULT_MODEL, SMOLLM2, is_default_model
from runtime.errors import UserError
from runtime.measure import load_line
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
    length_ci: tuple[float, float] | None = None  # its paired 95% interval (None: one prompt)
    length_verdict: str | None = None  # pass | fail | undecidable | off (``studies.length_gate``) | not measured
    eot_rate: float | None = None  # share of outputs that ended at end-of-turn before the limit
    infeasible_because: list[str] = field(default_factory=list)  # the constraints it breaks
    failed_constraints: list[str] = field(default_factory=list)  # their names: quality_floor, exactness, length_band
    task: str | None = None  # the quality task (the worst one when several)
    step: str | None = None  # the native decode step its speed ran on (eager, compiled (MODE), eager (fallback: why))
    compile_s: float | None = None  # that step's one-time build, apart from its speed
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
    def steps(self) -> list[str]:
        """The decode steps the measured rows ran on, as records say them (one, unless a step fell back)."""
        return list(dict.fromkeys(r.step for r in self.measured if r.step))

    @property
    def compile_s(self) -> float:
        """Seconds the measured rows' compiled steps took to build (one-time; in none of their speeds)."""
        return sum(r.compile_s or 0.0 for r in self.measured)

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


def _floor_reason(quality: dict) -> str:
    """Why a row fails the quality floor: below it, or undecidable at the items scored (``QualityResult``)."""
    if quality.get("decidable", True):
        return "below the quality floor"
    return ("quality floor undecidable at these items (even the reference's answers could not pass it); "
            f"{how_to_decide(quality.get('items_to_decide'))}")


def _row(trial: optuna.trial.FrozenTrial) -> Row:
    attrs = trial.user_attrs
    config = attrs.get("config") or {}
    quality, speed = attrs.get("quality") or {}, attrs.get("speed") or {}
    constraints = trial.constraints or {}
    basis, length = attrs.get("quality_basis") or {}, attrs.get("length") or {}
    engine = ((attrs.get("record") or {}).get("engine") or {}).get("config") or {}
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
        length_ci=tuple(length["ratio_ci"]) if length.get("ratio_ci") else None, length_verdict=length.get("verdict"),
        duplicate_of=attrs.get("duplicate_of"), step=engine.get("step"), compile_s=engine.get("compile_s"),
        reason=attrs.get("pruned_reason") or attrs.get("error") or attrs.get("stale") or attrs.get("surplus"),
    )
    for name, value in constraints.items():
        if value > 0:
            row.failed_constraints.append(name)
            row.infeasible_because.append(
                _floor_reason(quality) if name == "quality_floor" else
                f"quality not applicable ({basis.get('why', 'outputs differ')})" if name == "exactness" else
                f"{length.get('text') or 'output length'}, outside {length.get('band')}" if name == "length_band"
                else name)
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


CSV_FIELDS = ("number", "state", "label", "backend", "tok_s", "tok_s_ci_low", "tok_s_ci_high", "speedup",
              "speedup_ci_low", "speedup_ci_high", "noisy", "rounds", "load", "not_separable", "quality", "accuracy", "delta", "ci_low",
              "ci_high", "flips", "kl", "alpha", "tau", "feasible", "pareto", "exact", "quality_basis", "length_ratio",
              "length_ci_low", "length_ci_high", "length_verdict", "eot_rate", "duplicate_of", "reason", "notes")


def write_csv(summary: StudySummary, path: str | Path) -> Path:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for r in summary.rows:
        d = asdict(r)
        d["ci_low"], d["ci_high"] = (r.ci or [None, None])[:2]
        d["tok_s_ci_low"], d["tok_s_ci_high"] = (r.tok_s_ci or [None, None])[:2]
        d["speedup_ci_low"], d["speedup_ci_high"] = (r.speedup_ci or [None, None])[:2]
        d["length_ci_low"], d["length_ci_high"] = r.length_ci or (None, None)
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

