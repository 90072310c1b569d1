"""compressed-tensors checkpoints: write a quantized native model the way llm-compressor does, load it back.

``save_compressed`` writes ``config.json`` with a ``quantization_config`` (one config group targeting
``Linear``, the ignore list, ``format`` = ``pack-quantized`` for weight-only int4 / ``int-quantized`` for W8A8 /
``float-quantized`` for FP8 W8A8 / ``naive-quantized`` for FP8 weight-only / ``mxfp4-pack-quantized``,
``nvfp4-pack-quantized`` and ``mxfp8-quantized`` for the microscaling formats, ...), safetensors weights named
``model.layers.N....weight_packed | weight_scale | weight_zero_point | weight_shape`` (or int8 / float8_e4m3fn
``weight`` for the other formats; E8M0 ``weight_scale`` as uint8 exponents for MX, E4M3 ``weight_scale`` and fp32
``weight_global_scale`` for NVFP4, and ``input_global_scale`` for its activations), the tokenizer and the generation config. Packing is done by
compressed-tensors' own compressors (the format is the one it infers for the scheme). The directory appears
atomically (temp dir + rename).

``load_quantized`` (called by ``runtime.loading.load_model``) rebuilds the native model with real kernels;
a save/load round trip is bit-exact because checkpoints hold exactly what each kernel exports. A rotated model
(quant/rotation.py) is saved untied with its rotation under ``quantspec_rotation`` in config.json; the loader
recreates its online R4 from it.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.model_compressors import ModelCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors.torch import save_file
from torch import nn

from runtime.errors import UserError
from runtime.loading import build_model, load_state_dict
from quant.microscale import ct_args, loaded_scale, stored_scale
from quant.qlinear import QuantizedLinear
from quant.qmath import dequantize
from quant.rotation import CONFIG_KEY, reinstall
from quant.scheme import NUMBER_TYPES, ActSpec, QuantScheme, WeightSpec, parse_scheme
from quant.w8a8 import set_static_input_scales
from runtime.transformer import Transformer

HF_PREFIX = "model."
FP4_PACKED = ("mxfp4-pack-quantized", "nvfp4-pack-quantized")  # E2M1 codes two per byte (weight_packed)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else HF_PREFIX + name


def ct_scheme(scheme: QuantScheme, targets: tuple[str, ...] = ("Linear",)) -> QuantizationScheme:
    """Our scheme as a compressed-tensors ``QuantizationScheme`` targeting every Linear (or ``targets``), with the
    format compressed-tensors infers for it."""
    acts = ct_args(scheme.activations) if scheme.activations is not None else None
    qscheme = QuantizationScheme(targets=list(targets), weights=ct_args(scheme.weights), input_activations=acts)
    qscheme.format = infer_module_format(nn.Linear, qscheme).value
    return qscheme


BODY, HEAD = ("Linear",), ("lm_head",)  # the targets of a checkpoint's config groups


def layer_group(scheme: QuantScheme, name: str) -> tuple[QuantScheme, tuple[str, ...]]:
    """The scheme layer ``name`` is quantized with and the targets of its config group: the head's own for
    ``lm_head`` under ``@head=``, else the body's."""
    return (scheme.head_scheme, HEAD) if scheme.head and name == "lm_head" else (scheme, BODY)


def ct_groups(scheme: QuantScheme) -> dict[tuple[str, ...], QuantizationScheme]:
    """The config groups of a checkpoint by their targets: the body's, and the LM head's own (``@head=``)."""
    return {BODY: ct_scheme(scheme), **({HEAD: ct_scheme(scheme.head_scheme, HEAD)} if scheme.head else {})}


def _number_type(args: QuantizationArgs) -> str | None:
    """Our number type of compressed-tensors weight args (by code type and scale dtype), or None."""
    return next((name for name, t in NUMBER_TYPES.items()
                 if t.ct_type == args.type and t.scale_dtype == args.scale_dtype), None)


