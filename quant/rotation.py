"""Hadamard rotations (QuaRot / SpinQuant style) of a native Transformer before quantization: ``--rotate hadamard``.

An orthogonal ``Q`` spreads outlier channels over all channels, so weights and activations quantize with less
error, while the full-precision model computes the same function:

* **R1** (hidden size, random Hadamard): every RMSNorm's weight is folded into the Linears it feeds first (the norms
  become weight 1, which is what lets RMSNorm commute with ``Q``: ``rms(hQ) = rms(h)``), then the residual stream
  is rotated: embedding rows ``E -> E Q``, every Linear reading it (q/k/v/gate/up, lm_head) ``W -> W Q``, every
  Linear writing it (o_proj, down_proj) ``W -> Qᵀ W``. A tied LM head is untied (it needs the folded final norm,
  the embedding does not).
* **R2** (head dim, Sylvester Hadamard ``H``): v_proj's output rows per kv head ``W_h -> Hᵀ W_h`` (and its bias),
  o_proj's input columns per query head ``W_j -> W_j H``; one ``H`` for every head, so grouped-query attention is
  consistent (attention mixes positions, not channels, so ``v H`` comes out as ``o H``).
* **R4** (intermediate size, random Hadamard): down_proj's input columns ``W -> W Q4`` offline, and
  ``x -> x Q4`` online before it (``runtime.transformer.OnlineRotation``: a dense fp32 matmul, no speed claimed).

Matrices are compressed-tensors' own (``random_hadamard_matrix``: sizes ``K * 2^m`` for its stored ``K``;
``deterministic_hadamard_matrix``: powers of two), scaled to be orthonormal; the random signs come from ``seed``.
Weights are rotated in float64 and cast back once. Exports record ``Transformer.rotation`` in config.json
(``quantspec_rotation``), from which the loader recreates R4 (``reinstall``). compressed-tensors'
``transform_config`` is not used: its ``random-hadamard`` factory draws signs from its own generator and vLLM then
expects the matrix stored as a tensor, so vLLM refuses rotated points (``quant.vllm_support.ROTATION_REFUSAL``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from quant.folding import FoldGroup, block_fold_groups, fold_scale
from quant.methods import METHODS, get_method
from quant.scheme import QuantScheme
from runtime.errors import UserError
from runtime.registry import Registry
from runtime.transformer import ModelArgs, OnlineRotation, RMSNorm, Transformer

NONE = "none"
CONFIG_KEY = "quantspec_rotation"  # config.json field of rotated exports


@dataclass(frozen=True)
class Matrices:
    """The orthonormal float64 matrices of one rotation: R1 [dim, dim], R2 [head_dim, head_dim], R4 [inter, inter]."""

    r1: torch.Tensor
    r2: torch.Tensor
    r4: torch.Tensor


def _random_hadamard(random_hadamard_matrix, size: int, what: str, seed: int) -> torch.Tensor:
    try:
        h = random_hadamard_matrix(size, torch.float64, gen=torch.Generator().manual_seed(seed))
    except ValueError:
        raise UserError(f"no Hadamard matrix of size {size} ({what}): compressed-tensors builds K * 2^m for K in "
                        "1, 12, 16, 20, ..., 256; use --rotate none for this model") from None
    return h / math.sqrt(size)


def hadamard_matrices(args: ModelArgs, seed: int = 0) -> Matrices:
    """R1, R2, R4 for a model's shapes, or a one-line UserError for a shape they cannot have."""
    # compressed-tensors loads in seconds: only when rotating
    from compressed_tensors.transform.utils.hadamard import (deterministic_hadamard_matrix, is_pow2,
                                                             random_hadamard_matrix)

    if not is_pow2(args.head_dim):
        raise UserError(f"rotation needs a power-of-two head dim (R2 is a Sylvester Hadamard per head), this model's "
                        f"is {args.head_dim}; use --rotate none")
    r2 = deterministic_hadamard_matrix(args.head_dim, torch.float64) / math.sqrt(args.head_dim)
    return Matrices(_random_hadamard(random_hadamard_matrix, args.dim, "hidden size, R1", seed), r2,
                    _random_hadamard(random_hadamard_matrix, args.intermediate_size, "intermediate size, R4", seed + 1))


def _transform(linear: nn.Module, left: torch.Tensor | None = None, right: torch.Tensor | None = None) -> None:
    """``W -> left @ W @ right`` in float64 for a Linear or the embedding (an in-place edit: packed weights
    rebuild)."""
    w = linear.weight.double()
    w = left @ w if left is not None else w
    linear.weight.copy_((w @ right if right is not None else w).to(linear.weight.dtype))


def _fold_norms(model: Transformer) -> None:
    """Every RMSNorm's weight into the Linears it feeds (``quant.folding``); the norms become exactly 1."""
    groups = [g for i in range(len(model.layers)) for g in block_fold_groups(model, i)
              if isinstance(g.producer, RMSNorm)]
    groups.append(FoldGroup("norm", model.norm, {"lm_head": model.lm_head}))
    for group in groups:
        fold_scale(group, group.producer.weight.detach().clone())
        group.producer.weight.fill_(1.0)


