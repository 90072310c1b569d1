"""Load models: closed loop (C clients, each sends its next request when the last one finished) and open loop
(Poisson arrivals at λ req/s, optionally gamma-bursty). Real send times are recorded next to planned ones, so
client-side lag is visible; no request is ever dropped (a failure is a result with ``error`` set)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from serving.requests import Progress, Request, RequestResult, now
from evals.record import ArrivalProcess
from runtime.errors import UserError


@dataclass(frozen=True)
class LoadSpec:
    """``closed`` with ``concurrency`` clients, or ``open`` with Poisson ``rate`` req/s; ``burstiness`` is the
    gamma shape of inter-arrival times (1 = Poisson, < 1 burstier, > 1 more regular)."""

    kind: str = "closed"
    concurrency: int = 1
    rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("closed", "open"):
            raise UserError(f"unknown load kind {self.kind!r}: use closed (--max-concurrency) or open (--request-rate)")
        if self.kind == "closed" and self.concurrency < 1:
            raise UserError(f"--max-concurrency must be >= 1, got {self.concurrency}")
        if self.kind == "open" and (self.rate is None or self.rate <= 0):
            raise UserError(f"--request-rate must be > 0 requests/s, got {self.rate}")
        if self.burstiness <= 0:
            raise UserError(f"--burstiness must be > 0 (1 = Poisson), got {self.burstiness}")

    @classmethod
    def closed(cls, concurrency: int) -> "LoadSpec":
        return cls("closed", concurrency=concurrency)

    @classmethod
    def open(cls, rate: float, burstiness: float = 1.0, seed: int = 0) -> "LoadSpec":
        return cls("open", rate=rate, burstiness=burstiness, seed=seed)

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"C={self.concurrency}"
        return f"λ={self.rate:g}/s" + ("" if self.burstiness == 1 else f" (gamma {self.burstiness:g})")

    @classmethod
    def parse(cls, max_concurrency: str | None = None, request_rate: str | None = None,
              burstiness: float = 1.0) -> list["LoadSpec"]:
        """The load points of ``--max-concurrency 1,4,16`` (closed loop; default 1) or ``--request-rate 0.5,1,2``
        (open loop), as ``vllm bench serve`` spells them; one or the other."""
        if max_concurrency and request_rate:
            raise UserError("pass either --max-concurrency (closed loop) or --request-rate (open loop), not both")
        if request_rate:
            return [cls.open(r, burstiness) for r in _levels(request_rate, float, "--request-rate")]
        return [cls.closed(c) for c in _levels(max_concurrency or "1", int, "--max-concurrency")]

    def arrival(self) -> ArrivalProcess:
        if self.kind == "closed":
            return ArrivalProcess("closed-loop", self.concurrency)
        kind = "poisson" if self.burstiness == 1 else "gamma"
        return ArrivalProcess(kind, 0, self.rate, self.burstiness)


def _levels(text: str, cast, name: str) -> list:
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{name} takes a comma-separated list of numbers, got {text!r}") from None


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Planned send times (s after the start) of ``n`` requests: gamma inter-arrivals with mean 1/rate."""
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request starts the window
    return np.cumsum(gaps).tolist()


Send = Callable[[Request, float | None], Awaitable[RequestResult]]


async def open_loop_async(send: Send, requests: list[Request], offsets: list[float],
                          progress: Progress | None = None) -> list[RequestResult]:
    """Fire ``send(request, scheduled_time)`` at each planned time, never waiting for earlier replies."""
    t0 = now()
    tasks = []
    for request, offset in zip(requests, offsets):
        delay = t0 + offset - now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_reported(send(request, t0 + offset), progress)))
    return list(await asyncio.gather(*tasks))


async def closed_loop_async(send: Send, requests: list[Request], concurrency: int,
                            progress: Progress | None = None) -> list[RequestResult]:
    """``concurrency`` clients; each sends its next request as soon as its previous one finished."""
    queue = list(reversed(requests))
    results: list[RequestResult] = []

    async def client():
        while queue:
            results.append(await _reported(send(queue.pop(), None), progress))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index)


async def _reported(result: Awaitable[RequestResult], progress: Progress | None) -> RequestResult:
    r = await result
    if progress:
        progress(r)
    return r
