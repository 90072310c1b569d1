"""EAGLE-style draft heads (issue 16): training on the tiny model, exact speculation, refusing bad head files,
and a negative control (a head blind to the target's hidden state accepts less)."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import require_bf16_exact
from runtime.data import find_data_dir
from runtime.errors import UserError
from runtime.generate import Decoder, encode_prompt, greedy_batch
from runtime.loading import load_model
from specdec import eagle_head
from specdec.eagle_head import expected_shapes, head_config, load_head, new_head, save_head
from specdec.speculative import SpeculativeDecoder
from specdec.train_draft import (TrainConfig, alpaca_prompts, benchmark_turns, context_prompts, overlaps, train_head,
                                 wikitext_articles)
from quantspec.cli import main


pytestmark = pytest.mark.isa

FAST = TrainConfig(n_prompts=16, max_answer_tokens=48, n_wikitext=8, wikitext_len=64, epochs=10, batch=4, lr=1e-2)
PROMPTS = ["hello world, this is", "The quick brown fox", "Name three colors.", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def data_dir():
    path = find_data_dir(required=False)
    if path is None or not (path / "alpaca" / "alpaca_5000.json").exists():
        pytest.skip("no data dir with alpaca/alpaca_5000.json")
    return path


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir, one_thread):
    return load_model(tiny_llama_dir, "fp32", attn_implementation="eager")


@pytest.fixture(scope="module")
def trained(tiny, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    result = train_head(tiny, out, FAST, data_dir)
    return out, result


def acceptance(lm, spec, texts, k=1, n=48):
    sd = SpeculativeDecoder(lm, spec, k)
    acc = drafted = 0
    for p in texts:
        stats = sd.generate(encode_prompt(lm.tokenizer, p), n, ignore_eos=True).stats
        acc, drafted = acc + stats["accepted"], drafted + stats["draft_tokens"]
    return acc / drafted


def test_hidden_hook_leaves_logits_unchanged(tiny):
    ids = torch.tensor([[1, 5, 9, 40, 7]])
    pos = torch.arange(5)
    tiny.model.setup_cache(1, 64)
    plain = tiny.model(ids, pos)
    logits, hidden = tiny.model(ids, pos, return_hidden=True)
    assert torch.equal(plain, logits)
    assert torch.equal(tiny.model.lm_head(hidden), logits)
    a, b = Decoder(tiny, 64), Decoder(tiny, 64)
    b.keep_hidden()
    assert torch.equal(a.forward([1, 5, 9]), b.forward([1, 5, 9]))
    assert torch.allclose(b.hidden[:3], hidden[0, :3], atol=1e-5)  # 3 rows vs 5: fp32 GEMMs may round apart


def chain_error(head, embeds, hidden, steps):
    """Largest gap between ``head.unroll`` and drafting itself: for every step s and position t, a fresh cache
    fed the real pairs up to t-s+1, then s-1 chain steps on the head's own states (as EagleProposer drafts)."""
    T = embeds.shape[1]
    preds = head.unroll(embeds, hidden, steps)
    worst = 0.0
    for s in range(1, steps + 1):
        for t in range(s - 1, T):
            start = t - s + 1
            head.setup_cache(T)
            h = head(embeds[:, : start + 1], hidden[:, : start + 1], torch.arange(start + 1))[0, -1]
            for pos in range(start + 1, t + 1):
                h = head(embeds[:, pos : pos + 1], h[None, None], torch.tensor([pos]))[0, -1]
            worst = max(worst, float((h - preds[s - 1][0, t]).abs().max()))
    head.k_cache = head.v_cache = None
    return worst


@pytest.fixture(params=[((), 1), ((0,), 1), ((), 2)], ids=["final-state", "fused", "two-layer"])
def random_head(tiny, request):
    """(a head with random fc (and fuse), embeds, target states): fused heads read wider target states at real
    positions and their own dim-wide states along the chain; a two-layer head caches keys per layer."""
    fuse_layers, head_layers = request.param
    head = new_head(tiny.config, torch.float32, seed=1, fuse_layers=fuse_layers, head_layers=head_layers)
    torch.manual_seed(2)
    torch.nn.init.normal_(head.fc.weight, std=0.1)  # the head's own states matter (fc starts as [0 | I])
    if fuse_layers:
        torch.nn.init.normal_(head.fuse.weight, std=0.1)
    d = tiny.model.args.dim
    return head, torch.randn(1, 10, d), torch.randn(1, 10, d * (len(fuse_layers) + 1))


@torch.no_grad()
def test_training_time_test_is_the_drafting_chain(random_head):
    """Step s of the training-time unroll at position t is exactly the drafting chain that began after t-s+1."""
    head, embeds, hidden = random_head
    assert chain_error(head, embeds, hidden, 3) < 1e-5