def scheme_from_ct(group: QuantizationScheme, ignore: list[str]) -> QuantScheme:
    """The inverse of ``ct_scheme`` for the int, FP8 and microscaling formats quantspec runs; anything else is a
    UserError (in one line, from our specs' checks where the args are a format we know but do not run)."""
    w, a = group.weights, group.input_activations
    number = _number_type(w) if w is not None else None
    square = w is not None and (w.block_structure is None or w.block_structure[0] == w.block_structure[1])
    if number is None or w.strategy not in ("tensor", "channel", "group", "tensor_group", "block") or not square:
        raise UserError(f"compressed-tensors scheme {group.model_dump(exclude_none=True)} is not a weight "
                        "format quantspec runs natively; load it with the vllm backend instead")
    granularity = "group" if w.strategy == "tensor_group" else w.strategy
    size = w.block_structure[0] if w.strategy == "block" else w.group_size
    weights = WeightSpec(w.num_bits, w.symmetric, granularity, size, number)
    acts = None
    if a is not None:
        a_number = _number_type(a)
        if a_number is None or a.strategy not in ("token", "tensor", "group", "tensor_group"):
            raise UserError(f"activation format {a.model_dump(exclude_none=True)} is not supported natively")
        a_granularity = "group" if a.strategy == "tensor_group" else a.strategy
        acts = ActSpec(a.num_bits, a_granularity, bool(a.dynamic), a.symmetric, a_number, a.group_size)
    return QuantScheme(weights, acts, tuple(ignore))


