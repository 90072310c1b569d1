"""``quantspec.quantize``: quantize a loaded model, measure its fidelity against the unquantized one on a few
fixed prompts, optionally write a compressed-tensors checkpoint, and describe the run as a record."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from evals.fidelity import FidelityStats, token_fidelity
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from quant.calibration import CalibConfig
from quant.methods import get_method
from quant.quantize import plan_layers, quantize_model, quantize_w8a8
from quant.rotation import check_rotation
from quant.scheme import WeightSpec, parse_scheme
from runtime.errors import UserError
from runtime.generate import Decoder, encode_prompt
from runtime.loading import DEFAULT_DTYPE, LoadedModel, load_model
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from runtime.sampling import SamplingConfig

FIDELITY_PROMPTS = ("What is the capital of France?", "Explain why the sky is blue in two sentences.",
                    "Write a haiku about autumn.")
FIDELITY_NEW_TOKENS = 32
Q4_1_GRID = WeightSpec(4, False, "group", 32)
INTEGER_ZERO_CAVEAT = ("; but compressed-tensors' integer zero points cannot express Q4_1's per-block offset "
                       "exactly, so trust the fidelity line above")

logger = logging.getLogger(__name__)


def fidelity_sequences(lm: LoadedModel) -> list[list[int]]:
    """Each prompt followed by the full-precision model's own greedy continuation (fixed length)."""
    seqs = []
    for prompt in FIDELITY_PROMPTS:
        ids = encode_prompt(lm.tokenizer, prompt)
        out = Decoder(lm, len(ids) + FIDELITY_NEW_TOKENS + 1).generate(ids, FIDELITY_NEW_TOKENS, SamplingConfig(),
                                                                       ignore_eos=True)
        seqs.append(ids + out.tokens)
    return seqs


def sequence_logits(lm: LoadedModel, seqs: list[list[int]]) -> torch.Tensor:
    return torch.cat([Decoder(lm, len(s) + 1).forward(s) for s in seqs])


def quant_record(model: str, lm: LoadedModel, report, fidelity: FidelityStats, caveat: str) -> RunRecord:
    return RunRecord(
        name="quantize",
        model=ModelCondition(model, weights_hash(lm.path), f"{report.scheme.label} ({report.dtype} activations"
                             + (f", rotated: {report.rotate})" if report.rotate else ")"),
                             scheme=report.scheme.label, note=caveat),
        hardware=hardware_info(lm.model),
        lengths=LengthDistribution(len(FIDELITY_PROMPTS), {"source": "chat prompts"},
                                   {"fixed": FIDELITY_NEW_TOKENS}, "built-in fidelity prompts", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"method": report.method, "rotate": report.rotate, "kernels": report.kernels,
                                          "simulated": report.simulated}),
        metric=MetricCondition(
            {"mean_kl": "mean over positions of KL(p_fp || p_quant), teacher-forced on the fp model's greedy text",
             "top1_agreement": "fraction of positions whose argmax tokens agree",
             "weight_rel_error": "||W - Ŵ||_F / ||W||_F per layer"},
            "none (a report, not a gate)"),
        results={"report": report.to_dict(), "fidelity": fidelity.__dict__},
    )


@dataclass
class Quantized:
    """What ``quantize`` returns: the quantized model (in place), the per-layer report, fidelity vs the
    unquantized model, a caveat to print (or ""), the checkpoint dir written (or None) and the run record."""
    model: LoadedModel
    report: object  # quant.quantize.QuantReport
    fidelity: FidelityStats
    caveat: str
    checkpoint: Path | None
    record: RunRecord


def quantize(model: str | LoadedModel, scheme: str, method: str = "rtn", calib: CalibConfig | None = None,
             out: Path | str | None = None, overwrite: bool = False, dtype: str = DEFAULT_DTYPE,
             rotate: str | None = None) -> Quantized:
    """Quantize ``model``'s Linear layers with ``scheme`` (preset like W4A16 or label like w4g32-asym) and weight
    ``method`` (rtn, mse, gptq, awq or a registered one); ``calib`` for methods (and NVFP4 activations) that need
    calibration (default: wikitext2, 128 x 512); ``rotate`` (``hadamard``) rotates the model first (quant/rotation.py);
    ``out``: also write a compressed-tensors checkpoint there."""
    parsed = parse_scheme(scheme)
    weight_method = get_method(method, parsed.weights)
    check_rotation(rotate, method, parsed)
    out = Path(out) if out is not None else None
    if out is not None and out.exists() and not overwrite:
        raise UserError(f"output dir {out} already exists; pass --overwrite or choose another --output-dir")
    name = model if isinstance(model, str) else str(model.path)
    lm = load_model(model, dtype) if isinstance(model, str) else model
    plan_layers(lm, parsed)  # refuse bad group sizes / nothing to quantize before any model work
    seqs = fidelity_sequences(lm)
    logger.info("reference logits for fidelity (%d sequences)", len(seqs))
    ref_logits = sequence_logits(lm, seqs)
    if weight_method.needs_calibration:
        logger.info("collecting calibration statistics for %s (%s)", method, (calib or CalibConfig()).label)
    if parsed.static_activations:  # calibrated input scales (mse observer)
        report = quantize_w8a8(lm, parsed, method, calib)
    else:
        needs = weight_method.needs_calibration or parsed.calibrated_global
        report = quantize_model(lm, parsed, method, (calib or CalibConfig()) if needs else None, rotate=rotate)
    logger.info("fidelity of the quantized model")
    fidelity = token_fidelity(ref_logits, sequence_logits(lm, seqs))
    caveat = SMOLLM2.note + INTEGER_ZERO_CAVEAT if is_default_model(lm.path) and parsed.weights == Q4_1_GRID else ""
    written = None
    if out is not None:
        from quant.checkpoint import save_compressed  # compressed-tensors: imported only when writing a checkpoint

        logger.info("writing the compressed-tensors checkpoint to %s", out)
        written = save_compressed(lm, report, out, overwrite)
    return Quantized(lm, report, fidelity, caveat, written, quant_record(name, lm, report, fidelity, caveat))
