"""Weight schemes x methods on the default model: accuracy, Δ vs fp32 with CI, flips, KL, PPL, verdict.

The flips column is the point: two configurations with the same accuracy can disagree with the reference
on many items. Every run goes through ``evals.harness.evaluate`` (cached under $QUANTSPEC_HOME/eval-cache).
``--set fp4``: the microscaling FP4 formats (MXFP4A16, NVFP4A16; simulated kernel) beside int4 g32 asym/sym and
g16, each 4-bit row with the caveat of this model's Q4_1-dequantized body (bench/results/eval_fp4.json).
``--set rotation``: W4A8 and W4A4 (int4 activations per token, and per group of 32) each without and with
``--rotate hadamard`` (quant/rotation.py), RTN; the summary states KL(unrotated) / KL(rotated) per scheme
(bench/results/eval_rotation.json). ``--set fp4a``: W4A4 in FP4 (MXFP4, NVFP4: weights and activations, the
latter's per-layer input global scales calibrated) beside int4 weights and activations in the same groups, and the
FP4 pair with ``--rotate hadamard`` (bench/results/eval_fp4_act.json). ``--set fp8``: FP8 weights per channel and per 128-block (weight-only, and
with dynamic per-token activations), FP8_DYNAMIC and static FP8 beside INT8 W8A8 (bench/results/eval_fp8.json).
``--set head``: int8 and int4 g32 weights with the LM head kept bf16 (the default) and quantized too (``@ignore=``),
what the head's bytes buy at decode (bench/results/eval_head.json).
A configuration is ``method:scheme[:rotation]``.

    flock /tmp/qs-bench.lock .venv/bin/python bench/eval_schemes.py --limit 200
    flock /tmp/qs-bench.lock .venv/bin/python bench/eval_schemes.py --set fp4 --limit 100
    flock /tmp/qs-bench.lock .venv/bin/python bench/eval_schemes.py --set rotation --limit 200
    flock /tmp/qs-bench.lock .venv/bin/python bench/eval_schemes.py --set fp4a --limit 100
    flock /tmp/qs-bench.lock .venv/bin/python bench/eval_schemes.py --set fp8 --limit 100
    flock /tmp/qs-bench.lock .venv/bin/python bench/eval_schemes.py --set head --limit 100
"""
from __future__ import annotations

import argparse
from pathlib import Path


from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from evals.config import Config  # noqa: E402
from evals.harness import EvalConfig, evaluate  # noqa: E402
from evals.record import RunRecord, write_json_atomic  # noqa: E402
from runtime.model_store import SMOLLM2  # noqa: E402
from quant.scheme import parse_scheme  # noqa: E402
from runtime.argtypes import positive_int

CONFIGS = ("rtn:w8ch-sym", "rtn:w4g32-asym", "rtn:w4g32-sym", "gptq:w4g32-sym", "rtn:w3g32-sym", "gptq:w3g32-sym")
FP4_CONFIGS = ("rtn:w4g32-asym", "rtn:w4g32-sym", "rtn:w4g16-sym", "rtn:MXFP4A16", "rtn:NVFP4A16")
ROTATION_CONFIGS = tuple(f"rtn:{scheme}{rotation}" for scheme in ("w4g32-sym_a8tok-dyn", "w4g32-sym_a4tok-dyn",
                                                                  "w4g32-sym_a4g32-dyn") for rotation in ("", ":hadamard"))
FP4A_CONFIGS = ("rtn:w4g32-sym_a4g32-dyn", "rtn:MXFP4", "rtn:w4g16-sym_a4g16-dyn", "rtn:NVFP4", "rtn:MXFP4:hadamard",
                "rtn:NVFP4:hadamard")
FP8_CONFIGS = ("rtn:FP8A16", "rtn:wfp8b128-sym", "rtn:FP8_DYNAMIC", "rtn:wfp8b128-sym_afp8tok-dyn", "rtn:FP8",
               "rtn:W8A8")
HEAD_CONFIGS = ("rtn:W8A16", "rtn:w8ch-sym@ignore=", "rtn:w4g32-sym", "rtn:w4g32-sym@ignore=")
SETS = {"schemes": (CONFIGS, "bench/results/eval_schemes.json"), "fp4": (FP4_CONFIGS, "bench/results/eval_fp4.json"),
        "rotation": (ROTATION_CONFIGS, "bench/results/eval_rotation.json"),
        "fp4a": (FP4A_CONFIGS, "bench/results/eval_fp4_act.json"),
        "fp8": (FP8_CONFIGS, "bench/results/eval_fp8.json"), "head": (HEAD_CONFIGS, "bench/results/eval_head.json")}
Q4_1_ASYM = ("this body is Q4_1-dequantized (4-bit g32 grid with a float offset per block): int4-g32-asym's integer "
             "zero point cannot express that offset, so its re-quantization is NOT near-lossless")
