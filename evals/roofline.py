"""Memory roofline for batch-1 decoding: bytes read per token vs measured DRAM bandwidth."""
from __future__ import annotations

import statistics
import time

import torch

from runtime.hardware import sync


def measure_bandwidth(gib: float = 1.0, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Memory bandwidth in bytes/s, median of ``repeats``: on CPU read bandwidth (full reductions over a buffer far
    larger than cache, with all torch threads, the same threads decoding uses); on CUDA a big tensor copy (bytes
    read + written), synchronized at the edges."""
    n = int(gib * 2**30 / 4)
    x = torch.ones(n, dtype=torch.float32, device=device)
    if x.device.type == "cuda":
        y = torch.empty_like(x)
        run, moved = (lambda: y.copy_(x)), 2 * n * 4
    else:
        run, moved = x.sum, n * 4
    run()  # fault pages in / warm up
    times = []
    for _ in range(repeats):
        sync(x.device)
        t = time.perf_counter()
        run()
        sync(x.device)
        times.append(time.perf_counter() - t)
    return moved / statistics.median(times)


def decode_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights streamed per decode step: every parameter and packed-weight buffer once.

    The embedding table is only gathered (one row), so it counts only when tied to the LM head.
    KV caches and RoPE tables are not weights and are excluded."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed_tokens", None)
    tied = lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is embed.weight
    seen, total = set(), 0
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) in seen or "kv_cache" in name or name.startswith("rope_"):
            continue
        if name.startswith("embed_tokens") and not tied:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def roofline_tokens_per_s(bytes_per_token: int, bandwidth: float) -> float:
    return bandwidth / bytes_per_token
