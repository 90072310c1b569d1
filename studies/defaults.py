"""What callers of the search need without importing optuna: its default places and intervals, and one line for
a machine without optuna (the lent GPU machine has none), so that every other command still runs there."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from runtime.errors import UserError

DEFAULT_STUDY_DIR = Path("runs/search")
HEARTBEAT_S = 20  # RDB storages: a worker's heartbeat interval ...
GRACE_S = 60  # ... and the silence after which its RUNNING trial is failed and re-queued


def require_optuna(what: str) -> None:
    """Refuse ``what`` in one line where optuna is not installed."""
    if importlib.util.find_spec("optuna") is None:
        raise UserError(f"{what} needs optuna, which is not installed here: `pip install optuna` (`make setup` "
                        "installs it); every other command runs without it")
