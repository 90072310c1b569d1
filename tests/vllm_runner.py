"""Run as a script: one vLLM process loads each exported checkpoint in turn and answers the France question
(``python tests/vllm_runner.py '{"NAME": "DIR", ...}'`` prints ``{"NAME": "answer", ...}`` as its last line), or
scores a token sequence (``python tests/vllm_runner.py --logprobs DIR '[ids]'`` prints each token's log-probability
after its prefix, as a JSON list, as its last line), or serves configurations through quantspec's vLLM backend
(``python tests/vllm_runner.py --serve '[{Config.parse options}, ...]'`` prints, per configuration, the greedy
token ids of 2 short-short prompts x 16 tokens, closed loop, and the run's speculation counters, as its last
line)."""
import json
import sys

PROMPT = "What is the capital of France?"


def answer_all(dirs: dict[str, str]) -> dict[str, str]:
    import gc

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    answers = {}
    for name, path in dirs.items():
        tok = AutoTokenizer.from_pretrained(path)
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
        llm = LLM(model=path, enforce_eager=True, dtype="bfloat16", max_model_len=512, seed=0)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
        answers[name] = out[0].outputs[0].text
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return answers


def prompt_logprobs(path: str, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, as vLLM computes them from the checkpoint at ``path``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=path, enforce_eager=True, dtype="bfloat16", max_model_len=len(ids) + 8, seed=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [scored[token].logprob for scored, token in zip(out[0].prompt_logprobs[1:], ids[1:])]


def serve_all(points: list[dict]) -> list[dict]:
    """Each point as ``open_backend`` + ``run_benchmark`` serve it, one engine per point, in turn."""
    from evals.config import Config
    from serving.backends import open_backend
    from serving.backends.base import ServingConfig
    from serving.bench_api import run_benchmark
    from serving.loadgen import LoadSpec

    runs = []
    for point in points:
        config = ServingConfig(Config.parse(backend="vllm", **point), max_model_len=512)
        with open_backend(config) as backend:
            res = run_benchmark(config, "short-short", LoadSpec.closed(1), backend=backend, num_prompts=2,
                                output_len=16)
        runs.append({"failed": res.failed or res.summary.get("n_failed", 0) > 0, "spec": res.summary.get("spec"),
                     "token_ids": [r.token_ids for r in res.results]})
    return runs


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        print(json.dumps(serve_all(json.loads(sys.argv[2]))))
    elif sys.argv[1] == "--logprobs":
        print(json.dumps(prompt_logprobs(sys.argv[2], json.loads(sys.argv[3]))))
    else:
        print(json.dumps(answer_all(json.loads(sys.argv[1]))))
