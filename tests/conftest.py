"""Shared fixtures: a tiny random Llama (unit tests) and the real default model (integration tests)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def make_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised HF Llama (+ a character-level tokenizer) as a safetensors dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_CONFIG, **overrides})
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    _save_char_tokenizer(path, config.vocab_size)
    return path


def _save_char_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(32, 32 + vocab_size - 3):
        vocab[chr(i)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from quant.model_store import fetch_default_model

    return fetch_default_model(log=lambda *_: None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model tests run fastest (and steadiest on a shared CPU) on one torch thread; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def pg_server():
    """A real PostgreSQL server for this session (tests/pg_server.py), stopped and removed afterwards. Where none
    can be started the test skips with the reason, except under CI=true, where it fails."""
    from pg_server import PgServer, PgUnavailable

    server = None
    try:
        server = PgServer()
        server.start()
    except PgUnavailable as exc:
        if server is not None:
            server.stop()
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but no PostgreSQL server: {exc}")
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty database on the session's PostgreSQL server."""
    return pg_server.new_database()
