"""docs/dashboard.png: a headless-Chromium screenshot of optuna-dashboard (``quantspec dashboard``) on a study.

    .venv/bin/python bench/dashboard_screenshot.py [--study runs/demo/study.db] [--out docs/dashboard.png]

The study (default: the one ``quantspec demo`` writes) is copied first, and only the copy is touched: a study
stored before the search named its objectives (``set_metric_names``) and stored the flat user attributes
(``flat_attrs``) gets both, computed from the nested ``quality``/``speed`` attributes it has, as a search stores
them now. Needs chromium (Debian: ``apt-get install chromium``); nothing else in the project does.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from studies.dashboard import open_dashboard
from studies.objective import QualityResult, SpeedResult
from studies.search import METRIC_NAMES, flat_attrs
from runtime.argtypes import positive_int

MAX_BYTES = 300_000


def upgrade(path: Path) -> list[str]:
    """Metric names and flat attributes where the SQLite study at ``path`` lacks them; returns what was added.
    Optuna refuses to change a finished trial, so the flat attributes go into the copy's table directly."""
    url, added, rows = f"sqlite:///{path}", [], []
    for name in optuna.get_all_study_names(url):
        study = optuna.load_study(study_name=name, storage=url)
        if study.metric_names is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(METRIC_NAMES[study.user_attrs.get("mode", "constrained")])
            added.append(f"{name}: metric names {study.metric_names}")
        for trial in study.get_trials(states=(TrialState.COMPLETE,)):
            attrs = trial.user_attrs
            if "quality" not in attrs or "speed" not in attrs or "tok_s" in attrs:
                continue
            flat = {key: value for key, value in flat_attrs(_of(QualityResult, attrs["quality"]),
                                                            _of(SpeedResult, attrs["speed"])).items()
                    if key not in attrs}  # an older search stored some of them already
            rows += [(trial._trial_id, key, json.dumps(value)) for key, value in flat.items()]
            added.append(f"{name} #{trial.number}: {', '.join(flat)}")
    with sqlite3.connect(path) as db:
        db.executemany("INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (?, ?, ?)", rows)
    return added


def _of(cls, stored: dict):
    """A result dataclass from its stored dict, tuples restored, keys it does not know dropped."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in stored.items() if k in names})


def shoot(url: str, out: Path, page: str, budget_ms: int, size: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        sys.exit("no chromium on PATH: apt-get install chromium (Debian) or pass a machine that has it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile, open_dashboard(url, port=0) as server:
        target = server.url.removesuffix("/") + page
        print(f"dashboard: {target}")
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--screenshot={out}", f"--window-size={size}",
                        f"--virtual-time-budget={budget_ms}", target],
                       check=True, capture_output=True, timeout=120)


def shrink(path: Path) -> None:
    """A 256-colour palette PNG: the page is flat colours and lines, so it looks alike at a fraction of the size."""
    from PIL import Image

    image = Image.open(path).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="runs/demo/study.db", help="SQLite study file to show (copied)")
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--page", default="/studies/1", help="dashboard page under /dashboard")
    parser.add_argument("--budget-ms", type=positive_int, default=15000, help="Chromium's virtual time for the page to draw")
    parser.add_argument("--size", default="1400,1000", help="window WIDTH,HEIGHT")
    args = parser.parse_args()
    source = Path(args.study)
    if not source.is_file():
        sys.exit(f"no study file {source}: run `quantspec demo` (writes runs/demo/study.db) or pass --study FILE")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "study.db"
        shutil.copyfile(source, copy)
        for line in upgrade(copy):
            print(f"copy: added {line}")
        out = Path(args.out)
        shoot(f"sqlite:///{copy}", out, args.page, args.budget_ms, args.size)
    shrink(out)
    size = out.stat().st_size
    print(f"wrote {out} ({size / 1000:.0f} kB)")
    if size > MAX_BYTES:
        print(f"warning: over {MAX_BYTES // 1000} kB; pass a smaller --size", file=sys.stderr)


if __name__ == "__main__":
    main()
