"""Named workloads and prompt files become chat-templated requests of the promised shapes."""
import json

import pytest

from serving.workloads import WORKLOADS, build_requests
from runtime.errors import UserError
from runtime.loading import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def test_registry_has_the_issue_workloads():
    assert {"spec_bench", "mt_bench", "short-short", "long-short", "short-long", "mix"} <= set(WORKLOADS)


@pytest.mark.parametrize("name, n_out", [("short-short", 32), ("long-short", 32), ("short-long", 256)])
def test_shapes(tok, name, n_out, tmp_path):
    requests, source = build_requests(name, tok, num_prompts=3, data_dir=None)
    assert len(requests) == 3 and name in source
    assert all(r.max_tokens == n_out and r.ignore_eos for r in requests)
    assert len({tuple(r.prompt_ids) for r in requests}) == 3  # different text per request


def test_long_prompts_are_longer(tok):
    short, _ = build_requests("short-short", tok, num_prompts=2)
    long, _ = build_requests("long-short", tok, num_prompts=2)
    assert min(len(r.prompt_ids) for r in long) > 4 * max(len(r.prompt_ids) for r in short)


def test_mix_cycles_through_shapes_and_output_len_override(tok):
    requests, _ = build_requests("mix", tok, num_prompts=6)
    assert [r.max_tokens for r in requests] == [32, 32, 256, 32, 32, 256]
    fixed, _ = build_requests("mix", tok, num_prompts=3, output_len=7, ignore_eos=False)
    assert all(r.max_tokens == 7 and not r.ignore_eos for r in fixed)


def test_deterministic_given_seed(tok):
    a, _ = build_requests("short-short", tok, num_prompts=4, seed=3)
    b, _ = build_requests("short-short", tok, num_prompts=4, seed=3)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]


def test_jsonl_path(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(2)))
    requests, source = build_requests(str(path), tok, num_prompts=5, output_len=9)
    assert len(requests) == 5 and str(path) in source and requests[0].max_tokens == 9


@pytest.mark.data
def test_spec_bench_uses_data_dir(tok):
    requests, source = build_requests("spec_bench", tok, num_prompts=4)
    assert len(requests) == 4 and source.startswith("spec_bench")


@pytest.mark.integration
def test_chat_template_applied(default_model_dir):
    requests, _ = build_requests("short-short", load_tokenizer(default_model_dir), num_prompts=1)
    tok = load_tokenizer(default_model_dir)
    assert "<|im_start|>assistant" in tok.decode(requests[0].prompt_ids)
    assert abs(len(requests[0].prompt_ids) - 32) < 40  # ~32 content tokens + the template


@pytest.mark.parametrize("args, needle", [
    (("nope",), "unknown workload"),
    (("short-short", 0), "--num-prompts"),
])
def test_bad_workload(tok, args, needle):
    with pytest.raises(UserError, match=needle):
        build_requests(args[0], tok, *args[1:])


def test_bad_output_len(tok):
    with pytest.raises(UserError, match="--output-len"):
        build_requests("short-short", tok, 2, output_len=0)


@pytest.mark.data
def test_a_position_bound_skips_the_prompts_that_do_not_fit(tok):
    """As vLLM's ShareGPT sampling skips sequences too long: only prompts whose tokens plus output fit the bound,
    in the workload's order; without it (negative control) the same first prompts reach past it."""
    free, _ = build_requests("spec_bench", tok, num_prompts=8, output_len=64, ignore_eos=False)
    assert any(len(r.prompt_ids) + 64 > 256 for r in free)
    bounded, source = build_requests("spec_bench", tok, num_prompts=8, output_len=64, ignore_eos=False,
                                     max_total_tokens=256)
    assert len(bounded) == 8 and all(len(r.prompt_ids) + r.max_tokens <= 256 for r in bounded)
    fitting = [r.prompt_ids for r in free if len(r.prompt_ids) + 64 <= 256]
    assert [r.prompt_ids for r in bounded][:len(fitting)] == fitting and "<= 256 tokens" in source
    with pytest.raises(UserError, match="no spec_bench prompt fits 8 positions"):
        build_requests("spec_bench", tok, num_prompts=2, output_len=4, max_total_tokens=8)
    with pytest.raises(UserError, match="longer than 100 positions"):
        build_requests("long-short", tok, num_prompts=2, max_total_tokens=100)
