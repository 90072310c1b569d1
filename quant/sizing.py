"""Weight memory per number format, from a HF config alone (no weights loaded)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.loading import read_config
from runtime.model_store import is_default_model, resolve_model, weights_hash


@dataclass
class WeightSizes:
    parameters: int
    linear_parameters: int  # body Linear layers (what weight schemes quantize by default)
    bytes_by_format: dict[str, int]


def weight_bytes_by_format(config: dict) -> WeightSizes:
    """fp32/bf16 for everything; int8 (per-channel fp16 scales) and int4-g32 (fp16 scale + zero per 32)
    for body Linear layers with embeddings/lm_head kept in bf16, as the default schemes do."""
    d, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // heads
    attn = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2
    mlp = 3 * d * inter
    linear = layers * (attn + mlp)
    embed = config["vocab_size"] * d
    head = 0 if config.get("tie_word_embeddings") else embed
    norms = (2 * layers + 1) * d
    total = linear + embed + head + norms
    rest_bf16 = 2 * (embed + head + norms)
    out_channels = layers * (heads * head_dim + 2 * kv_heads * head_dim + d + 2 * inter + d)
    return WeightSizes(total, linear, {
        "fp32": 4 * total,
        "bf16": 2 * total,
        "int8 (per-channel)": linear + 2 * out_channels + rest_bf16,
        "int4 (g32 asym)": linear // 2 + 4 * (linear // 32) + rest_bf16,
    })


@dataclass
class ModelInfo:
    """What ``quantspec model info`` shows: the resolved path, its HF config, sizes per format, weights hash."""

    path: Path
    config: dict
    sizes: WeightSizes
    weights_hash: str
    q4_1_origin: bool  # the default model, whose body weights were Q4_1-dequantized


def model_info(model: str = "default") -> ModelInfo:
    path = resolve_model(model)
    config = read_config(path)
    return ModelInfo(path, config, weight_bytes_by_format(config), weights_hash(path), is_default_model(path))
