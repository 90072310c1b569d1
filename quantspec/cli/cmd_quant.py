"""``quantspec quantize``: quantize a model, report size/time/kernels/fidelity, write a compressed-tensors dir."""
from __future__ import annotations

from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from evals.fidelity import FidelityStats, token_fidelity
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime.errors import UserError
from runtime.hardware import hardware_line
from runtime.loading import LoadedModel, load_model
from quant.methods import get_method
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from quant.scheme import WeightSpec, parse_scheme
from runtime.generate import Decoder, encode_prompt
from runtime.sampling import SamplingConfig
from quantspec.cli.app import DataDirOption, app
from quant.calibration import CalibConfig
from quant.checkpoint import save_compressed
from quant.quantize import plan_layers, quantize_model

console = Console()
FIDELITY_PROMPTS = ("What is the capital of France?", "Explain why the sky is blue in two sentences.",
                    "Write a haiku about autumn.")
FIDELITY_NEW_TOKENS = 32
Q4_1_GRID = WeightSpec(4, False, "group", 32)
INTEGER_ZERO_CAVEAT = ("; but compressed-tensors' integer zero points cannot express Q4_1's per-block offset "
                       "exactly, so trust the fidelity line above")


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


def print_report(report, fidelity: FidelityStats, out: Path | None, caveat: str) -> None:
    table = Table(title=f"{report.scheme.label} via {report.method} ({report.dtype} activations), "
                        f"{len(report.layers)} layers quantized, {len(report.dense)} kept dense")
    for col in ("kernel", "layers", "real low-bit", "weight MiB before", "MiB after", "mean rel. weight error"):
        table.add_column(col, justify="right")
    for kernel, count in report.kernels.items():
        rows = [layer for layer in report.layers if layer.kernel == kernel]
        table.add_row(kernel, str(count), "no (simulated)" if rows[0].simulated else "yes",
                      f"{sum(r.bytes_before for r in rows) / 2**20:.1f}", f"{sum(r.bytes_after for r in rows) / 2**20:.1f}",
                      f"{sum(r.weight_rel_error for r in rows) / len(rows):.4f}")
    console.print(table)
    console.print(f"quantized Linear weights {report.bytes_before / 2**20:.1f} -> {report.bytes_after / 2**20:.1f} MiB "
                  f"({report.bytes_before / report.bytes_after:.2f}x smaller) in {report.seconds:.1f} s"
                  + (f"; calibration {report.calibration}" if report.calibration else ""))
    console.print(f"fidelity vs unquantized on {fidelity.n_tokens} tokens of {len(FIDELITY_PROMPTS)} prompts: "
                  f"mean KL {fidelity.mean_kl:.4f} nats, p99 KL {fidelity.p99_kl:.4f}, "
                  f"top-1 agreement {100 * fidelity.top1_agreement:.1f}%")
    if report.simulated:
        console.print("[yellow]simulated:[/] layers on the 'simulated' kernel run a dequantized weight; "
                      "their speed is not a low-bit speed")
    if caveat:
        console.print(f"[yellow]note:[/] {caveat}")
    if out is not None:
        console.print(f"compressed-tensors checkpoint: {out}")


def quant_record(model: str, lm: LoadedModel, report, fidelity: FidelityStats, caveat: str) -> RunRecord:
    return RunRecord(
        name="quantize",
        model=ModelCondition(model, weights_hash(lm.path), f"{report.scheme.label} ({report.dtype} activations)",
                             scheme=report.scheme.label, note=caveat),
        hardware=hardware_info(lm.model),
        lengths=LengthDistribution(len(FIDELITY_PROMPTS), {"source": "chat prompts"},
                                   {"fixed": FIDELITY_NEW_TOKENS}, "built-in fidelity prompts", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"method": report.method, "kernels": report.kernels,
                                          "simulated": report.simulated}),
        metric=MetricCondition(
            {"mean_kl": "mean over positions of KL(p_fp || p_quant), teacher-forced on the fp model's greedy text",
             "top1_agreement": "fraction of positions whose argmax tokens agree",
             "weight_rel_error": "||W - Ŵ||_F / ||W||_F per layer"},
            "none (a report, not a gate)"),
        results={"report": report.to_dict(), "fidelity": fidelity.__dict__},
    )


@app.command()
def quantize(
    model: str = typer.Argument(..., help="`default`, a local HF dir, or a hub id."),
    scheme: str = typer.Option(..., "--scheme", "-s", help="Preset (W8A16, W4A16, W8A8, ...) or label (w4g32-asym)."),
    method: str = typer.Option("rtn", help="Weight method: rtn, mse, gptq, awq."),
    calib: str = typer.Option("wikitext2", help="Calibration text: wikitext2, self, or PATH.jsonl."),
    calib_samples: int = typer.Option(128, "--calib-samples"),
    calib_seqlen: int = typer.Option(512, "--calib-seqlen"),
    out: Path = typer.Option(None, "--out", "-o", help="Write a compressed-tensors checkpoint here."),
    overwrite: bool = typer.Option(False, help="Replace an existing --out dir."),
    dtype: str = typer.Option("bf16", help="Activation / dense-weight dtype: bf16 (real kernels) or fp32."),
    json_out: Path = typer.Option(None, "--json", help="Write a run record here."),
    data_dir: str = DataDirOption,
):
    """Quantize MODEL's Linear layers, print size, time, kernels and fidelity, optionally export."""
    parsed = parse_scheme(scheme)
    weight_method = get_method(method)
    calib_cfg = CalibConfig(calib, calib_samples, calib_seqlen, data_dir=data_dir)
    if out is not None and out.exists() and not overwrite:
        raise UserError(f"output dir {out} already exists; pass --overwrite or choose another --out")
    lm = load_model(model, dtype)
    plan_layers(lm, parsed)  # refuse bad group sizes / nothing to quantize before any model work
    seqs = fidelity_sequences(lm)
    ref_logits = sequence_logits(lm, seqs)
    report = quantize_model(lm, parsed, method, calib_cfg if weight_method.needs_calibration else None)
    fidelity = token_fidelity(ref_logits, sequence_logits(lm, seqs))
    caveat = SMOLLM2.note + INTEGER_ZERO_CAVEAT if is_default_model(lm.path) and parsed.weights == Q4_1_GRID else ""
    written = save_compressed(lm, report, out, overwrite) if out is not None else None
    print_report(report, fidelity, written, caveat)
    console.print(f"[dim]{hardware_line(lm.model)}[/]")
    if json_out is not None:
        quant_record(model, lm, report, fidelity, caveat).write(json_out)
        console.print(f"run record: {json_out}")
