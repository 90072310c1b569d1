"""``quantspec`` console entry point: a thin layer over the Python API; user mistakes exit 2 on one line."""
from __future__ import annotations

import sys

from runtime.errors import UserError
from quantspec.cli.app import app
from quantspec.cli import cmd_model, cmd_generate, cmd_search, cmd_bench, cmd_specdec, cmd_eval, cmd_quant  # noqa: F401  (register commands)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
