"""Calibration data sources, config validation and per-layer input statistics on the tiny random Llama."""
from __future__ import annotations

import json

import pytest
import torch

from quant.calibration import CalibConfig, calibration_batches, collect_layer_stats
from runtime.errors import UserError
from runtime.loading import load_model


pytestmark = pytest.mark.isa


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.mark.parametrize("kwargs, message", [
    ({"samples": 0}, "samples must be >= 1"),
    ({"seqlen": 4}, "seqlen must be >= 8"),
    ({"source": "/nonexistent/calib.jsonl"}, "/nonexistent/calib.jsonl does not exist"),
    ({"source": "c4"}, "use wikitext2, self or a PATH.jsonl"),
])
def test_bad_calibration_config_is_a_user_error(kwargs, message):
    with pytest.raises(UserError, match=message):
        CalibConfig(**kwargs)


def test_batches_from_jsonl_are_seeded_windows_of_the_text(tiny_lm, tmp_path):
    path = tmp_path / "calib.jsonl"
    rows = [{"text": f"sample number {i} about quantization."} for i in range(20)] + [{"other": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = CalibConfig(source=str(path), samples=5, seqlen=16, seed=3)
    batches = calibration_batches(cfg, tiny_lm)
    assert len(batches) == 5 and all(len(b) == 16 for b in batches)
    stream = tiny_lm.tokenizer.encode("\n\n".join(r["text"] for r in rows[:20]), add_special_tokens=False)
    text = " ".join(map(str, stream))
    assert all(" ".join(map(str, b)) in text for b in batches)
    assert calibration_batches(cfg, tiny_lm) == batches
    assert calibration_batches(CalibConfig(source=str(path), samples=5, seqlen=16, seed=4), tiny_lm) != batches


def test_jsonl_without_text_or_too_short_is_a_user_error(tiny_lm, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(UserError, match='no rows with a "text" field'):
        calibration_batches(CalibConfig(source=str(path), samples=1, seqlen=8), tiny_lm)
    path.write_text(json.dumps({"text": "short"}) + "\n")
    with pytest.raises(UserError, match="fewer than seqlen 64"):
        calibration_batches(CalibConfig(source=str(path), samples=1, seqlen=64), tiny_lm)


def test_self_generated_batches_start_with_a_chat_prompt_and_avoid_eos(tiny_lm):
    batches = calibration_batches(CalibConfig(source="self", samples=3, seqlen=64, seed=0), tiny_lm)
    assert len(batches) == 3 and all(len(b) == 64 for b in batches)
    prompt_len = len(tiny_lm.tokenizer.encode("Tell me a story about a lighthouse keeper."))
    assert all(b[:prompt_len] == batches[0][:prompt_len] for b in batches)  # same seed prompt per chunk
    assert batches[0][prompt_len:] != batches[1][prompt_len:]  # temperature 1 sampling diverges
    assert all(2 not in b[prompt_len:] for b in batches)  # EOS suppressed


def test_wikitext2_source_reads_the_validation_tokens_file(tiny_lm, tmp_path):
    (tmp_path / "wikitext2" / "tokens").mkdir(parents=True)
    (tmp_path / "wikitext2" / "tokens" / "valid.txt").write_text(" = Valid = \n the <unk> was here . \n" * 5)
    batches = calibration_batches(CalibConfig(samples=2, seqlen=10, data_dir=tmp_path), tiny_lm)
    assert len(batches) == 2 and all(len(b) == 10 for b in batches)
    with pytest.raises(UserError, match="missing data file wikitext2/tokens/valid.txt"):
        calibration_batches(CalibConfig(samples=2, seqlen=10, data_dir=tmp_path / "wikitext2"), tiny_lm)


def test_collect_layer_stats_matches_direct_computation(tiny_lm):
    batches = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(0)).tolist()
    names = ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.1.mlp.down_proj"]
    stats = collect_layer_stats(tiny_lm, batches, names, max_samples=1000, batch_size=2)
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    modules = dict(tiny_lm.model.named_modules())
    handles = [modules[n].register_forward_pre_hook(lambda m, a, n=n: inputs[n].append(a[0].reshape(-1, a[0].shape[-1])))
               for n in names]
    for b in batches:  # one sequence at a time, full forward, independently of the collector
        tiny_lm.model.setup_cache(1, 12)
        with torch.inference_mode():
            tiny_lm.model(torch.tensor([b]), torch.arange(12))
    for h in handles:
        h.remove()
    for name in names:
        x = torch.cat(inputs[name]).double()
        st = stats[name]
        assert st.n_tokens == 36
        torch.testing.assert_close(st.hessian, x.T @ x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.abs_mean, x.abs().mean(0).float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.abs_max, x.abs().amax(0).float(), rtol=1e-5, atol=1e-6)
        assert st.samples.shape == (36, x.shape[1])  # max_samples above the token count keeps every row
    assert stats[names[0]] is stats[names[1]]  # q and k read the same tensor: one shared LayerStats
    with pytest.raises(UserError, match="no calibration batches"):
        collect_layer_stats(tiny_lm, [], names)
    with pytest.raises(UserError, match="no Linear layers named"):
        collect_layer_stats(tiny_lm, batches, ["layers.9.mlp.up_proj"])
