"""Calibrated quantizations kept on disk, so GPTQ / AWQ calibration is paid once per configuration, not once per
process: a search's speed run after its quality eval in another process, a second ``quantspec eval``, a second search.

An entry is what a calibrated method made of one checkpoint, independent of the kernels that will run it:
  * each quantized layer's codes, scales, zero points (and NVFP4 global scales): ``QuantResult`` as the method
    returned it;
  * the errors measured when it was made and each layer's method diagnostics;
  * the full-precision tensors the method's transform rewrote (AWQ's folded scales);
  * the calibrated input global scales (NVFP4 activations).
It is one safetensors file plus a JSON sidecar in a directory under ``$QUANTSPEC_HOME/quantized/`` (or
``$QUANTSPEC_QUANT_STORE``), written atomically (temp dir + rename).

The key covers everything that changes the result:
  * the checkpoint's files (weights, config, tokenizer), dtype, scheme, method, rotation;
  * the calibration text's content (``CalibConfig.fingerprint``);
  * torch's version and the source of the code that computes it.
Editing a method therefore makes new entries rather than serving stale ones.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from quant.methods.base import QuantResult
from runtime.hardware import quantspec_home
from runtime.model_store import weights_hash_once

log = logging.getLogger(__name__)
STORE_ENV = "QUANTSPEC_QUANT_STORE"
# the modules whose source decides a calibrated result (the method's own module is added per key)
CODE = ("quant.quantize", "quant.calibration", "quant.qmath", "quant.rotation", "quant.folding", "quant.methods.base",
        "runtime.transformer")


@dataclass
class Calibrated:
    """What a calibrated method made of a model's quantized layers (see the module docstring)."""

    results: dict[str, QuantResult]
    errors: dict[str, tuple[float, float | None, float]]  # per layer: weight and output relative error, seconds
    changed: dict[str, torch.Tensor] = field(default_factory=dict)  # fp parameters the transform rewrote
    input_global_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    transform: dict = field(default_factory=dict)
    calibration: str | None = None


def store_dir() -> Path:
    return Path(os.environ.get(STORE_ENV) or quantspec_home() / "quantized")


@functools.lru_cache(maxsize=16)
def _source_digest(modules: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in modules:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.hexdigest()


def entry_key(checkpoint: Path, dtype: str, scheme: str, method, calib, rotate: str | None) -> str:
    """The key of a calibrated quantization of ``checkpoint`` (``method``: the ``WeightMethod`` object)."""
    files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(checkpoint).iterdir())
             if f.is_file() and f.suffix != ".safetensors"}  # config, tokenizer
    code = _source_digest((*CODE, type(method).__module__))
    blob = json.dumps([weights_hash_once(checkpoint), files, dtype, scheme, method.name, vars(method),
                       calib.fingerprint if calib is not None else None, rotate, torch.__version__, code],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load(key: str) -> Calibrated | None:
    """The entry stored under ``key``, or None (absent or unreadable: it is made again)."""
    entry = store_dir() / key
    try:
        meta = json.loads((entry / "meta.json").read_text())
        tensors = load_file(entry / "tensors.safetensors")
        results = {name: QuantResult(tensors[f"q.{name}"], tensors[f"scale.{name}"], tensors[f"zero.{name}"],
                                     layer["info"], tensors.get(f"global.{name}"))
                   for name, layer in meta["layers"].items()}
        errors = {name: tuple(layer["errors"]) for name, layer in meta["layers"].items()}
    except (OSError, ValueError, KeyError, SafetensorError):
        return None
    pick = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
    return Calibrated(results, errors, pick("changed."), pick("input_global."), meta["transform"],
                      meta["calibration"])


def save(key: str, calibrated: Calibrated) -> Path | None:
    """Write ``calibrated`` under ``key`` atomically; an entry another process wrote meanwhile is kept. Where the
    store cannot be written: None and one warning (the result is used, only not kept)."""
    target = store_dir() / key
    tensors = {}
    for name, r in calibrated.results.items():
        tensors |= {f"q.{name}": r.q, f"scale.{name}": r.scale, f"zero.{name}": r.zero}
        if r.global_scale is not None:
            tensors[f"global.{name}"] = r.global_scale
    tensors |= {f"changed.{k}": v for k, v in calibrated.changed.items()}
    tensors |= {f"input_global.{k}": v for k, v in calibrated.input_global_scales.items()}
    meta = {"layers": {name: {"info": r.info, "errors": calibrated.errors[name]}
                       for name, r in calibrated.results.items()},
            "transform": calibrated.transform, "calibration": calibrated.calibration}
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key}.tmp-"))
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / "tensors.safetensors")
        (tmp / "meta.json").write_text(json.dumps(meta, default=float))
        tmp.rename(target)
    except OSError as exc:
        if not (target / "meta.json").exists():
            log.warning("calibrated quantization not kept in %s (%s): set %s to a writable directory",
                        target.parent, exc, STORE_ENV)
            return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
