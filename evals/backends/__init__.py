"""Serving backends behind one interface, registered by name: ``native`` (quant/ + specdec/) and ``vllm``."""
from evals.backends import native, vllm_engine  # noqa: F401  (register backends)
from evals.backends.base import BACKENDS, Backend, EngineFailure, ServingConfig, register_backend
from runtime.errors import UserError


def backend_class(config: ServingConfig) -> type[Backend]:
    """The backend class for ``config`` after its cheap checks (nothing is started)."""
    try:
        cls = BACKENDS[config.backend]
    except KeyError:
        raise UserError(f"unknown backend {config.backend!r}: use one of {', '.join(BACKENDS)}") from None
    cls.check(config)
    return cls


def open_backend(config: ServingConfig) -> Backend:
    """Start the engine for ``config`` (it can then serve several runs)."""
    return backend_class(config)(config)


__all__ = ["BACKENDS", "Backend", "EngineFailure", "ServingConfig", "backend_class", "open_backend", "register_backend"]