def recorded_rotation(model: str | Path) -> dict | None:
    """The rotation a local checkpoint's config.json records (None: not rotated, or not a local checkpoint)."""
    config = Path(model) / "config.json"
    return json.loads(config.read_text()).get(CONFIG_KEY) if config.is_file() else None


def install_hadamard_online(model: Transformer, rotation: dict) -> None:
    """The online part of a Hadamard ``rotation`` (R4 before every down_proj; one shared matrix), as recorded."""
    r4 = hadamard_matrices(model.args, rotation["seed"]).r4
    online = OnlineRotation(r4)
    for block in model.layers:
        block.mlp.down_input = online
    model.rotation = rotation


@torch.no_grad()
def rotate_hadamard(lm, seed: int = 0) -> dict:
    """Rotate ``lm.model`` in place by R1, R2 and R4 (see the module docstring); returns what was applied."""
    model = lm.model
    if model.rotation is not None:
        raise UserError(f"{lm.path} is rotated already ({model.rotation['rotate']}); load it without --rotate")
    linears = [m for name, m in model.named_modules() if name.endswith(("_proj", "lm_head"))]
    if not all(isinstance(m, nn.Linear) for m in linears):
        raise UserError(f"{lm.path} is quantized: rotate the full-precision model (--rotate while quantizing it)")
    args = model.args
    m = hadamard_matrices(args, seed)  # refusals before any change
    model.untie_lm_head()
    _fold_norms(model)
    r1, r1t = m.r1, m.r1.T
    for reader in (model.embed_tokens, model.lm_head):  # [vocab, dim] each, rows in the residual basis: W -> W Q
        _transform(reader, right=r1)
    heads_v = torch.block_diag(*[m.r2] * args.n_kv_heads)
    heads_o = torch.block_diag(*[m.r2] * args.n_heads)
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        for linear in (attn.q_proj, attn.k_proj, mlp.gate_proj, mlp.up_proj):
            _transform(linear, right=r1)
        _transform(attn.v_proj, left=heads_v.T, right=r1)
        if attn.v_proj.bias is not None:
            attn.v_proj.bias.copy_((attn.v_proj.bias.double() @ heads_v).to(attn.v_proj.bias.dtype))
        _transform(attn.o_proj, left=r1t, right=heads_o)
        _transform(mlp.down_proj, left=r1t, right=m.r4)
    rotation = {"rotate": "hadamard", "seed": seed, "r1": args.dim, "r2": args.head_dim, "r4": args.intermediate_size,
                "online": "R4 before mlp.down_proj (dense fp32 matmul)"}
    install_hadamard_online(model, rotation)
    return dict(rotation)


@dataclass(frozen=True)
class Rotation:
    """A registered rotation: ``apply(lm, seed) -> dict`` rotates a full-precision model in place and returns what
    it records (``rotate``: its name, and what ``online(model, record)`` needs to recreate its online part on a
    loaded checkpoint whose weights are rotated already)."""

    apply: Callable[..., dict]
    online: Callable[[Transformer, dict], None]


ROTATIONS: Registry[Rotation] = Registry("rotation")
ROTATIONS.add("hadamard", Rotation(rotate_hadamard, install_hadamard_online))


def parse_rotate(text: str | None) -> str | None:
    """``none`` / None / "" -> None; else a registered rotation's name (a UserError for any other)."""
    if text is None or str(text).strip().lower() in ("", NONE):
        return None
    ROTATIONS.get(str(text).strip())
    return str(text).strip()


def check_rotation(rotate: str | None, method: str, scheme: QuantScheme | None = None,
                   smoothquant: float | None = None) -> None:
    """Refuse, in one line, what a rotation cannot run with: no weight scheme, SmoothQuant or static activation
    scales (with ``scheme`` / ``smoothquant``), a weight method that cannot run on a rotated model (AWQ)."""
    rotate = parse_rotate(rotate)
    if rotate is None:
        return
    if scheme is not None and scheme.weights is None:
        raise UserError(f"--rotate {rotate} rotates before quantizing: give a weight scheme (e.g. "
                        "w4g32-sym_a4tok-dyn)")
    if smoothquant is not None or (scheme is not None and scheme.static_activations):
        raise UserError(f"--rotate {rotate} with SmoothQuant or static activation scales is not built: use "
                        "dynamic activations (a8tok-dyn, a4tok-dyn) without --smoothquant")
    reason = get_method(method).rotation_refusal
    if reason:
        able = ", ".join(n for n, m in METHODS.items() if m.rotation_refusal is None)
        raise UserError(f"method {method!r} cannot quantize a rotated model ({reason}): use {able}, or --rotate none")


def apply_rotation(lm, rotate: str | None, seed: int = 0) -> dict:
    """Rotate ``lm`` by the named rotation (nothing for None); returns what was applied ({} for None)."""
    name = parse_rotate(rotate)
    return ROTATIONS.get(name).apply(lm, seed) if name is not None else {}


def reinstall(model: Transformer, record: dict) -> None:
    """The online part of a loaded checkpoint's recorded rotation (its weights are rotated already)."""
    ROTATIONS.get(record["rotate"]).online(model, record)
