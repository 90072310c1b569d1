"""``quantspec quantize``: quantize a model, report size/time/kernels/fidelity, write a compressed-tensors dir."""
from __future__ import annotations

from pathlib import Path

import typer

import quantspec
from quantspec.report import note, print_quantized
from quantspec.cli.app import (ROTATE_HELP, SCHEME_HELP, DataDirOption, ModelArgument, ModelOption, OutputPathOption,
                               app, flag, pick_model)

@app.command()
def quantize(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    scheme: str = typer.Option(..., "--scheme", "-s", help=SCHEME_HELP),
    method: str = typer.Option("rtn", help="Weight method: rtn, mse, gptq, awq."),
    rotate: str = typer.Option("none", "--rotate", help=ROTATE_HELP),
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
    q = quantspec.quantize(model, scheme, method, quantspec.CalibConfig(calib, calib_samples, calib_seqlen, data_dir=data_dir),
                           out, overwrite, dtype, rotate)
    print_quantized(q)
    if json_out is not None:
        q.record.write(json_out)
        note(f"run record: {json_out}")