Q4_1_OTHER = "re-quantizes Q4_1-dequantized 4-bit weights: need not transfer to natively trained checkpoints"


def caveat(scheme: str) -> str:
    """The Q4_1-origin caveat beside a 4-bit row of the default model ('' for other bit widths)."""
    weights = parse_scheme(scheme).weights
    if weights.bits != 4:
        return ""
    return Q4_1_ASYM if (weights.type, weights.symmetric, weights.group_size) == ("int", False, 32) else Q4_1_OTHER


def kl_factors(rows: list[dict]) -> dict[str, float]:
    """Per scheme measured with and without a rotation: mean KL unrotated / mean KL rotated."""
    kl = {(r["scheme"], r["rotate"]): r["kl_mean"] for r in rows}
    return {scheme: kl[scheme, None] / kl[scheme, rotate] for scheme, rotate in kl
            if rotate is not None and (scheme, None) in kl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="schemes", choices=tuple(SETS), help="configurations (and output) by name")
    ap.add_argument("--configs", default=None, help="method:scheme[:rotation],... (default: those of --set)")
    ap.add_argument("--tasks", default="arc_easy,piqa")
    ap.add_argument("--limit", type=positive_int, default=200)
    ap.add_argument("--floor", default="0.95")
    ap.add_argument("--calib-samples", type=positive_int, default=32)
    ap.add_argument("--fidelity-windows", type=positive_int, default=2)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--out", default=None, help="default: the --set's file in bench/results")
    args = ap.parse_args()
    configs, out = SETS[args.set]
    args.configs, args.out = args.configs or ",".join(configs), args.out or out
    import torch

    torch.set_num_threads(args.threads)
    from quant.calibration import CalibConfig

    calib = CalibConfig(samples=args.calib_samples, seqlen=512)
    console = Console()
    rows, records = [], []
    for item in args.configs.split(","):
        method, scheme, rotate = (item.split(":") + [None])[:3]
        calibrated = method != "rtn" or parse_scheme(scheme).calibrated_global  # (NVFP4: input global scales)
        point = Config.parse(scheme=scheme, method=method, dtype="fp32", calib=calib if calibrated else None,
                             rotate=rotate)
        report = evaluate(EvalConfig(point, tasks=tuple(args.tasks.split(",")), limit=args.limit, floor=args.floor,
                                     fidelity_windows=args.fidelity_windows))
        records.append(report.to_json())
        for task, comp in report.comparison.items():
            rows.append({"config": item, "scheme": scheme, "rotate": point.rotate, "task": task, **comp.to_dict(),
                         "stderr": report.tasks[task].value("acc")[1],
                         "kl_mean": report.fidelity.mean_kl, "kl_p99": report.fidelity.p99_kl,
                         "top1_agreement": report.fidelity.top1_agreement, "ppl": report.fidelity.ppl_test,
                         "ppl_ref": report.fidelity.ppl_ref, "verdict": report.verdict,
                         "kernels": report.record.hardware.get("kernels", {}), "caveat": caveat(scheme)})
        console.print(f"{item}: {report.verdict}", highlight=False)
    table = Table(title=f"default model fp32 reference, first {args.limit} docs, floor {args.floor}x reference "
                        f"(paired bootstrap 95%)")
    for col in ("method:scheme", "task", "acc %", "ref %", "Δ pts [95% CI]", "flips -lost/+gained", "KL mean",
                "KL p99", "top-1 agree %", "PPL", "verdict"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["config"], r["task"], f"{100 * r['acc_test']:.1f}", f"{100 * r['acc_ref']:.1f}",
                      f"{100 * r['delta']:+.1f} [{100 * r['delta_ci'][0]:+.1f}, {100 * r['delta_ci'][1]:+.1f}]",
                      f"{r['flips']['total']} (-{r['flips']['lost']}/+{r['flips']['gained']})", f"{r['kl_mean']:.4f}",
                      f"{r['kl_p99']:.3f}", f"{100 * r['top1_agreement']:.1f}", f"{r['ppl']:.2f}", r["verdict"])
    console.print(table)
    console.print(f"[yellow]note:[/] {SMOLLM2.note}")
    base = RunRecord.from_dict(records[0]["quantspec"]["run_record"])
    base.name = "eval schemes: accuracy, flips, KL per weight scheme"
    base.model.scheme = args.configs
    base.engine.config["threads"] = args.threads
    base.engine.config["rotate"] = sorted({r["rotate"] or "none" for r in rows})  # per row: its config's third field
    base.results = {"rows": rows, "reports": records}
    factors = kl_factors(rows)
    if factors:
        base.results["kl_factor_unrotated_over_rotated"] = factors
        for scheme, factor in factors.items():
            console.print(f"{scheme}: mean KL unrotated / rotated = {factor:.2f}x", highlight=False)
    write_json_atomic(args.out, base.to_dict())
    console.print(f"run record: {args.out}")


if __name__ == "__main__":
    main()
