"""Native greedy decode vs HF generate on the default model: tok/s, ratio, % of memory roofline.

Usage: python bench/decode.py [--dtype fp32|bf16] [--new-tokens 128] [--repeats 3]
Writes bench/results/decode-<dtype>.<machine tag>.json (a full run record; one file per CPU kind).
"""
import argparse
from pathlib import Path

from evals.decode_speed import compare_decode
from runtime.hardware import probe
from quantspec.report import print_decode_comparison

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    record = compare_decode(args.model, args.dtype, args.new_tokens, args.repeats)
    print_decode_comparison(record)
    out = record.write(Path(__file__).parent / "results" / f"decode-{args.dtype}.{probe().tag}.json")
    print(f"wrote {out}")
