"""Weight quantization methods, registered by name (``rtn``, ``mse``, ``gptq``, ``awq``).

A method turns one Linear weight [out, in] plus optional calibration statistics of its input into integer
codes, scales and zero points (``QuantResult``); calibrated methods may first rewrite the model once
(``WeightMethod.transform``, see base.py for the contract). Orchestration (which layers, calibration passes,
replacing modules) lives in ``quant.quantize``; kernels live in ``quant.qlinear``.
"""
from quant.methods.base import METHODS, LayerStats, QuantResult, WeightMethod, get_method, register_method
from quant.methods import awq, gptq, mse, rtn  # noqa: F401  (register "awq", "gptq", "mse", "rtn")

__all__ = ["METHODS", "LayerStats", "QuantResult", "WeightMethod", "get_method", "register_method"]