@torch.no_grad()
def test_negative_control_training_time_test_with_a_plain_causal_mask(random_head, monkeypatch):
    """Steps >= 2 attending causally over their own step only (not the chain's cache) are caught."""
    head, embeds, hidden = random_head
    T = embeds.shape[1]

    def own_step_causal(n, s):
        return torch.cat([torch.zeros(n, (s - 1) * n, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)

    assert own_step_causal(T, 3).shape == eagle_head.chain_mask(T, 3).shape
    monkeypatch.setattr(eagle_head, "chain_mask", own_step_causal)
    assert chain_error(head, embeds, hidden, 3) > 1e-3


def llama_reference(head: eagle_head.EagleHead, tiny, embeds, hidden):
    """The same head computed by transformers' LlamaModel (what vLLM's LlamaDecoderLayer computes): its layers
    take the head's weights, layer 0 without its input norm, no final norm, over fc(embed | hidden)."""
    from transformers import LlamaConfig, LlamaModel

    ref = LlamaModel(LlamaConfig(**{**tiny.config, "num_hidden_layers": len(head.layers)})).eval()
    assert not ref.load_state_dict({k: v for k, v in head.state_dict().items() if k.startswith("layers.")},
                                   strict=False).unexpected_keys
    ref.layers[0].input_layernorm = torch.nn.Identity()
    ref.norm = torch.nn.Identity()
    return ref(inputs_embeds=head.fc(torch.cat((embeds, hidden), -1))).last_hidden_state


@torch.no_grad()
def test_head_layers_are_llama_decoder_layers(tiny):
    """A two-layer head equals transformers' Llama layers on its weights (vLLM's EAGLE layout: only layer 0 lacks
    the input norm). Negative control: layer 1 without its input norm is caught."""
    head = new_head(tiny.config, torch.float32, seed=1, head_layers=2)
    torch.manual_seed(3)
    for name, p in head.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.2 if "norm" in name else 0.1)
    d = tiny.model.args.dim
    embeds, hidden = torch.randn(1, 9, d), torch.randn(1, 9, d)
    want = llama_reference(head, tiny, embeds, hidden)
    assert (head(embeds, hidden, torch.arange(9)) - want).abs().max() < 1e-4
    del head.layers[1].input_layernorm
    assert (head(embeds, hidden, torch.arange(9)) - want).abs().max() > 1e-2


ANSWER_PROMPTS = PROMPTS + ["a", "Count: one two three four five six seven", "zz top"]


@pytest.fixture(scope="module")
def answers(tiny):
    """(prompts of different lengths, each one's greedy answer decoded alone)."""
    prompts = [tiny.tokenizer.encode(p) for p in ANSWER_PROMPTS]
    assert len({len(p) for p in prompts}) > 3  # real padding
    return prompts, [Decoder(tiny).generate(ids, 24).tokens for ids in prompts]


def test_batched_answers_equal_one_at_a_time(tiny, answers):
    """Training answers come from a left-padded greedy batch: row by row they are the one-at-a-time answers."""
    prompts, one = answers
    assert greedy_batch(tiny, prompts, 24) == one
    assert greedy_batch(tiny, prompts[:1], 24) == one[:1]


def test_batched_answers_negative_control_padding_seen(tiny, answers, monkeypatch):
    """With the padding hidden from nobody (``pad`` dropped), the padded rows' answers change."""
    prompts, one = answers
    forward = type(tiny.model).forward
    monkeypatch.setattr(type(tiny.model), "forward", lambda self, *a, pad=None, **kw: forward(self, *a, **kw))
    broken = greedy_batch(tiny, prompts, 24)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert broken[longest] == one[longest]  # the unpadded row is unaffected
    assert sum(b != o for b, o in zip(broken, one)) >= len(prompts) // 2, (broken, one)


def test_training_writes_vllm_eagle_layout(trained, tiny):
    out, result = trained
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == tiny.config["hidden_size"]
    assert cfg["vocab_size"] == tiny.config["vocab_size"] and "draft_vocab_size" not in cfg
    state = load_file(out / "model.safetensors")
    assert set(state) == set(expected_shapes(tiny.model.args))  # fc + layers.0.*, no lm_head / embeddings
    assert "layers.0.input_layernorm.weight" not in state  # vLLM disables it on EAGLE's first layer
    assert len(result.epochs) == FAST.epochs and all(0 <= e["heldout_top1"] <= 1 for e in result.epochs)
    assert all(len(e["heldout_chain"]) == 3 and e["heldout_chain"][0] == e["heldout_top1"] for e in result.epochs)
    assert result.extract_s > 0 and result.train_s > 0 and result.eval_s > 0 and result.n_heldout_tokens > 0
    assert result.epochs[-1]["reg"] < result.epochs[0]["reg"]


def test_train_seconds_caps_the_whole_training_loop(tiny, data_dir, tmp_path):
    """The cap counts training time over all epochs (a cap checked per epoch, as it once was, never stops a run
    whose epochs are each shorter than it: all 400 epochs would run)."""
    from dataclasses import replace

    cap = 1.0
    result = train_head(tiny, tmp_path, replace(FAST, n_prompts=4, n_wikitext=2, epochs=400, train_seconds=cap), data_dir)
    assert len(result.epochs) < 400
    assert result.train_s < cap + 0.5, result.train_s  # one step past the cap at most (a step is ~10 ms here)


def test_vllm_speculative_config_for_a_head(trained, tiny, tmp_path):
    """eagle:PATH maps to vLLM's EAGLE-1 method on the saved folder; what that loader can't read is refused."""
    from serving.backends.base import ServingConfig
    from evals.config import Config
    from serving.backends.vllm_engine import speculative_config

    out, _ = trained

    def vllm(spec):
        return speculative_config(ServingConfig(Config.parse(model=str(tiny.path), backend="vllm", spec=spec, k=3),
                                                max_model_len=256))

    assert vllm(f"eagle:{out}") == {"method": "eagle", "model": str(out.resolve()), "num_speculative_tokens": 3}
    reduced = tmp_path / "reduced"
    reduced.mkdir()
    cfg = json.loads((out / "config.json").read_text())
    (reduced / "config.json").write_text(json.dumps(cfg | {"draft_vocab_size": cfg["vocab_size"] // 2}))
    for spec, needle in ((f"eagle:{out},weights=w8ch-sym", "quantized head"), (f"eagle:{reduced}", "EAGLE-3"),
                         (f"eagle:{tmp_path}", "no config.json")):
        with pytest.raises(UserError, match=needle):
            vllm(spec)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_token_identical(trained, tiny, k):
    out, _ = trained
    sd = SpeculativeDecoder(tiny, f"eagle:{out}", k)
    for p in PROMPTS:
        ids = tiny.tokenizer.encode(p)
        plain = Decoder(tiny).generate(ids, 40, ignore_eos=True).tokens
        assert sd.generate(ids, 40, ignore_eos=True).tokens == plain


def test_greedy_token_identical_bf16(trained, tiny_llama_dir):
    out, _ = trained
    lm = load_model(tiny_llama_dir, "bf16", attn_implementation="eager")
    require_bf16_exact(lm)  # where the probe refuses bf16 speculation (test_hardware tests the refusal), skip
    sd = SpeculativeDecoder(lm, f"eagle:{out}", 4)
    for p in PROMPTS[:2]:
        ids = lm.tokenizer.encode(p)
        assert sd.generate(ids, 40, ignore_eos=True).tokens == Decoder(lm).generate(ids, 40, ignore_eos=True).tokens


def test_int8_head(trained, tiny):
    """``weights=w8ch-sym``: the head's linears run int8 (quant/ kernels); still token-exact, acceptance close to
    the bf16 head's; a bad option or scheme is refused in one line."""
    from quant.qlinear import QuantizedLinear

    out, _ = trained
    sd = SpeculativeDecoder(tiny, f"eagle:{out},weights=w8ch-sym", 3)
    assert sd.proposer.label == f"eagle:{out},weights=w8ch-sym"
    assert sum(isinstance(m, QuantizedLinear) for m in sd.proposer.head.modules()) == 8  # fc + 4 attn + 3 mlp
    ids = tiny.tokenizer.encode(PROMPTS[0])
    assert sd.generate(ids, 40, ignore_eos=True).tokens == Decoder(tiny).generate(ids, 40, ignore_eos=True).tokens
    int8, bf16 = (acceptance(tiny, f"eagle:{out}{w}", PROMPTS[:2]) for w in (",weights=w8ch-sym", ""))
    assert abs(int8 - bf16) < 0.1, (int8, bf16)
    for spec, needle in ((f"eagle:{out},bits=8", "bad parameter 'bits=8'; use weights="),
                         (f"eagle:{out},weights=W8A8", "weight-only"), (f"eagle:{out},weights=w9", "unknown scheme")):
        with pytest.raises(UserError, match=needle):
            SpeculativeDecoder(tiny, spec, 2)


def test_sampling_runs(trained, tiny):
    from runtime.sampling import SamplingConfig

    out, _ = trained
    sd = SpeculativeDecoder(tiny, f"eagle:{out}", 3, SamplingConfig(temperature=0.8, seed=1))
    res = sd.generate(tiny.tokenizer.encode(PROMPTS[0]), 30, ignore_eos=True)
    assert len(res.tokens) == 30 and res.stats["draft_tokens"] > 0


def test_negative_control_blind_head_accepts_less(trained, tiny, data_dir, tmp_path):
    """On the target's own answers to unseen instructions, the trained head accepts measurably more than the same
    head with its hidden-state input zeroed. (An untrained head is no control here: its fc starts as a
    pass-through, which drafts "repeat the last token", and the random tiny model's greedy text mostly repeats.)"""
    out, _ = trained
    head, _, cfg = load_head(out, tiny.config, torch.float32)
    with torch.no_grad():
        head.fc.weight[:, tiny.model.args.dim:] = 0
    save_head(head, tmp_path / "blind", cfg)
    texts = alpaca_prompts(FAST.n_prompts + 4, data_dir, FAST.seed)[0][-4:]  # not among the training prompts
    alphas = {name: acceptance(tiny, f"eagle:{path}", texts) for name, path in
              (("trained", out), ("blind", tmp_path / "blind"))}
    assert alphas["trained"] > alphas["blind"] + 0.1, alphas


def test_reduced_draft_vocabulary(tiny, data_dir, tmp_path):
    cfg = TrainConfig(n_prompts=8, max_answer_tokens=32, n_wikitext=4, wikitext_len=64, epochs=2, batch=4,
                      draft_vocab=48)
    train_head(tiny, tmp_path, cfg, data_dir)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 48
    assert load_file(tmp_path / "model.safetensors")["d2t"].shape == (48,)
    _, d2t, _ = load_head(tmp_path, tiny.config, torch.float32)
    assert d2t.shape == (48,) and len(set(d2t.tolist())) == 48
    sd = SpeculativeDecoder(tiny, f"eagle:{tmp_path}", 3)
    ids = tiny.tokenizer.encode(PROMPTS[1])
    assert sd.generate(ids, 32, ignore_eos=True).tokens == Decoder(tiny).generate(ids, 32, ignore_eos=True).tokens


def test_benchmark_overlap_filter(data_dir):
    turns = ["write a persuasive essay about the benefits of renewable energy sources."]
    assert overlaps("Write a persuasive essay about the benefits of  renewable energy sources.", turns)
    assert not overlaps("Name three colors.", turns)
    prompts, dropped = alpaca_prompts(5000, data_dir)
    assert dropped >= 1 and len(prompts) + dropped == 5000


def test_context_prompts_are_training_text(tiny, data_dir):
    """Long-context prompts come from WikiText-2 validation passages of the asked length, in both shapes, and
    overlap no benchmark turn."""
    prompts = context_prompts(tiny.tokenizer, 6, 48, data_dir)
    assert len(set(prompts)) == 6
    assert all(p.startswith("Summarize: ") for p in prompts[::2])
    assert all(p.endswith("?") and "\nWhat does the text say about " in p for p in prompts[1::2])
    passage = prompts[0].removeprefix("Summarize: ")
    bodies = "".join(body for _, body in wikitext_articles(data_dir)).replace(" ", "")
    assert passage.replace(" ", "")[:30] in bodies  # (the tiny tokenizer decodes with spaces between characters)
    turns = benchmark_turns(data_dir)
    assert not any(overlaps(p, turns) for p in prompts)


def test_train_config_refuses_bad_values_in_one_line():
    """Checked where the configuration is built, so the Python API and the CLI refuse alike (naming the flag)."""
    for name, flag in (("ttt_steps", "--ttt-steps"), ("epochs", "--epochs"), ("answer_batch", "--answer-batch"),
                       ("head_layers", "--head-layers")):
        with pytest.raises(UserError, match=f"^{flag} must be >= 1, got 0$"):
            TrainConfig(**{name: 0})
    with pytest.raises(UserError, match="^--ce-weight must be >= 0, got -0.5$"):
        TrainConfig(ce_weight=-0.5)
    assert TrainConfig(n_prompts=0, n_context=0).n_prompts == 0


def _bad_heads(tiny, trained, root):
    """(dir, expected error fragment) for heads that must be refused."""
    out, _ = trained
    cases = []
    wrong = root / "hidden"  # a head for a target with another hidden size
    other = {**tiny.config, "hidden_size": 32, "intermediate_size": 64}
    save_head(new_head(other), wrong, head_config(other))
    cases.append((wrong, "hidden size 32"))
    vocab = root / "vocab"
    vocab.mkdir()
    (vocab / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    (vocab / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), "vocab_size": 999}))
    cases.append((vocab, "vocabulary of 999"))
    nod2t = root / "nod2t"
    nod2t.mkdir()
    (nod2t / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    (nod2t / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                   "draft_vocab_size": 32}))
    cases.append((nod2t, "no d2t"))
    layers = root / "layers"  # fuses a layer this target does not have
    layers.mkdir()
    (layers / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    (layers / "config.json").write_text(json.dumps({**cfg, "quantspec_eagle": {"fuse_layers": [5]}}))
    cases.append((layers, "fuses layer 5;"))
    for name, n in (("two", 2), ("zero", 0)):  # config.json's layer count is not the weights'
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
        (root / name / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}))
    cases.append((root / "two", "is not a 2-layer EAGLE head (num_hidden_layers in its config.json): "
                                "missing ['layers.1"))
    cases.append((root / "zero", "num_hidden_layers 0 in config.json; expected 1 or more"))
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((out / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    cases.append((pickled, "pickled weights are code"))
    shape = root / "shape"
    state = load_file(out / "model.safetensors")
    state["layers.0.mlp.up_proj.weight"] = torch.zeros(7, tiny.config["hidden_size"], dtype=torch.bfloat16)
    shape.mkdir()
    save_file(state, str(shape / "model.safetensors"))
    (shape / "config.json").write_text((out / "config.json").read_text())
    cases.append((shape, "up_proj.weight has shape (7,"))
    cases.append((root / "missing", "not a directory"))
    return cases


def test_bad_heads_refused_in_one_line(tiny, trained, tmp_path, tiny_llama_dir, data_dir, capsys):
    for path, needle in _bad_heads(tiny, trained, tmp_path):
        with pytest.raises(UserError, match=re.escape(needle)):
            SpeculativeDecoder(tiny, f"eagle:{path}", 2)
        with pytest.raises(SystemExit) as exc:
            main(["accept", str(tiny_llama_dir), "--spec", f"eagle:{path}", "--k", "1", "-n", "1", "--output-len", "4",
                  "--dtype", "fp32", "--data-dir", str(data_dir)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


def test_train_draft_cli(tiny_llama_dir, data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train-draft", str(tiny_llama_dir), "--output-dir", str(tmp_path / "h"), "-n", "4",
              "--max-answer-tokens", "16", "--wikitext", "2", "--wikitext-len", "32", "--epochs", "1", "--batch", "2",
              "--dtype", "fp32", "--data-dir", str(data_dir), "--ttt-steps", "2", "--context-prompts", "2",
              "--context-len", "32", "--fuse-layers", "0", "--head-layers", "2", "--ce-weight", "0.5"])
    assert exc.value.code == 0
    assert (tmp_path / "h" / "model.safetensors").exists()
    assert json.loads((tmp_path / "h" / "config.json").read_text())["quantspec_eagle"]["train"]["ttt_steps"] == 2
    saved = json.loads((tmp_path / "h" / "config.json").read_text())["quantspec_eagle"]
    assert saved["train"]["n_context"] == 2 and saved["fuse_layers"] == [0]
    assert saved["train"]["ce_weight"] == 0.5 and saved["train"]["head_layers"] == 2
    assert json.loads((tmp_path / "h" / "config.json").read_text())["num_hidden_layers"] == 2
    out = capsys.readouterr().out
    assert "eagle:" in out and "per chain step" in out and "4 Alpaca and 2 long-context answers" in out
    with pytest.raises(SystemExit) as exc:
        main(["train-draft", str(tiny_llama_dir), "--output-dir", str(tmp_path / "x"), "--epochs", "0"])
    assert exc.value.code == 2


# ---- EAGLE-3 feature fusion ----

def test_decoder_keeps_the_fused_layers_outputs(tiny):
    """``keep_hidden((0,))`` stores layer 0's output, then the final-norm state, for every position; logits are
    unchanged. Negative control: the other layer's output is not what it stored."""
    outputs = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o[0]))
             for n, layer in enumerate(tiny.model.layers)]
    try:
        plain, fused = Decoder(tiny, 64), Decoder(tiny, 64)
        plain.keep_hidden()
        fused.keep_hidden((0,))
        ids = [1, 5, 9, 40, 7]
        assert torch.equal(plain.forward(ids), fused.forward(ids))
    finally:
        for h in hooks:
            h.remove()
    d = tiny.model.args.dim
    assert fused.hidden.shape[1] == 2 * d
    assert torch.equal(fused.hidden[:5, -d:], plain.hidden[:5])
    assert torch.equal(fused.hidden[:5, :d], outputs[0])
    assert not torch.allclose(fused.hidden[:5, :d], outputs[1], atol=1e-3)
    with pytest.raises(UserError, match="already keeps"):
        fused.keep_hidden((1,))
    compiled = Decoder(tiny, 64, compile_mode="default")
    compiled.keep_hidden(())  # the final hidden state alone: the compiled steps return it
    assert compiled.step_label == "compiled (default)"
    fell = Decoder(tiny, 64, compile_mode="default")
    fell.keep_hidden((0,))  # intermediate layers: the compiled steps do not return them, so decoding goes eager
    assert fell.compile_mode is None and fell.step_label.startswith("eager (fallback: a fused EAGLE head")


