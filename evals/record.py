"""The run record every measurement emits: the six conditions that make a number reproducible.

1. model + weights hash + precision   2. hardware + library versions
3. input/output length distribution  4. arrival process
5. engine config + cache warmth      6. metric definitions + correctness requirement
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from runtime.hardware import cuda_info, kernels_used, measured_speeds, probe

LIBRARIES = ("torch", "transformers", "vllm", "lm_eval", "optuna", "compressed_tensors", "numpy")


@dataclass
class ModelCondition:
    model_id: str
    weights_hash: str
    precision: str  # e.g. "fp32", "bf16", "W4A16-g32-asym (real int4 kernel)"
    scheme: str = "none"
    note: str = ""  # e.g. the Q4_1 origin caveat of the default model


@dataclass
class LengthDistribution:
    n_requests: int
    input_tokens: dict  # {"mean":..,"min":..,"max":..} or a fixed value
    output_tokens: dict
    source: str  # "spec_bench", "synthetic", path...
    fixed_output_length: bool  # ignore_eos / max_tokens fixed


@dataclass
class ArrivalProcess:
    kind: str = "batch-1 sequential"  # "closed-loop", "poisson", ...
    concurrency: int = 1
    rate_rps: float | None = None
    burstiness: float | None = None


@dataclass
class EngineCondition:
    backend: str  # "native" | "hf" | "vllm"
    config: dict = field(default_factory=dict)
    warmup: str = ""  # what ran before the measured window
    cache_warmth: str = "cold prefix cache; KV cache reset per request"


@dataclass
class MetricCondition:
    metrics: dict  # name -> definition
    correctness: str  # requirement the outputs were held to


@dataclass
class RunRecord:
    name: str
    model: ModelCondition
    hardware: dict
    lengths: LengthDistribution
    arrival: ArrivalProcess
    engine: EngineCondition
    metric: MetricCondition
    results: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def to_dict(self) -> dict:
        return asdict(self)

    def write(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "RunRecord":
        return cls(
            name=d["name"], model=ModelCondition(**d["model"]), hardware=d["hardware"],
            lengths=LengthDistribution(**d["lengths"]), arrival=ArrivalProcess(**d["arrival"]),
            engine=EngineCondition(**d["engine"]), metric=MetricCondition(**d["metric"]),
            results=d.get("results", {}), created=d.get("created", ""),
        )


def hardware_info(model=None, device=None) -> dict[str, Any]:
    """CPU model, what the hardware probe found (ISA, bf16/int8 matmul, fallbacks), cores, threads in use,
    memory, GPU (if any), library versions, and with ``model`` the kernel each kind of linear layer ran. When the
    run used CUDA (``device``, or where ``model`` lives): GPU name, CUDA and driver versions, peak memory."""
    import torch

    if device is None and model is not None:
        device = next(model.parameters()).device
    hw = probe()
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "cpu": hw.cpu,
        "isa": hw.isa,
        "probe": hw.to_dict(),
        "kernel_speeds": measured_speeds(),
        **({"kernels": kernels_used(model)} if model is not None else {}),
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # other work on the machine when the record was made
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem_gib,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        **({"cuda": cuda_info(device)} if device is not None and torch.device(device).type == "cuda" else {}),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "libraries": library_versions(),
    }


def library_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions = {}
    for lib in LIBRARIES:
        dist = {"lm_eval": "lm-eval", "compressed_tensors": "compressed-tensors"}.get(lib, lib)
        for candidate in (dist, f"{dist}-cpu"):
            try:
                versions[lib] = f"{candidate}=={metadata.version(candidate)}"
                break
            except metadata.PackageNotFoundError:
                versions[lib] = None
    return versions


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write JSON via a temp file + rename so a crash never leaves a half-written result."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
