"""``nn.Linear`` whose inference forward runs on a prepacked weight (MKL for fp32, oneDNN for bf16).

At batch 1 decoding is one matrix-vector product per layer, and the plain ``F.linear`` GEMV reaches only
~11-13 GB/s here; the same product on a weight reordered once into the library's blocked layout is ~2x
faster (what inductor's weight freezing does). The pack is built on the first no-grad forward and rebuilt
whenever the weight changes (in-place edits bump ``weight._version``: calibration folds scales into weights),
so it can never be stale. It costs one extra copy of the dense weights; the plain weight stays the source of
truth for state dicts, quantization and export. Anything else (grad, other dtypes/devices) uses ``F.linear``.

bf16 rows are batch-invariant: a row's output does not depend on how many rows run with it, so verifying
K+1 tokens gives bitwise the logits of decoding them one by one. oneDNN's one-row kernel breaks that for wide
inputs (down_proj here), so those layers run a lone row as two (~1-2% of a decode step).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _pack_fp32(weight: torch.Tensor):
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0])


def _pack_bf16(weight: torch.Tensor):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    if not _one_row_kernel_differs(linear, weight.shape):
        return linear
    return lambda x: linear(torch.cat((x, x)))[:1] if x.shape[0] == 1 else linear(x)


_ONE_ROW_DIFFERS: dict[tuple, bool] = {}


def _one_row_kernel_differs(linear, shape: torch.Size) -> bool:
    """Whether ``linear`` gives a row alone other bits than the same row among others. oneDNN runs one bf16
    row on its own kernel, which here sums inputs wider than 1024 in another order than its many-row kernel
    (bitwise equal to each other for every M measured). Probed once per shape and thread count with
    heavy-tailed rows, the kind of activations that expose a different summation order."""
    key = (tuple(shape), torch.get_num_threads())
    if key not in _ONE_ROW_DIFFERS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(33, shape[1], generator=g) * torch.randn(33, shape[1], generator=g).exp()
        x = x.to(torch.bfloat16)
        together = linear(x)
        _ONE_ROW_DIFFERS[key] = any(not torch.equal(linear(x[i:i + 1]), together[i:i + 1]) for i in range(32))
    return _ONE_ROW_DIFFERS[key]


PACKERS = {}
if torch.backends.mkl.is_available():
    PACKERS[torch.float32] = _pack_fp32
if torch.backends.mkldnn.is_available():
    PACKERS[torch.bfloat16] = _pack_bf16


class PackedLinear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters and state dict) with a cached prepacked inference path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed = None
        self._packed_key = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        packer = PACKERS.get(weight.dtype)
        if packer is None or weight.device.type != "cpu" or x.dtype != weight.dtype or (
                torch.is_grad_enabled() and weight.requires_grad):
            return F.linear(x, weight, self.bias)
        key = (weight.data_ptr(), weight._version, weight.shape)
        if self._packed_key != key:
            self._packed, self._packed_key = packer(weight.detach()), key
        y = self._packed(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*x.shape[:-1], weight.shape[0])
        return y + self.bias if self.bias is not None else y
