"""Round-to-nearest with min/max scales: the calibration-free baseline."""
from quant.methods.base import QuantResult, WeightMethod, register_method
from quant.qmath import compute_qparams, global_scale, quantize


@register_method
class RTN(WeightMethod):
    name, types = "rtn", ("int", "float", "mxfp", "nvfp")
    granularities = ("tensor", "channel", "group", "block")

    def quantize_weight(self, weight, spec, stats=None):
        scale, zero = compute_qparams(weight, spec)
        return QuantResult(quantize(weight, scale, zero, spec), scale, zero, global_scale=global_scale(weight, spec))
