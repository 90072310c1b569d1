"""The native runtime's thread count, chosen from what the machine offers when it measures.

No fixed setting wins: idle, torch's OpenMP threads spin-wait at barriers and two threads decode fastest; with
another process on one core, the spinning thread waits for a descheduled one at every barrier (measured on the
default model, bf16, AMD EPYC AVX-512: 2 threads 33.8 tok/s idle, 8-9 with one core busy; 1 thread 27 and 28).
So ``choose_threads`` times a short probe (milliseconds: the model's one-token forward) on each candidate count,
interleaved, and keeps the fastest; the choice, its timings and the load are recorded in every run record.
``--threads`` overrides it; ``OMP_NUM_THREADS``, where set, caps the candidates as it caps torch's own default (a
process told to use one core, e.g. each of two test workers on two cores, is not handed two). The OpenMP wait
policy is read once when torch starts, so it is recorded, not chosen.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from runtime.loading import set_threads
from runtime.measure import LoadWindow, cpus_available

PROBE_ROUNDS = 3
PREFER_MARGIN = 0.10  # fewer threads must beat all cores by this much to be chosen


@dataclass
class ThreadChoice:
    threads: int
    how: str  # "probe" | "--threads" | "one core" | "OMP_NUM_THREADS=n"
    probe_ms: dict[int, float] = field(default_factory=dict)  # candidate -> median probe time
    load: dict = field(default_factory=dict)
    wait_policy: str = field(default_factory=lambda: os.environ.get("OMP_WAIT_POLICY", "unset (torch default: active)"))

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        timings = ", ".join(f"{n}: {ms:.2f} ms" for n, ms in sorted(self.probe_ms.items()))
        return f"{self.threads} thread(s) ({self.how}{'; probe ' + timings if timings else ''})"


def omp_cap() -> int | None:
    """``OMP_NUM_THREADS`` where it is set to a positive count (None otherwise)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def candidates(cpus: int | None = None) -> list[int]:
    """Thread counts worth probing: all usable cores (at most ``OMP_NUM_THREADS``), one fewer, half, and one."""
    available = cpus_available()
    n = cpus or min(available, omp_cap() or available)
    return sorted({n, max(1, n - 1), max(1, n // 2), 1}, reverse=True)


def choose_threads(work: Callable[[], object], options: list[int] | None = None, rounds: int = PROBE_ROUNDS,
                   clock: Callable[[], float] = time.perf_counter) -> ThreadChoice:
    """Set torch's thread count to the option under which ``work()`` runs fastest (median of ``rounds``
    interleaved timings after one warm-up each), and say why."""
    options = options or candidates()
    window = LoadWindow.start()
    if len(options) == 1:
        torch.set_num_threads(options[0])
        cap = omp_cap()
        how = f"OMP_NUM_THREADS={cap}" if cap == options[0] and cap < cpus_available() else "one core"
        return ThreadChoice(options[0], how, load=window.stop().to_dict())
    times: dict[int, list[float]] = {n: [] for n in options}
    for n in options:
        torch.set_num_threads(n)
        work()
    for _ in range(rounds):
        for n in options:
            torch.set_num_threads(n)
            t = clock()
            work()
            times[n].append(clock() - t)
    probe_ms = {n: 1e3 * statistics.median(ts) for n, ts in times.items()}
    best = min(probe_ms, key=probe_ms.get)
    most = max(options)
    if probe_ms[most] <= (1 + PREFER_MARGIN) * probe_ms[best]:  # a near-tie keeps all cores (idle: no slower)
        best = most
    torch.set_num_threads(best)
    return ThreadChoice(best, "probe", probe_ms, window.stop().to_dict())


def model_step_probe(model) -> Callable[[], None]:
    """A one-token forward of ``model`` (a runtime.transformer.Transformer) on a small scratch KV cache; the
    model's own caches are put back afterwards by ``restoring_caches``."""
    device = model.embed_tokens.weight.device
    tokens = torch.zeros(1, 1, dtype=torch.long, device=device)

    position = torch.tensor([3], device=device)

    def work():
        with torch.inference_mode():
            model(tokens, position)

    return work


def choose_for_model(model, options: list[int] | None = None) -> ThreadChoice:
    """``choose_threads`` on the model's one-token forward; leaves the model without a KV cache, as loaded."""
    saved = model.cache_state()
    model.setup_cache(1, 8)
    try:
        return choose_threads(model_step_probe(model), options)
    finally:
        model.restore_cache(saved)


def apply_threads(model, threads: int | None) -> ThreadChoice:
    """What every speed measurement calls before it times: ``threads`` when the user gave one (``--threads``),
    otherwise the probe's choice on ``model`` (CPU models; a GPU model keeps torch's count, which only feeds the
    host side)."""
    if threads:
        set_threads(threads)
        return ThreadChoice(threads, "--threads")
    if model.embed_tokens.weight.device.type != "cpu":
        return ThreadChoice(torch.get_num_threads(), "not probed (the model runs on a GPU)")
    return choose_for_model(model)
