"""Weight, activation and KV-cache quantization; importing it registers its kernels and checkpoint format."""
from quant import checkpoint, w8a8  # noqa: F401  (register the compressed-tensors loader and the W8A8 kernel)