@pytest.fixture(scope="module")
def fused(tiny, data_dir, tmp_path_factory):
    from dataclasses import replace

    out = tmp_path_factory.mktemp("fused")
    return out, train_head(tiny, out, replace(FAST, epochs=4, fuse_layers=(0,)), data_dir)


def test_fused_head_layout_and_exact_drafting(fused, tiny):
    """A fused head saves fuse.weight [dim, 2*dim] and the layers it reads; speculation with it is token-exact;
    vLLM's EAGLE-1 loader (which has no fuse.weight) is refused in one line; another target's layer count too."""
    from serving.backends.base import ServingConfig
    from evals.config import Config
    from serving.backends.vllm_engine import speculative_config

    out, result = fused
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantspec_eagle"]["fuse_layers"] == [0] and result.config["fuse_layers"] == (0,)
    d = tiny.model.args.dim
    assert load_file(out / "model.safetensors")["fuse.weight"].shape == (d, 2 * d)
    sd = SpeculativeDecoder(tiny, f"eagle:{out}", 3)
    for p in PROMPTS[:2]:
        ids = tiny.tokenizer.encode(p)
        assert sd.generate(ids, 40, ignore_eos=True).tokens == Decoder(tiny).generate(ids, 40, ignore_eos=True).tokens
    assert sd.decoder.hidden.shape[1] == 2 * d
    with pytest.raises(UserError, match="fuses the target's layers"):
        speculative_config(ServingConfig(Config.parse(model=str(tiny.path), backend="vllm", spec=f"eagle:{out}", k=3),
                                         max_model_len=256))
    with pytest.raises(UserError, match="target has layers 0..0 before its last"):
        new_head(tiny.config, fuse_layers=(1,))


