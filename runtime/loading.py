"""Load a Llama-family HF checkpoint (safetensors only) into the native runtime."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from runtime.errors import UserError
from runtime.hardware import resolve_device
from runtime.model_store import resolve_model
from runtime.registry import Registry
from runtime.transformer import ATTENTION, ModelArgs, Transformer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# quantization_config["quant_method"] -> fn(path, config, dtype) -> Transformer; quant/ registers its formats.
CHECKPOINT_FORMATS: Registry = Registry("checkpoint format (import quant to register compressed-tensors)")
# One default for every command and API call: bf16 is the precision the low-bit kernels, the KV formats and
# batch-invariant speculation run at on this CPU, so speed and quality are measured on the same build; ask for
# fp32 (--dtype fp32) when you want an unrounded reference.
DEFAULT_DTYPE = "bf16"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object
    path: Path
    config: dict
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def precision(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]


def checkpoint_loader(config: dict):
    """The loader registered for a quantized checkpoint's ``quant_method``: ``(path, config, dtype, attention)
    -> Transformer``."""
    return CHECKPOINT_FORMATS.get(config["quantization_config"].get("quant_method", "compressed-tensors"))


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}: use one of fp32, bf16") from None


def set_threads(threads: int | None) -> None:
    if threads:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def read_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UserError(f"{path}: architecture {archs} not supported; native runtime runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    return config


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors first")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return {k.removeprefix("model."): v for k, v in state.items()}


def build_model(config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype,
                placeholders: tuple[str, ...] = (), source: str = "checkpoint", attention: str = "sdpa",
                device: torch.device | str = "cpu") -> Transformer:
    """Instantiate the native Transformer on ``device`` and load a dense HF state dict into it.

    Modules named in ``placeholders`` become ``nn.Identity`` (the caller puts quantized layers there)."""
    args = ModelArgs.from_hf_config(config)
    with torch.device("meta"):
        model = Transformer(args, attention)
    for name in placeholders:
        model.set_submodule(name, torch.nn.Identity())
    model = model.to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (args.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"{source} does not match the Llama layout: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.to(dtype).eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def load_model(name: str | Path, dtype: str | torch.dtype = "fp32", threads: int | None = None,
               attn_implementation: str = "sdpa", device: str | torch.device | None = "cpu") -> LoadedModel:
    """Resolve ``name`` (``default``, local dir, hub id) and load it for native decoding on ``device`` (cpu, cuda,
    or ``auto``/None: cuda when there is one). ``attn_implementation`` "eager" makes bf16 rows batch-invariant
    (token-exact greedy speculation); "sdpa" is faster on short histories."""
    ATTENTION.get(attn_implementation)  # an unknown name fails here, before anything loads
    device = resolve_device(device)
    set_threads(threads)
    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    path = resolve_model(name)
    config = read_config(path)
    if "quantization_config" in config:
        if device.type != "cpu":  # its kernels are picked and packed for the CPU while loading
            raise UserError(f"{path}: quantized checkpoints load on the CPU only so far; use --device cpu")
        model = checkpoint_loader(config)(path, config, torch_dtype, attn_implementation)
    else:
        model = build_model(config, load_state_dict(path), torch_dtype, attention=attn_implementation, device=device)
    return LoadedModel(model=model, tokenizer=load_tokenizer(path), path=path, config=config, dtype=torch_dtype)
