"""argparse types for the bench scripts: a count below its minimum is a one-line usage error (exit 2), not a
traceback from deep inside a run."""
from __future__ import annotations

import argparse


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "positive int" if minimum == 1 else "non-negative int"  # argparse names the type by it
    return parse


positive_int = _at_least(1)
nonnegative_int = _at_least(0)