# ---- more than one layer ----

def test_two_layer_head_saves_vllm_layout_and_drafts_exactly(tiny, data_dir, tmp_path):
    """--head-layers 2 saves num_hidden_layers 2 and layers.1.* with an input norm (layer 0 has none), loads back as
    two layers and drafts token-exactly; vLLM's EAGLE-1 loader builds num_hidden_layers layers, so vLLM takes it."""
    from dataclasses import replace

    from serving.backends.base import ServingConfig
    from evals.config import Config
    from serving.backends.vllm_engine import speculative_config

    out = tmp_path / "two"
    result = train_head(tiny, out, replace(FAST, epochs=2, head_layers=2), data_dir)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert result.config["head_layers"] == 2
    names = set(load_file(out / "model.safetensors"))
    assert "layers.1.input_layernorm.weight" in names and "layers.0.input_layernorm.weight" not in names
    assert names == set(expected_shapes(tiny.model.args, (), 2))
    sd = SpeculativeDecoder(tiny, f"eagle:{out}", 3)
    assert len(sd.proposer.head.layers) == 2
    for p in PROMPTS[:2]:
        ids = tiny.tokenizer.encode(p)
        assert sd.generate(ids, 40, ignore_eos=True).tokens == Decoder(tiny).generate(ids, 40, ignore_eos=True).tokens
    spec = speculative_config(ServingConfig(Config.parse(model=str(tiny.path), backend="vllm", spec=f"eagle:{out}",
                                                         k=3), max_model_len=256))
    assert spec["method"] == "eagle" and spec["model"] == str(out)


