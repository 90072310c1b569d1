"""Fold per-input-channel scales into the op that produces a Linear's input (AWQ, SmoothQuant).

With ``s`` [in] the consumers compute ``(x / s) @ (W * s)ᵀ == x @ Wᵀ``: the ``1 / s`` goes into the producer
(an RMSNorm's weight, or a preceding Linear's output rows), the ``s`` into every consumer's input columns.
The model stays mathematically equivalent in full precision and needs no runtime input scale.
Producers/consumers of one block of the native Transformer (runtime/transformer.py):

* ``input_layernorm`` -> q_proj, k_proj, v_proj
* ``post_attention_layernorm`` -> gate_proj, up_proj
* ``v_proj`` -> ``o_proj`` (through attention, which is linear in v; with grouped-query attention one kv
  channel feeds ``n_heads / n_kv_heads`` o_proj channels, so ``s`` lives on the kv channels)
* ``up_proj`` -> ``down_proj`` (``silu(gate) * up`` is linear in up)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FoldGroup:
    """Consumers sharing one input and the producer a scale folds into.

    ``kv_repeat`` > 1 when the producer is v_proj: ``s`` has the producer's width and is repeated per query head
    (see ``expand_kv_scale``) to reach the consumer's input width.
    """

    name: str  # e.g. "layers.3.qkv"
    producer: nn.Module  # RMSNorm or nn.Linear
    consumers: dict[str, nn.Linear]  # module name -> Linear
    kv_repeat: int = 1
    head_dim: int = 0

    def consumer_scale(self, s: torch.Tensor) -> torch.Tensor:
        """``s`` (producer width) expanded to the consumers' input width."""
        return expand_kv_scale(s, self.kv_repeat, self.head_dim) if self.kv_repeat > 1 else s

    def reduce_to_producer(self, per_input: torch.Tensor) -> torch.Tensor:
        """A per-consumer-input statistic averaged over the channels that share one producer channel."""
        if self.kv_repeat == 1:
            return per_input
        n_kv = per_input.numel() // (self.kv_repeat * self.head_dim)
        return per_input.view(n_kv, self.kv_repeat, self.head_dim).mean(1).reshape(-1)


def expand_kv_scale(s: torch.Tensor, kv_repeat: int, head_dim: int) -> torch.Tensor:
    """kv-channel scales [n_kv * head_dim] -> attention-output scales [n_kv * kv_repeat * head_dim] (GQA order)."""
    n_kv = s.numel() // head_dim
    return s.view(n_kv, 1, head_dim).expand(n_kv, kv_repeat, head_dim).reshape(-1)


@torch.no_grad()
def fold_scale(group: FoldGroup, s: torch.Tensor) -> None:
    """Divide the producer's output channels by ``s`` and multiply the consumers' input columns by it."""
    s = s.to(torch.float32)
    producer = group.producer
    if isinstance(producer, nn.Linear):
        producer.weight.copy_((producer.weight.float() / s[:, None]).to(producer.weight.dtype))
        if producer.bias is not None:
            producer.bias.copy_((producer.bias.float() / s).to(producer.bias.dtype))
    else:  # RMSNorm: y = weight * normalized(x)
        producer.weight.copy_((producer.weight.float() / s).to(producer.weight.dtype))
    wide = group.consumer_scale(s)
    for linear in group.consumers.values():
        linear.weight.copy_((linear.weight.float() * wide[None, :]).to(linear.weight.dtype))


def block_fold_groups(model, layer_index: int) -> list[FoldGroup]:
    """The four fold groups of one decoder block, in the order activations flow."""
    block = model.layers[layer_index]
    attn, mlp, prefix = block.self_attn, block.mlp, f"layers.{layer_index}"
    return [
        FoldGroup(f"{prefix}.qkv", block.input_layernorm,
                  {f"{prefix}.self_attn.{n}": getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}),
        FoldGroup(f"{prefix}.o", attn.v_proj, {f"{prefix}.self_attn.o_proj": attn.o_proj},
                  kv_repeat=attn.n_heads // attn.n_kv_heads, head_dim=attn.head_dim),
        FoldGroup(f"{prefix}.gate_up", block.post_attention_layernorm,
                  {f"{prefix}.mlp.{n}": getattr(mlp, n) for n in ("gate_proj", "up_proj")}),
        FoldGroup(f"{prefix}.down", mlp.up_proj, {f"{prefix}.mlp.down_proj": mlp.down_proj}),
    ]


def fold_groups(model) -> list[FoldGroup]:
    """All fold groups of a native Transformer."""
    return [g for i in range(len(model.layers)) for g in block_fold_groups(model, i)]
