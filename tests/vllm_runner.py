"""Run as a script: one vLLM process loads each exported checkpoint in turn and answers the France question
(``python tests/vllm_runner.py '{"NAME": "DIR", ...}'`` prints ``{"NAME": "answer", ...}`` as its last line)."""
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


if __name__ == "__main__":
    print(json.dumps(answer_all(json.loads(sys.argv[1]))))
