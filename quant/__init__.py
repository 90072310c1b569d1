"""Weight, activation and KV-cache quantization; importing it registers its kernels and checkpoint format."""
from quant import fp8, gemv, w8a8  # noqa: F401  (register the FP8, int4/int8 GEMV and int8 W8A8 kernels)
from runtime.loading import CHECKPOINT_FORMATS


def _load_compressed_tensors(path, config, dtype, attention):
    from quant.checkpoint import load_quantized  # compressed-tensors costs seconds to import: only when loading one

    return load_quantized(path, config, dtype, attention)


CHECKPOINT_FORMATS.add("compressed-tensors", _load_compressed_tensors)
