"""quantspec's bf16 / int4 / int8 GEMV kernels (``runtime.cpu_ops``) against the torch kernels they stand in for,
product by product at every linear shape of the default model: bf16 (``bf16gemv`` vs ``onednn-prepacked``, or the
dense kernel bf16 decode rows would run otherwise), int4 g32 (``int4gemv`` vs ``int4pack``) and int8 per channel
(``int8gemv`` vs ``int8pack``), on one row (a decode step) and on five (a K = 4 verification). Each call runs on
the next of enough weights of that shape (about 64 MB of int8 codes, or two) that it streams them from memory as
decoding does; the two kernels alternate in paired, interleaved rounds (``runtime.measure.paired_ratio``) and each
row gives the ratio with its 95% CI and the read bandwidth each kernel reaches, beside the machine's.

Usage: flock /tmp/qs-bench.lock python bench/gemv.py [--threads 2]
Writes bench/results/gemv.<machine tag>.json.
"""
import argparse
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import measure_bandwidth
from quant.gemv import Int4GemvKernel, Int8GemvKernel, gemv_missing, streamed
from runtime import hardware, packed_linear
from runtime.argtypes import positive_int
from runtime.hardware import probe
from runtime.loading import set_threads
from runtime.measure import Sample, SpeedProtocol, paired_ratio, with_ci

# the default model's linears (out, in): q/o, k/v, gate/up, down, and the LM head
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
FORMATS = [(Int4GemvKernel, "w4g32-sym"), (Int8GemvKernel, "w8ch-sym")]
ROWS = (1, 5)
BF16 = "bf16"


def bf16_streamed(name: str, n: int, k: int) -> list:
    """Dense bf16 kernel ``name`` on distinct random weights of one shape, as ``quant.gemv.streamed`` builds the
    int ones (the same count: 64 MB of int8-code-sized weights, at least two)."""
    make = packed_linear.DENSE[torch.bfloat16][name]
    return hardware.streamed(lambda seed: make(
        torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()), n, k)


def pairs():
    """(format, kernel, torch's kernel, why not run or None, factory: (n, k) -> (ours, theirs, packed bytes))."""
    other = packed_linear.displaced()
    yield BF16, packed_linear.GEMV, other, packed_linear.gemv_missing(), lambda n, k: (
        bf16_streamed(packed_linear.GEMV, n, k), bf16_streamed(other, n, k), n * k * 2)
    for cls, scheme in FORMATS:
        def make(n, k, cls=cls, scheme=scheme):
            ours = streamed(cls, scheme, n, k)
            return ours, streamed(cls.replaces, scheme, n, k), sum(b.nbytes for b in ours[0].buffers())
        yield scheme, cls.name, cls.replaces.name, gemv_missing(cls.name), make


def one_pass(kernels: list, x: torch.Tensor):
    """A block: one product per weight, timed (``Sample.tokens`` counts products)."""
    def run(_unit: int) -> Sample:
        t0 = time.perf_counter()
        for kernel in kernels:
            kernel(x)
        return Sample(len(kernels), time.perf_counter() - t0)
    return run


def run() -> RunRecord:
    bandwidth = measure_bandwidth()
    rows = []
    for scheme, name, torch_name, missing, make in pairs():
        if missing and "slower" not in missing:
            rows.append({"format": scheme, "kernel": name, "missing": missing})
            continue
        for n, k in SHAPES:
            ours, theirs, nbytes = make(n, k)
            for m in ROWS:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
                paired = paired_ratio(one_pass(theirs, x), one_pass(ours, x), 1, SpeedProtocol(),
                                      f"one pass over {len(ours)} weights")
                rows.append({"format": scheme, "shape": [n, k], "rows": m, "kernel": name,
                             "torch_kernel": torch_name, "bytes": nbytes, "weights": len(ours),
                             "us": 1e6 / paired.candidate.value, "torch_us": 1e6 / paired.reference.value,
                             "gb_s": nbytes * paired.candidate.value / 1e9,
                             "torch_gb_s": nbytes * paired.reference.value / 1e9,
                             "speedup": paired.ratio.value, "speedup_ci": list(paired.ratio.ci),
                             "noisy": paired.noisy, "rounds": paired.rounds})
                print(rows[-1], flush=True)
            del ours, theirs
    return RunRecord(
        name="gemv",
        model=ModelCondition("default model's linear shapes (random codes)", "-",
                             "bf16 inputs x bf16 / int4 g32 sym / int8 per-channel sym weights, bf16 scales"),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"rows": list(ROWS)}, {"fixed": 0},
                                   "random bf16 inputs; one and five rows per product (decode, K = 4 verification)",
                                   True),
        arrival=ArrivalProcess("back-to-back products", 1),
        engine=EngineCondition("native", {"threads": torch.get_num_threads(), "step": "eager kernel calls"},
                               warmup="the paired protocol's first rounds are not discarded; weights packed beforehand",
                               cache_warmth="each call on the next of distinct weights totalling about 64 MB of "
                                            "int8 codes (or two weights), so they stream from memory"),
        metric=MetricCondition(
            {"speedup": "median over paired, interleaved rounds (one pass over the weights each, seeded AB/BA "
                        "order) of quantspec's kernel's products/s over the torch kernel's; CI: 95% t-interval of "
                        "the mean log ratio",
             "gb_s": "packed weight bytes (codes + scales) per product x products/s"},
            "speed only; correctness: tests/test_gemv.py (same weights as the torch kernel, the dequantized "
            "(bf16: plain) product, rows bitwise alike alone and batched)"),
        results={"bandwidth_gb_s": bandwidth / 1e9, "load_average_1_5_15": os.getloadavg(), "rows": rows},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive_int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    record = run()
    table = Table(title=f"GEMV kernels vs torch's, streaming (machine read bandwidth "
                        f"{record.results['bandwidth_gb_s']:.1f} GB/s)")
    for col in ("format", "shape", "rows", "ours us", "torch us", "ours GB/s", "torch GB/s", "speedup [95% CI]"):
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        if "missing" in r:
            table.add_row(r["format"], r["kernel"], "-", "not run: " + r["missing"])
            continue
        table.add_row(r["format"], "x".join(map(str, r["shape"])), str(r["rows"]), f"{r['us']:.1f}",
                      f"{r['torch_us']:.1f}", f"{r['gb_s']:.1f}", f"{r['torch_gb_s']:.1f}",
                      with_ci(r["speedup"], r["speedup_ci"], ".2f", "x"))
    Console().print(table)
    out = record.write(Path(__file__).parent / "results" / f"gemv.{probe().tag}.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
