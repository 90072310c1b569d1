"""Serving backends behind one interface, registered by name: ``native`` (quant/ + specdec/) and ``vllm``."""
from evals.backends import native, vllm_engine  # noqa: F401  (register backends)
from evals.backends.base import BACKENDS, Backend, EngineFailure, ServingConfig, register_backend
from quant.errors import UserError


def open_backend(config: ServingConfig) -> Backend:
    """Start the engine for ``config`` (it can then serve several runs)."""
    try:
        cls = BACKENDS[config.backend]
    except KeyError:
        raise UserError(f"unknown backend {config.backend!r}: use one of {', '.join(BACKENDS)}") from None
    return cls(config)


__all__ = ["BACKENDS", "Backend", "EngineFailure", "ServingConfig", "open_backend", "register_backend"]
