"""Run as a script: one vLLM process loads each exported checkpoint in turn and answers the France question
(``python tests/vllm_runner.py '{"NAME": "DIR", ...}'`` prints ``{"NAME": "answer", ...}`` as its last line), or
scores a token sequence (``python tests/vllm_runner.py --logprobs DIR '[ids]'`` prints each token's log-probability
after its prefix, as a JSON list, as its last line)."""
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


if __name__ == "__main__":
    if sys.argv[1] == "--logprobs":
        print(json.dumps(prompt_logprobs(sys.argv[2], json.loads(sys.argv[3]))))
    else:
        print(json.dumps(answer_all(json.loads(sys.argv[1]))))
