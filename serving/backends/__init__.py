"""Serving backends behind one interface, registered by name: ``native`` (quant/ + specdec/) and ``vllm``."""
from serving.backends import native, vllm_engine  # noqa: F401  (register backends)
from serving.backends.base import (BACKENDS, Backend, EngineFailure, QualityPlan, ServingConfig, check_config,
                                   register_backend)
from runtime.errors import UserError


def backend_class(config: ServingConfig) -> type[Backend]:
    """The backend class for ``config`` after its cheap checks (nothing is started)."""
    cls = BACKENDS.get(config.config.backend)
    reason = cls.check(config)
    if reason:
        raise UserError(reason)
    return cls


def open_backend(config: ServingConfig) -> Backend:
    """Start the engine for ``config`` (it can then serve several runs)."""
    return backend_class(config)(config)


__all__ = ["BACKENDS", "Backend", "EngineFailure", "QualityPlan", "ServingConfig", "backend_class", "check_config",
           "open_backend", "register_backend"]