# ---- the search-space axis ----

def test_search_space_eagle_axis(trained, tiny_llama_dir, tmp_path):
    """``eagle:PATH`` is a proposer choice like ngram: the (toy-evaluated) search samples it with K and, as the
    only speculative choice, its best trial is an eagle one."""
    from studies.search import run_search
    from test_search import ToyEvaluator, settings, toy_space

    out, _ = trained
    space = toy_space(tiny_llama_dir, weights=["none", "w8ch-sym"], kv=["none"], proposers=["none", f"eagle:{out}"],
                      k=(2, 4))
    outcome = run_search(settings(tmp_path, space, n_trials=8, sampler="random"), ToyEvaluator())
    configs = [t.user_attrs["config"] for t in outcome.study.trials if t.state.name == "COMPLETE"]
    assert {c["proposer"] for c in configs} == {"none", f"eagle:{out}"}
    assert all(2 <= c["k"] <= 4 for c in configs if c["proposer"] != "none")
    assert outcome.study.best_trial.user_attrs["config"]["proposer"] == f"eagle:{out}"


def test_search_space_refuses_bad_head_before_the_search(tiny, trained, tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """Every head the proposer refuses fails the space in one line; `quantspec search` exits 2 before any study."""
    from studies.space import SearchSpace, load_space

    for path, needle in _bad_heads(tiny, trained, tmp_path):
        with pytest.raises(UserError, match=re.escape(needle)):
            SearchSpace(model=str(tiny_llama_dir), proposers=["none", f"eagle:{path}"])
    with pytest.raises(UserError, match="eagle needs a head directory"):
        SearchSpace(model=str(tiny_llama_dir), proposers=["eagle"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="runs/eagle-head is not a directory"):
        load_space("eagle", model=str(tiny_llama_dir))  # the shipped space, before its head is trained
    with pytest.raises(SystemExit) as exc:
        main(["search", "--model", str(tiny_llama_dir), "--spec", f"none,eagle:{tmp_path / 'missing'}",
              "--study-dir", str(tmp_path / "study"), "--n-trials", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a directory" in err[0], err
    assert not (tmp_path / "study").exists()


# ---- check-lossless ----

def test_check_lossless_cli_eagle(trained, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """`quantspec check-lossless --spec eagle:DIR` on the tiny target with its lm_head x20 (peaked p; the hidden
    states the head reads are unchanged by the scaling): greedy token-exact, sampled first steps at T=1 within the
    exact-sampler noise, first-position acceptance at Σ min(p, q); and it fails when sampled verification always
    accepts (the negative control of tests/test_specdec.py)."""
    from test_specdec import assert_always_accept_fails, run_cli, save_head_scaled

    out, _ = trained
    target_dir = save_head_scaled(tiny_llama_dir, tmp_path / "peaked", 20.0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abcabcabc abc"}))
    args = ["check-lossless", str(target_dir), "--spec", f"eagle:{out}", "--k", "3", "--dataset-name", str(prompts),
            "-n", "1", "--output-len", "16", "--samples", "300", "--prefixes", "1", "--synthetic-samples", "2000",
            "--temperature", "1.0", "--dtype", "fp32", "--threads", "1", "--json", str(tmp_path / "ok.json")]
    assert run_cli(args) == 0
    results = json.loads((tmp_path / "ok.json").read_text())
    first = results["results"]["first_step"][0]
    assert results["engine"]["config"]["proposer"] == f"eagle:{out}"
    assert first["passed"] and first["acceptance"]["rounds"] == 300 and first["acceptance"]["expected"] < 0.8
    assert_always_accept_fails(args, tmp_path, monkeypatch, capsys)


# ---- bench/spec_quant.py ----

def test_spec_quant_bench_smoke(trained, tiny_llama_dir, data_dir, tmp_path):
    """The coupling-table script at tiny settings: target none / w8ch-sym x head fp32 / int8, one Spec-Bench prompt,
    8 tokens; one run record with the six conditions, per-position acceptance and greedy equality per condition."""
    out, _ = trained
    root = Path(__file__).resolve().parents[1]
    result = tmp_path / "spec_quant.json"
    done = subprocess.run([sys.executable, str(root / "bench" / "spec_quant.py"), "--head-dir", str(out), "--model",
                           str(tiny_llama_dir), "--dtype", "fp32", "--threads", "1", "--per-category", "1", "--tasks",
                           "mt_bench", "--max-new-tokens", "8", "--ks", "2", "--targets", "none,w8ch-sym", "--data-dir",
                           str(data_dir), "--note", "smoke", "--out", str(result)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(result.read_text())
    assert {"model", "hardware", "lengths", "arrival", "engine", "metric"} <= set(record)
    assert record["name"] == "spec-quant" and record["lengths"]["output_tokens"] == {"fixed": 8}
    conditions = record["results"]["conditions"]
    assert [(c["target"], c["head"]) for c in conditions] == [("none", "fp32"), ("none", "w8ch-sym"),
                                                              ("w8ch-sym", "fp32"), ("w8ch-sym", "w8ch-sym")]
    assert conditions[2]["target_scheme"] == "w8ch-sym" and conditions[1]["proposer"].endswith(",weights=w8ch-sym")
    for c in conditions:
        (row,) = c["rows"]
        assert row["k"] == 2 and len(row["acceptance_per_pos"]) == 2 and row["greedy_equal"] == 1
        assert row["speedup"] > 0 and row["refined_speedup"] > 0 and c["baseline"]["tok_s"] > 0
    assert record["results"]["notes"] == "smoke" and record["results"]["head"]["config"]["kind"] == "eagle1"


# ---- bench/eagle_tree_bound.py ----

@pytest.fixture(scope="module", params=["full vocabulary", "draft vocabulary"])
def tree_head(request, trained, tiny, data_dir, tmp_path_factory):
    if request.param == "full vocabulary":
        return trained[0]
    out = tmp_path_factory.mktemp("reduced-head")
    train_head(tiny, out, dataclasses.replace(FAST, draft_vocab=256), data_dir)
    return out


def test_tree_bound_top1_is_the_proposers_chain(tiny, tree_head):
    """The teacher-forced levels of bench/eagle_tree_bound.py at width 1 are the EAGLE proposer's greedy chain: at
    every chain start, depth 1 is hit when the proposer's first draft is the target's token, depth 2 when its second
    is too; hits only grow with the width. Negative control: target states one position off do not match."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from eagle_tree_bound import draft_tables, top_w_hits

    from runtime.sampling import SamplingConfig

    head, d2t, _ = load_head(tree_head, tiny.config, torch.float32)
    embed, draft_ids, w_draft = draft_tables(tiny.model, d2t)
    sd = SpeculativeDecoder(tiny, f"eagle:{tree_head}", 2)
    prompt = encode_prompt(tiny.tokenizer, PROMPTS[0])
    ids = prompt + Decoder(tiny).generate(prompt, 40, ignore_eos=True).tokens
    sd.decoder.reset()
    sd.decoder.forward(ids)
    hidden = sd.decoder.hidden[: len(ids)].clone()
    first, both = [], []
    for i in range(len(prompt) - 1, len(ids) - 3):
        sd.decoder.reset()
        sd.proposer.reset()
        sd.decoder.forward(ids[: i + 1])
        a, b = sd.proposer.propose(ids[: i + 2], 2, SamplingConfig(0.0), None).tokens
        first.append(a == ids[i + 2])
        both.append(a == ids[i + 2] and b == ids[i + 3])
    hit1, hit2 = top_w_hits(head, embed, w_draft, draft_ids, torch.tensor(ids), hidden, len(prompt) - 1, 4)
    assert hit1[:, 0].tolist() == first and (hit1[:, 0] & hit2[:, 0]).tolist() == both
    assert 0 < sum(first) < len(first)  # both outcomes occur: the comparison can fail
    assert (hit1[:, 1:] >= hit1[:, :-1]).all() and (hit2[:, 1:] >= hit2[:, :-1]).all()
    off = torch.cat((hidden[:1], hidden[:-1]))
    assert top_w_hits(head, embed, w_draft, draft_ids, torch.tensor(ids), off, len(prompt) - 1, 4)[0][:, 0].tolist() != first


def test_tree_bound_bench_smoke(trained, tiny_llama_dir, data_dir, tmp_path):
    """bench/eagle_tree_bound.py at tiny settings: one record with the six conditions; tau = 1 + the depth shares of
    each shape, rows = 1 + w1 + w1*w2, the prediction tau / (V + levels x c)."""
    out, _ = trained
    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps({"results": {"rows": [{"k": 2, "c": 0.1, "acceptance_per_pos": [0.5, 0.2],
                                                       "speedup": 1.1}]}}))
    result = tmp_path / "tree.json"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "eagle_tree_bound.py"), "--head-dir", str(out),
                           "--chain-record", str(chain), "--model", str(tiny_llama_dir), "--threads", "1",
                           "--per-category", "1", "--tasks", "mt_bench", "--max-new-tokens", "12", "--widths", "1,2", "--max-rows", "7",
                           "--data-dir", str(data_dir), "--out", str(result)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(result.read_text())
    assert {"model", "hardware", "lengths", "arrival", "engine", "metric"} <= set(record)
    r = record["results"]
    assert [s["widths"] for s in r["shapes"]] == [[1], [2], [1, 1], [1, 2], [2, 1], [2, 2]]
    for s in r["shapes"]:
        w1, *rest = s["widths"]
        assert s["rows"] == 1 + w1 + (w1 * rest[0] if rest else 0)
        assert s["tau"] == pytest.approx(1 + r["depth1"][str(w1)] + (r["depth2"][f"{w1}x{rest[0]}"] if rest else 0))
        assert s["verify_cost"] == r["verify_cost_curve"][s["rows"] - 1]
        assert s["predicted_speedup"] == pytest.approx(s["tau"] / (s["verify_cost"] + len(s["widths"]) * 0.1))
    assert r["depth1"]["2"] >= r["depth1"]["1"] and r["chain_check"]["measured_k2"] == [0.5, 0.2]
