"""Eval results cached on disk so re-running a configuration is free.

One JSON file per (model weights hash, scheme, method, KV spec, backend, dtype, task, limit, fewshot) under
``$QUANTSPEC_HOME/eval-cache/`` (or ``$QUANTSPEC_EVAL_CACHE``), written atomically. Bump ``CACHE_VERSION`` when scoring changes.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from evals.record import write_json_atomic
from runtime.hardware import quantspec_home

CACHE_VERSION = 2  # 2: per-item answers stored beside the metric


@dataclass(frozen=True)
class CacheKey:
    weights_hash: str
    scheme: str
    method: str
    kv: str
    backend: str
    dtype: str
    task: str
    limit: int | None
    fewshot: int

    def digest(self) -> str:
        blob = json.dumps({"v": CACHE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTSPEC_EVAL_CACHE") or quantspec_home() / "eval-cache")


def cache_path(key: CacheKey) -> Path:
    return cache_dir() / f"{key.task}-{key.digest()}.json"


def load(key: CacheKey) -> dict | None:
    path = cache_path(key)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())["value"]
    except (json.JSONDecodeError, KeyError):
        return None  # a corrupt entry is recomputed


def store(key: CacheKey, value: dict) -> Path:
    return write_json_atomic(cache_path(key), {"key": asdict(key), "version": CACHE_VERSION, "value": value})
