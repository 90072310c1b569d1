"""``quantspec`` console entry point: a thin layer over the Python API; user mistakes exit 2 on one line.

Extensions: modules named in ``QUANTSPEC_PLUGINS`` (comma-separated) and by ``--plugin MOD`` (repeatable, before
the command) are imported first, so whatever they register (weight methods, schemes, proposers, backends,
evaluators) is available by name on the command line."""
from __future__ import annotations

import importlib
import os
import sys

from quantspec import UserError
from quantspec.cli.app import app
from quantspec.cli import cmd_model, cmd_generate, cmd_search, cmd_bench, cmd_specdec, cmd_eval, cmd_quant, cmd_train, cmd_dashboard  # noqa: F401  (register commands)

PLUGINS_ENV = "QUANTSPEC_PLUGINS"


def load_plugins(names: list[str]) -> None:
    """Import each module (it registers its extensions on import); a missing one is a UserError."""
    for name in filter(None, (n.strip() for n in names)):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                raise UserError(f"plugin {name!r} not found: put its folder on PYTHONPATH") from None
            raise


def split_plugin_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """(plugins, the rest) from leading ``--plugin MOD`` / ``--plugin=MOD`` options."""
    plugins = []
    while argv and argv[0].startswith("--plugin"):
        if argv[0].startswith("--plugin="):
            plugins.append(argv[0].split("=", 1)[1])
            argv = argv[1:]
        elif argv[0] == "--plugin" and len(argv) > 1:
            plugins.append(argv[1])
            argv = argv[2:]
        else:
            raise UserError("--plugin needs a module name, e.g. --plugin my_methods")
    return plugins, argv


def main(argv: list[str] | None = None) -> None:
    try:
        plugins, argv = split_plugin_options(list(sys.argv[1:] if argv is None else argv))
        load_plugins(os.environ.get(PLUGINS_ENV, "").split(",") + plugins)
        app(args=argv, standalone_mode=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