def _ct_scale_shape(scale: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    return scale.reshape(1) if spec.granularity == "tensor" else scale


def _compressed_layer(layer: QuantizedLinear, qscheme: QuantizationScheme, compressor) -> dict[str, torch.Tensor]:
    """One layer through compressed-tensors' compressor (which re-derives the codes from ``(q - z) * s``)."""
    q, scale, zero = layer.export()
    weight = dequantize(q, scale.float(), zero, layer.spec)
    local = {"weight": weight, "weight_scale": _ct_scale_shape(stored_scale(scale, layer.global_scale), layer.spec),
             "weight_zero_point": _ct_scale_shape(zero, layer.spec)}
    if layer.global_scale is not None:
        local["weight_global_scale"] = layer.global_scale
    if layer.bias is not None:
        local["bias"] = layer.bias.detach()
    if getattr(layer.kernel, "input_scale", None) is not None:  # static W8A8 (quant/w8a8.py)
        local["input_scale"] = layer.kernel.input_scale
    if getattr(layer.kernel, "input_global_scale", None) is not None:  # NVFP4 activations
        local["input_global_scale"] = layer.kernel.input_global_scale
    return compressor.compress(local, qscheme)


def save_compressed(lm, report_or_scheme, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write ``lm`` (already quantized in place) as a compressed-tensors checkpoint; returns the directory."""
    scheme = getattr(report_or_scheme, "scheme", report_or_scheme)
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise UserError(f"output dir {out} already exists; pass --overwrite or choose another --out")
    if scheme.pad:
        raise UserError(f"{scheme.label}: padded groups have no compressed-tensors layout (vLLM cannot load them); "
                        "pick a group size that divides every input width")
    model = lm.model
    qlayers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if not qlayers:
        raise UserError("the model has no quantized layers; quantize it first (quant.quantize.quantize_model)")
    groups = ct_groups(scheme)
    formats = {g.format for g in groups.values()}
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"  # each group names its own

    tied = model.args.tie_word_embeddings
    state = {}
    for name, tensor in model.state_dict().items():
        owner = name.rsplit(".", 1)[0]
        if any(owner == q or owner.startswith(q + ".") for q in qlayers) or (tied and name == "lm_head.weight"):
            continue
        state[hf_name(name)] = tensor
    for name, layer in qlayers.items():
        qscheme = groups[layer_group(scheme, name)[1]]
        compressor = BaseCompressor.get_value_from_registry(qscheme.format)
        for key, tensor in _compressed_layer(layer, qscheme, compressor).items():
            state[f"{hf_name(name)}.{key}"] = tensor
    dense_linears = [hf_name(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    qconfig = QuantizationConfig(config_groups={f"group_{i}": g for i, g in enumerate(groups.values())},
                                 ignore=dense_linears, format=fmt,
                                 quantization_status="compressed")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        config = {k: v for k, v in lm.config.items() if k not in ("quantization_config", CONFIG_KEY)}
        config["torch_dtype"] = config["dtype"] = DTYPE_NAMES[lm.dtype]
        config["tie_word_embeddings"] = tied  # a rotation unties the LM head
        if model.rotation is not None:
            config[CONFIG_KEY] = model.rotation
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        ModelCompressor(quantization_config=qconfig).update_config(str(tmp))
        lm.tokenizer.save_pretrained(tmp)
        gen_cfg = Path(lm.path) / "generation_config.json"
        if gen_cfg.exists():
            shutil.copy(gen_cfg, tmp / "generation_config.json")
        if hasattr(report_or_scheme, "to_dict"):
            (tmp / "quantspec_report.json").write_text(json.dumps(report_or_scheme.to_dict(), indent=2, default=str))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move ``tmp`` to ``out``; an existing ``out`` is swapped away first and removed only after the move."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _layer_codes(state: dict, name: str, spec: WeightSpec, fmt: str):
    """(codes [N, K] in ``spec.code_dtype``, effective scale, zero int8, global scale or None) of one layer from a
    compressed state dict (keys without ``model.``)."""
    gscale = state.pop(f"{name}.weight_global_scale", None)
    scale = loaded_scale(state.pop(f"{name}.weight_scale"), spec, gscale)
    if spec.granularity == "tensor":
        scale = scale.reshape(1, 1)
    if fmt in FP4_PACKED:
        packed = state.pop(f"{name}.weight_packed")
        q = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, torch.float32)
        zero = None
    elif fmt == "pack-quantized":
        shape = torch.Size(state.pop(f"{name}.weight_shape").tolist())
        q = unpack_from_int32(state.pop(f"{name}.weight_packed"), spec.bits, shape)
        zero = state.pop(f"{name}.weight_zero_point", None)
        if zero is not None and spec.granularity != "tensor":
            zero = unpack_from_int32(zero, spec.bits, torch.Size((shape[0], scale.shape[-1])), packed_dim=0)
    else:
        q = state.pop(f"{name}.weight")
        zero = state.pop(f"{name}.weight_zero_point", None)
    zero = torch.zeros_like(scale, dtype=torch.int8) if zero is None else zero.reshape(scale.shape).to(torch.int8)
    return q.to(spec.code_dtype), scale, zero, gscale


def load_quantized(path: str | Path, config: dict, dtype: torch.dtype, attention: str = "sdpa") -> Transformer:
    """Build the native Transformer from a compressed-tensors checkpoint, quantized layers on real kernels."""
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    groups = {tuple(g.targets): g for g in qconfig.config_groups.values() if isinstance(g, QuantizationScheme)}
    if BODY not in groups or set(groups) - {BODY, HEAD}:
        raise UserError(f"{path}: quantspec loads checkpoints with one config group targeting Linear (and one "
                        f"targeting lm_head); this one has {list(qconfig.config_groups)}")
    scheme = scheme_from_ct(groups[BODY], qconfig.ignore or [])
    if HEAD in groups:
        head_weights = scheme_from_ct(groups[HEAD], []).weights
        scheme = replace(scheme, ignore=(*scheme.ignore, "lm_head"), head=head_weights)
    formats = {targets: g.format or qconfig.format for targets, g in groups.items()}
    for fmt in formats.values():
        if fmt not in ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "mxfp8-quantized",
                       *FP4_PACKED):
            raise UserError(f"{path}: compressed-tensors format {fmt!r} is not supported natively")
    state = load_state_dict(Path(path))
    qnames = [k.removesuffix(".weight_scale") for k in state if k.endswith(".weight_scale")]
    saved = {name: layer_group(scheme, name) for name in qnames}  # (its scheme, its group's targets)
    layers = {name: _layer_codes(state, name, saved[name][0].weights, formats[saved[name][1]]) for name in qnames}
    biases = {name: state.pop(f"{name}.bias", None) for name in qnames}
    input_scales = {name: state.pop(f"{name}.input_scale") for name in qnames if f"{name}.input_scale" in state}
    global_inputs = {name: state.pop(f"{name}.input_global_scale") for name in qnames
                     if f"{name}.input_global_scale" in state}

    # dense parts first: the quantized layers' scales keep the dtype they were saved in
    model = build_model(config, state, dtype, placeholders=tuple(qnames), source=str(path), attention=attention)
    for name, (q, scale, zero, gscale) in layers.items():
        own = saved[name][0]
        model.set_submodule(name, QuantizedLinear(q, scale, zero, own.weights, q.shape[1], biases[name],
                                                   own.activations, dtype, global_scale=gscale))
    if input_scales:  # static W8A8: per-tensor activation scales (quant/w8a8.py)
        set_static_input_scales(model, scheme.activations, input_scales)
    for name, scale in global_inputs.items():  # NVFP4 activations
        model.get_submodule(name).kernel.set_input_global_scale(scale)
    if CONFIG_KEY in config:  # R1 and R2 are in the weights; R4 runs online
        reinstall(model, config[CONFIG_KEY])
    return model.eval()

