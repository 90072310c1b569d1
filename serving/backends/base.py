"""What every serving backend shares: the configuration it runs, the requests it serves, what it measures."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from evals.config import DEFAULT_BACKEND, Config
from runtime.compiled import SETTINGS
from runtime.errors import UserError
from runtime.measure import Sample
from runtime.registry import Registry
from serving.requests import Progress, Request, RequestResult, SpecCounters


@dataclass(frozen=True)
class ServingConfig:
    """A configuration point (``evals.config.Config``, built by ``Config.parse`` from strings) plus the run-only
    serving settings: ``ServingConfig(Config.parse(model=.., spec=.., k=..), temperature=..)``. What is served
    is read from ``config`` itself (``config.config.kv``, ``.speculative``, ``.label``, ...)."""

    config: Config
    temperature: float = 0.0
    max_model_len: int = 1024
    threads: int | None = None
    port: int = 0  # vllm serve port for open-loop runs (0 = a free one); not part of the config's identity
    compile: str = "auto"  # native decode step: auto | eager | an inductor mode (runtime.compiled.resolve_compile)

    def __post_init__(self):
        if not isinstance(self.config, Config):
            raise TypeError(f"ServingConfig takes a Config (Config.parse(model=.., spec=..)), got {self.config!r}")
        if self.max_model_len < 16:
            raise UserError(f"max_model_len must be >= 16, got {self.max_model_len}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.compile not in SETTINGS:
            raise UserError(f"--compile {self.compile!r} is not a setting: use one of {', '.join(SETTINGS)}")

    def without_spec(self) -> "ServingConfig":
        """The same serving run without speculation (a speculative run's speedup baseline)."""
        return replace(self, config=self.config.without_spec())

    def to_dict(self) -> dict:
        """As recorded (RunRecord.engine.config["serving_config"]): the point's fields as ``Config`` holds them,
        ``spec`` (the proposer, None without speculation) and ``k``, the run settings, ``Config.to_dict``."""
        c = self.config
        return {"model": c.model, "scheme": c.scheme_label, "method": c.method, "rotate": c.rotate, "kv": c.kv,
                "spec": c.proposer if c.speculative else None, "k": c.k, "backend": c.backend,
                "temperature": self.temperature, "max_model_len": self.max_model_len, "threads": self.threads,
                "port": self.port, "compile": self.compile, "config": c.to_dict()}


@dataclass(frozen=True)
class QualityPlan:
    """How a point's quality is scored (``evals.harness.evaluate``): the point lm-eval scores, the model it is
    compared with (None: the point's own model, unquantized, on the reference runtime), and whether the WikiText-2
    fidelity is measured (only where the scored model is the native build that fidelity compares)."""

    point: Config
    reference_model: str | None = None
    fidelity: bool = True


class Backend:
    """A started engine that can serve several measured runs (the engine is reused between them).

    Subclasses implement ``closed_loop`` and ``open_loop``; both return one ``RequestResult`` per request,
    never drop a request silently (failures carry ``error``), and raise ``EngineFailure`` when the engine
    itself died."""

    name = "?"
    batching = "?"  # how concurrent requests are served, stated in every record
    cache_warmth = "?"  # KV / prefix cache state of measured requests, stated in every record
    # Whether two engines of this backend can stay resident in one process and alternate request by request,
    # so a candidate's speed is measured paired with the reference's (runtime.measure.paired_ratio).
    interleavable = False
    # Whether a started engine can serve other points of its build (``serve_also``), so a search keeps it resident
    # between trials instead of building the same transformation again.
    reusable = False
    # Whether a point's quality is scored through this engine itself (its own lm-eval model, its serving dtype),
    # so it is cached under its own key; False: the point's transformation is scored once on the reference
    # runtime and every such backend's points of that transformation share the number.
    scores_own_quality = False

    def __init__(self, config: ServingConfig):
        self.config = config
        self.warm_runs: dict[str, int] = {}  # engine -> measured runs since its warm-up

    @classmethod
    def check(cls, config: "Config | ServingConfig") -> str | None:
        """Why this backend cannot run ``config`` (one line naming the alternative), or None. Cheap: called
        before anything loads. A ``ServingConfig`` also carries run settings (temperature) a backend may need."""
        return None

    @classmethod
    def quality_plan(cls, config: Config) -> QualityPlan:
        """What lm-eval scores for ``config``'s quality. Here: its transformation (speculation does not change
        outputs it verifies) on the reference runtime in bf16, as served. A backend that scores its own quality
        overrides this (it may export weights first: slow, and it raises what the export raises)."""
        return QualityPlan(replace(config.transformation, backend=DEFAULT_BACKEND, dtype="bf16"))

    @classmethod
    def quality_key(cls, config: Config) -> str:
        """The key ``config``'s quality is cached under in a study: points with one key share one measurement
        (with ``scores_own_quality`` the backend and dtype are part of it: never borrowed from another engine)."""
        key = config.transformation.quality_key
        return f"{key}|backend={config.backend}|dtype={config.dtype}" if cls.scores_own_quality else key

    @classmethod
    def exactness(cls, config: Config) -> dict:
        """Whether speculation on the kernels ``config`` runs leaves greedy outputs unchanged by construction:
        ``{"by_construction": bool, "why": str}``. Here: not claimed (the kernels are not probed)."""
        return {"by_construction": False, "why": f"{cls.name}'s kernels are not probed for batch invariance"}

    def serve_also(self, config: ServingConfig) -> "Backend | None":
        """A backend serving ``config`` on this started engine (its built model, compiled steps), or None where
        ``config`` needs an engine of its own. Here: always None."""
        return None

    def plain_twin(self) -> "Backend | None":
        """This speculative point without speculation, on this engine's build and decoding step, where that step is
        not the one the plain point's own engine decodes on: the reference its greedy outputs must equal (lossless
        speculation reproduces plain decoding on its own kernels). None where the plain point's run is that
        reference. Here: always None."""
        return None

    def tokenizer(self):
        raise NotImplementedError

    def engine_config(self) -> dict:
        """The engine's own settings as passed to it (recorded in RunRecord.engine.config)."""
        raise NotImplementedError

    def engine_for(self, load_kind: str) -> str:
        """Which engine serves ``closed`` / ``open`` loads (warm-up is tracked per engine)."""
        return "engine"

    def warm_up(self, requests: list[Request], load_kind: str) -> str:
        """Run ``requests`` on the engine that will serve ``load_kind``, outside any measured window."""
        if load_kind == "open":
            self.open_loop(requests, [0.0] * len(requests))
        else:
            self.closed_loop(requests, concurrency=1)
        return f"{len(requests)} request(s) of {requests[0].max_tokens} tokens each, excluded from measurement"

    def prepare(self, requests: list[Request]) -> str:
        """Build what the engine builds per request shape for ``requests``, before they are measured; says what it
        built ("" for nothing)."""
        return ""

    def closed_loop(self, requests: list[Request], concurrency: int, progress: Progress | None = None
                    ) -> list[RequestResult]:
        raise NotImplementedError

    def open_loop(self, requests: list[Request], offsets: list[float], progress: Progress | None = None
                  ) -> list[RequestResult]:
        raise NotImplementedError

    def spec_counters(self, load_kind: str = "closed") -> SpecCounters | None:
        """Cumulative proposer counters of the engine serving ``load_kind`` (None when it does not speculate)."""
        return None

    def sample(self, request: Request) -> Sample:
        """Serve one request alone (closed loop, concurrency 1): one block of a paired speed comparison."""
        result = self.closed_loop([request], 1)[0]
        if not result.ok:
            raise EngineFailure(f"request {request.index} failed: {result.error}")
        return Sample(result.output_tokens, result.end - result.sent)

    def retune(self) -> dict | None:
        """Re-choose what the machine's load decides (the native runtime's thread count) when a speed
        comparison turns out noisy; what changed, or None when nothing can be."""
        return None

    def peak_rss_bytes(self) -> int:
        """Peak resident memory of the engine process(es) so far."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the engine and every process it started; safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EngineFailure(Exception):
    """The engine died or could not serve: a failed measurement, reported with the engine's log tail."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


BACKENDS: Registry[type[Backend]] = Registry("backend")


def register_backend(name: str):
    """Class decorator: make a Backend subclass available as ``--backend name``."""
    def deco(cls: type[Backend]) -> type[Backend]:
        assert name not in BACKENDS, f"backend {name!r} registered twice"
        cls.name = name
        return BACKENDS.add(name, cls)

    return deco


def check_config(config: Config) -> str | None:
    """Why ``config`` cannot run on its backend (one line naming the alternative), or None; nothing loads."""
    try:
        return BACKENDS.get(config.backend).check(config)
    except UserError as exc:
        return str(exc)
