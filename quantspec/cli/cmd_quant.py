"""``quantspec quantize``: quantize a model, report size/time/kernels/fidelity, write a compressed-tensors dir."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

import quantspec
from evals.fidelity import FidelityStats
from evals.quant_report import FIDELITY_PROMPTS
from quant.calibration import CalibConfig
from runtime.hardware import hardware_line
from quantspec.cli.app import DataDirOption, ModelArgument, ModelOption, OutputPathOption, app, flag, pick_model

console = Console()


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


@app.command()
def quantize(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    scheme: str = typer.Option(..., "--scheme", "-s", help="Preset (W8A16, W4A16, W8A8, ...) or label (w4g32-asym)."),
    method: str = typer.Option("rtn", help="Weight method: rtn, mse, gptq, awq."),
    calib: str = typer.Option("wikitext2", help="Calibration text: wikitext2, self, or PATH.jsonl."),
    calib_samples: int = typer.Option(128, "--calib-samples"),
    calib_seqlen: int = typer.Option(512, "--calib-seqlen"),
    out: Path = typer.Option(None, "--output-dir", "--out", show_default=False,
                             help="Write a compressed-tensors checkpoint here (llm-compressor's output_dir)."),
    overwrite: bool = flag("--overwrite", help="Replace an existing --output-dir."),
    dtype: str = typer.Option(quantspec.DEFAULT_DTYPE, "--dtype", help=f"Activation / dense-weight dtype: bf16 (real "
                              f"kernels) or fp32 (default {quantspec.DEFAULT_DTYPE}, every command)."),
    json_out: str = OutputPathOption,
    data_dir: str = DataDirOption,
):
    """Quantize MODEL's Linear layers, print size, time, kernels and fidelity, optionally export."""
    model = pick_model(model, model_option)
    q = quantspec.quantize(model, scheme, method, CalibConfig(calib, calib_samples, calib_seqlen, data_dir=data_dir),
                           out, overwrite, dtype)
    print_report(q.report, q.fidelity, q.checkpoint, q.caveat)
    console.print(f"[dim]{hardware_line(q.model.model)}[/]")
    if json_out is not None:
        q.record.write(json_out)
        console.print(f"run record: {json_out}")
