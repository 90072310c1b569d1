"""List every number on the README and the results page with the JSON record it comes from.

    python bench/trace_numbers.py                 # README.md and bench/results/*.md; exit 1 if one is missing
    python bench/trace_numbers.py PAGE... --results DIR

A number counts when it stands alone in prose or a table cell; names and code (``w4g32``, ``bf16``,
``SmolLM2-135M``, anything in backticks or a link target) are not figures. A number is traced when some leaf
of a JSON file under the results dir prints as it (as an integer, with the page's decimals, as a percentage,
or in the short forms the renderer uses) in the JSON file named by the nearest heading above it; a number under
a heading that names no record is missing (the README carries no figures: it links to the results page).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "bench" / "results").glob("*.md")))
NUMBER = re.compile(r"(?<![\w.\-/=:#])[-−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.\-/]*\w)")
CODE = re.compile(r"`[^`]*`|\]\([^)]*\)|<[^>]*>")
SOURCE = re.compile(r"([\w.\-]+\.json)")


@dataclass
class Trace:
    page: str
    line: int
    number: str
    source: str | None  # "file.json:key.path", None when no record holds it


def leaves(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            if NUMBER.fullmatch(str(k)):  # numbers used as keys (context lengths, K)
                yield key, str(k)
            yield from leaves(v, key)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj
    elif isinstance(obj, str):  # numbers inside recorded strings (labels, notes, configs) are recorded too
        for m in NUMBER.finditer(obj):
            yield path, m.group(0)


def forms(value) -> set[str]:
    """Every way a page may print ``value``."""
    if isinstance(value, str):
        return {value}
    out = {str(value), f"{value:g}"}
    for scaled in (value / 1024, value / 2**20, value / 1e6, value / 1e9):  # bytes shown as KiB, MiB, MB, GB
        out |= {f"{scaled:.{d}f}" for d in range(4)} if abs(scaled) >= 1 else set()
    for d in range(5):
        out |= {f"{value:.{d}f}", f"{100 * value:.{d}f}"}
    if isinstance(value, float):
        out |= {f"{value:.1e}", f"{value:.2e}"}
    else:
        out |= {f"{value:,}", f"-{value}"}  # counts of losses print with a sign
    return {s.lstrip("+") for s in out} | {s.replace("-", "−") for s in out}


def index(results: Path) -> dict[str, dict[str, str]]:
    """file -> printed form -> first key path holding it."""
    out: dict[str, dict[str, str]] = {}
    for f in sorted(results.glob("*.json")):
        table: dict[str, str] = {}
        for path, value in leaves(json.loads(f.read_text())):
            for form in forms(value):
                table.setdefault(form, path)
        out[f.name] = table
    return out


def trace(page: Path, idx: dict[str, dict[str, str]]) -> list[Trace]:
    traces, fence, current = [], False, []
    shown = str(page.relative_to(ROOT) if page.resolve().is_relative_to(ROOT) else page)
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if line.startswith("#"):
            current = [s for s in SOURCE.findall(line) if s in idx]
        if fence or line.startswith("#"):
            continue
        for m in NUMBER.finditer(CODE.sub(" ", line)):
            token = m.group(0)
            order = current  # a number is traced to the record its section names; prose elsewhere carries none
            hit = next((f"{f}:{idx[f][token]}" for f in order if token in idx[f]), None)
            traces.append(Trace(shown, n, token, hit))
    return traces


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", type=Path, default=list(PAGES))
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--quiet", action="store_true", help="print only the numbers no record holds")
    args = ap.parse_args(argv)
    idx = index(args.results)
    traces = [t for p in args.pages for t in trace(p.resolve(), idx)]
    missing = [t for t in traces if t.source is None]
    for t in traces:
        if t.source is None or not args.quiet:
            print(f"{t.page}:{t.line}\t{t.number}\t<- {t.source or 'MISSING: no JSON record holds it'}")
    print(f"{len(traces)} numbers, {len(traces) - len(missing)} traced to a JSON record, {len(missing)} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
