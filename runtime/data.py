"""Find the offline eval data dir and read prompt sets from it.

Order: ``--data-dir`` option, ``QUANTSPEC_DATA_DIR``, then ``../shared/data`` next to the checkout or the
current directory. Online users without a data dir get the same tasks from the hub via lm-eval/datasets.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_FILES = {"spec_bench": "prompts/spec_bench_question.jsonl", "mt_bench": "prompts/mt_bench_question.jsonl"}


def find_data_dir(option: str | Path | None = None, required: bool = True) -> Path | None:
    """The data dir to use, or None when none is configured and ``required`` is False."""
    explicit = option or os.environ.get("QUANTSPEC_DATA_DIR")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_dir():
            source = "--data-dir" if option else "QUANTSPEC_DATA_DIR"
            raise UserError(f"data dir {path} (from {source}) does not exist; point it at a copy of shared/data")
        return path
    for candidate in (REPO_ROOT.parent / "shared" / "data", REPO_ROOT / "shared" / "data",
                      Path.cwd().parent / "shared" / "data"):  # beside the checkout (CI) or linked into it
        if candidate.is_dir():
            return candidate
    if required:
        raise UserError("no eval data dir found: pass --data-dir or set QUANTSPEC_DATA_DIR (e.g. ../shared/data)")
    return None


def data_file(relative: str, data_dir: str | Path | None = None) -> Path:
    """A file inside the data dir; a missing one names where it was looked for."""
    root = find_data_dir(data_dir)
    path = root / relative
    if not path.exists():
        raise UserError(f"missing data file {relative} (looked in {root}); check the data dir")
    return path


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object per non-empty line; a line that is not one is a UserError naming it."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{number}: not JSON ({exc.msg}); write one JSON object per line") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{number}: expected a JSON object like {{\"prompt\": \"...\"}}, "
                                f"got {type(row).__name__}")
            rows.append(row)
    return rows


def load_prompts(source: str, data_dir: str | Path | None = None, limit: int | None = None) -> list[str]:
    """First-turn prompts from ``spec_bench``, ``mt_bench`` or a JSONL path (keys ``prompt``/``text``/``turns``)."""
    if limit is not None and limit <= 0:
        raise UserError(f"--num-prompts must be >= 1, got {limit}")
    if source in PROMPT_FILES:
        rows = read_jsonl(data_file(PROMPT_FILES[source], data_dir))
    else:
        path = Path(source)
        if not path.exists():
            raise UserError(f"prompt source {source!r} is neither {', '.join(PROMPT_FILES)} nor an existing JSONL file")
        rows = read_jsonl(path)
    prompts = []
    for row in rows:
        text = row.get("prompt") or row.get("text") or (row.get("turns") or [None])[0]
        if text is None:
            raise UserError(f"{source}: row without a prompt/text/turns field: {str(row)[:80]}")
        prompts.append(text)
    if not prompts:
        raise UserError(f"{source} holds no prompts: write one JSON object per line with a prompt, text or turns "
                        "field")
    return prompts[:limit] if limit else prompts
