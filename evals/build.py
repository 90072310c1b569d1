"""The one native builder: ``Config`` -> loaded, quantized model + KV-cache factory, and the weights-hash memo.

Every native path (lm-eval scoring, fidelity, the native serving backend, a search trial) builds its model here:
load -> quantize (``quantize_fresh``; static activation scales and SmoothQuant through ``quantize_w8a8``) ->
KV cache factory (static KV scales calibrated on the calibration set when the spec asks for them). A quantized point
leaves this process as a compressed-tensors checkpoint quantized by the same builder (``exported_checkpoint``,
``as_checkpoint``): the weights vLLM serves and lm-eval's ``vllm`` model scores.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from evals.config import Config
from quant.calibration import CalibConfig, calibration_batches
from quant.kvcache import calibrate_kv_scales, make_cache_factory
from quant.quantize import QuantReport, quantize_fresh, quantize_w8a8
from runtime.hardware import quantspec_home
from runtime.loading import LoadedModel, load_model
from runtime.model_store import resolve_model, weights_hash, weights_hash_once


@dataclass
class Built:
    """What ``build_native`` returns: the model, its KV-cache factory (None = dense cache), the quant report."""

    lm: LoadedModel
    cache_factory: object = None
    report: QuantReport | None = None

    @property
    def scheme_info(self) -> str:
        return self.report.scheme.label if self.report else "bf16"


def build_native(config: Config, threads: int | None = None, progress: bool = False) -> Built:
    """Load ``config.model`` in ``config.dtype``, quantize it as ``config`` says, make its KV cache factory."""
    if config.attention is None:
        lm = load_model(config.model, config.dtype, threads, device=config.device)
    else:
        lm = load_model(config.model, config.dtype, threads, config.attention, config.device)
    report = quantize(lm, config, progress)
    return Built(lm, kv_cache_factory(lm, config), report)


def quantize(lm: LoadedModel, config: Config, progress: bool = False) -> QuantReport | None:
    """Quantize ``lm`` in place per ``config`` (None when its weights stay unquantized)."""
    if not config.quantized_weights:
        return None
    if config.needs_w8a8_path:
        return quantize_w8a8(lm, config.scheme, config.method, config.calib, observer=config.observer,
                             smoothquant=config.smoothquant, progress=progress)
    return quantize_fresh(lm, config.scheme, config.method, config.calib, progress=progress, rotate=config.rotate)


def kv_cache_factory(lm: LoadedModel, config: Config):
    """The KV-cache factory of ``config`` for ``lm`` (static scales calibrated on ``lm`` when needed)."""
    if config.kv_spec is None:
        return None
    scales = None
    if config.needs_kv_calibration:
        batches = calibration_batches(config.calib or CalibConfig(samples=8), lm)
        scales = calibrate_kv_scales(lm.model, [torch.tensor([b], device=lm.device) for b in batches], config.kv_spec)
    return make_cache_factory(config.kv_spec, scales)


def exported_checkpoint(config: Config) -> Path:
    """The compressed-tensors export of the point's weights transformation, made once and cached under all that
    changes the weights (scheme, method, calibration set, rotation, SmoothQuant, observer: ``Config.method_key``).

    The one builder quantizes it (``quantize``) from the model's bf16 weights, exactly as the native backend
    does, so every engine that loads the export serves the same integer weights."""
    source = resolve_model(config.model)
    weights = hashlib.sha1(config.method_key.encode()).hexdigest()[:10]
    target = quantspec_home() / "exports" / f"{weights_hash(source)}-{config.scheme.label}-{config.method}-{weights}"
    if (target / "config.json").exists():
        return target
    lm = load_model(source, "bf16")
    report = quantize(lm, config)
    from quant.checkpoint import save_compressed  # compressed-tensors: imported only when exporting

    return save_compressed(lm, report, target)


def as_checkpoint(config: Config) -> Config:
    """``config`` with its quantized weights replaced by their compressed-tensors export: the point as vLLM
    loads it (and as the native builder can load it too, so both serve the same integer weights)."""
    if not config.quantized_weights:
        return config
    return replace(config, model=str(exported_checkpoint(config)), weights="none", activations="none", method=None,
                   rotate=None)


def model_weights_hash(model: str) -> str:
    """``weights_hash`` of a model argument, computed once per process and checkpoint version."""
    return weights_hash_once(resolve_model(model))
