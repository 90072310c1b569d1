"""Progress of long API calls: ``Tick`` callbacks (``tick(what)`` after each unit of work), and for callers that
pass none, INFO log lines (``logging.basicConfig(level=logging.INFO)`` or ``quantspec -v`` shows them)."""
from __future__ import annotations

import logging
import time
from typing import Callable

Tick = Callable[[str], None]


def log_ticks(logger: logging.Logger, every_s: float = 5.0) -> Tick:
    """A tick that logs what was last done and how many units so far, at most once per ``every_s`` seconds."""
    start = time.perf_counter()
    state = {"done": 0, "logged": start}

    def tick(what: str) -> None:
        state["done"] += 1
        now = time.perf_counter()
        if now - state["logged"] >= every_s:
            state["logged"] = now
            logger.info("%s: %d done, %.0f s", what, state["done"], now - start)

    return tick
