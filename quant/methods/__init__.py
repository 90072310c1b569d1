"""Weight quantization methods, registered by name (``rtn``, ``mse``, ``gptq``, ``awq``).

A method turns one Linear weight [out, in] plus optional calibration statistics of its input into integer
codes, scales and zero points (``QuantResult``). Orchestration (which layers, calibration passes, replacing
modules) lives in ``quant.quantize``; kernels live in ``quant.qlinear``.
"""
from quant.methods.base import METHODS, LayerStats, QuantResult, WeightMethod, get_method, register_method
from quant.methods import rtn  # noqa: F401  (registers "rtn")

__all__ = ["METHODS", "LayerStats", "QuantResult", "WeightMethod", "get_method", "register_method"]
