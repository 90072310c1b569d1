"""Run as a script: one vLLM process loads each exported checkpoint in turn and answers the France question
(``python tests/vllm_runner.py '{"NAME": "DIR", ...}'`` prints ``{"NAME": "answer", ...}`` as its last line)."""
import json
import sys

PROMPT = "What is the capital of France?"
# in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): an engine starts in ~4 s instead of ~21 s here; the
# engine-core process itself is exercised by the tests that start `vllm serve` and the closed-loop backend
ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


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
