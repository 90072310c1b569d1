"""The native lm-eval LM scores exactly like lm-eval's HFLM on the same requests (tiny random Llama)."""
import pytest
from lm_eval.api.instance import Instance

from evals.lm_native import NativeLM, PrefixScorer

PAIRS = [("Question: abc\nAnswer:", " yes"), ("Question: abc\nAnswer:", " no way"), ("hello", " world"),
         ("", "start"), ("x" * 300, " tail"), ("Question: abd\nAnswer:", " yes")]


@pytest.fixture(scope="module")
def lms(tiny_llama_dir):
    from lm_eval.models.huggingface import HFLM

    return NativeLM(pretrained=str(tiny_llama_dir), dtype="fp32"), HFLM(pretrained=str(tiny_llama_dir), device="cpu",
                                                          batch_size=4, dtype="float32")


def _requests(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_equals_hflm(lms):
    ours, hf = lms
    reqs = _requests("loglikelihood", PAIRS)  # includes an empty context and one longer than max_length (256)
    for (a, ga), (b, gb) in zip(ours.loglikelihood(reqs, disable_tqdm=True), hf.loglikelihood(reqs, disable_tqdm=True)):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb


def test_shared_prefix_is_not_recomputed(lms):
    ours, _ = lms
    ctx = ours.tok_encode("Question: what is shared?\nAnswer:")
    reqs = [(None, ctx, ours.tok_encode(" a")), (None, ctx, ours.tok_encode(" bc"))]
    before = ours.forward_tokens
    ours._loglikelihood_tokens(reqs, disable_tqdm=True)
    # first request: ctx + 1 input token; second: only its continuation after the last shared position
    assert ours.forward_tokens - before < 2 * len(ctx)


def test_prefix_scorer_matches_fresh_forward(tiny_llama_dir):
    from runtime.loading import load_model

    lm = load_model(tiny_llama_dir)
    a, b = list(range(5, 40)), list(range(5, 30)) + [77, 78, 79]
    scorer = PrefixScorer(lm, 64)
    scorer.logits(a, 0)
    reused = scorer.logits(b, 20)
    fresh = PrefixScorer(lm, 64).logits(b, 20)
    assert (reused - fresh).abs().max() < 1e-4


def test_loglikelihood_rolling_equals_direct_and_hflm(lms):
    ours, hf = lms
    short, long_ = "some text to score", "abc def " * 60  # the second spans several 256-token windows
    rolled = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,), (long_,)]), disable_tqdm=True)
    direct = ours.loglikelihood(_requests("loglikelihood", [("", short)]), disable_tqdm=True)[0][0]
    assert rolled[0] == pytest.approx(direct, abs=1e-4)
    assert rolled[1] == pytest.approx(hf.loglikelihood_rolling(_requests("loglikelihood_rolling", [(long_,)]),
                                                               disable_tqdm=True)[0], abs=1e-3)


def test_generate_until_stops_on_stop_string(lms):
    ours, hf = lms
    free = ours.generate_until(_requests("generate_until", [("abc", {"until": [], "max_gen_toks": 12})]), True)[0]
    assert len(free) > 2
    stop = free[2]  # a character the greedy continuation is known to produce
    cut = ours.generate_until(_requests("generate_until", [("abc", {"until": [stop], "max_gen_toks": 12})]), True)[0]
    assert cut == free.split(stop)[0] and stop not in cut
    assert cut == hf.generate_until(_requests("generate_until", [("abc", {"until": [stop], "max_gen_toks": 12})]), True)[0]


def test_registered_as_lm_eval_model(tiny_llama_dir, data_dir):
    import lm_eval

    from evals.harness import task_manager

    res = lm_eval.simple_evaluate(model="quantspec", model_args=f"pretrained={tiny_llama_dir},threads=1",
                                  tasks=["piqa"], limit=3, task_manager=task_manager(("piqa",), data_dir))
    assert res["config"]["model"] == "quantspec" and 0 <= res["results"]["piqa"]["acc,none"] <= 1


def test_kv_quantized_scores_do_not_depend_on_prefix_reuse(tiny_llama_dir):
    quant = NativeLM(pretrained=str(tiny_llama_dir), kv="k4tok-v4tok", dtype="fp32")
    ctx = quant.tok_encode("Question: which answer is right?\nAnswer:")
    first, second = (None, ctx, quant.tok_encode(" yes")), (None, ctx, quant.tok_encode(" no"))
    after_reuse = quant._loglikelihood_tokens([first, second], disable_tqdm=True)[1][0]
    alone = quant._loglikelihood_tokens([second], disable_tqdm=True)[0][0]
    assert after_reuse == pytest.approx(alone, abs=1e-5)  # context always read from the quantized cache
    dense = NativeLM(loaded=quant.lm)._loglikelihood_tokens([second], disable_tqdm=True)[0][0]
    assert dense != pytest.approx(alone, abs=1e-4) and dense == pytest.approx(alone, rel=0.2)
